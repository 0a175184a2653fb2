"""The tier's wire format: where an entry lives (its key) and its value, safetensors bytes that verify themselves.

A KV block is stored under ``{prefix}:{FORMAT}:kv:{block hash hex}`` and holds ``keys.{layer}`` ``[Hkv,
block_size, Dk]`` and ``values.{layer}`` ``[Hkv, block_size, Dv]`` per attention layer (two tensors: MLA layers cache
keys and values of different widths); a checkpoint is stored under ``{prefix}:{FORMAT}:ck:{block hash hex}`` (the
hash of the block that ends at it) and holds ``conv.{layer}`` ``[1, C, W]`` and ``ssm.{layer}`` per Mamba layer, in
the stored dtypes. The safetensors metadata names the format, the kind, the block hash, the block's token ids and a
SHA-256 over every tensor's name, shape, dtype and bytes. Decoding checks all of it against what the reader expects
(the hash it computed from its own prompt, the prompt's tokens, its model's shapes and dtypes) and returns None for
anything that does not fit, so a corrupt, truncated, tampered or foreign entry is a miss. Never pickle: safetensors
and JSON cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import logging

import torch
from safetensors.torch import load, save

from ..config import ModelStateSpec
from ..hashing import BlockHash
from ..kernels.paged_copy import KVBlock
from ..store import LayerState

logger = logging.getLogger("hf_hybridcache")

#: Bump when the value layout changes: keys of other formats are never read.
FORMAT = "hfhc-remote/2"


def kv_key(prefix: str, block_hash: BlockHash) -> str:
    return f"{prefix}:{FORMAT}:kv:{block_hash.hex()}"


def checkpoint_key(prefix: str, block_hash: BlockHash) -> str:
    return f"{prefix}:{FORMAT}:ck:{block_hash.hex()}"


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _encode(kind: str, block_hash: BlockHash, token_ids, tensors: dict[str, torch.Tensor]) -> bytes:
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    metadata = {
        "format": FORMAT,
        "kind": kind,
        "block_hash": block_hash.hex(),
        "token_ids": json.dumps(list(token_ids)),
        "sha256": _digest(tensors),
    }
    return save(tensors, metadata=metadata)


def encode_kv(block_hash: BlockHash, token_ids, kv: dict[int, KVBlock]) -> bytes:
    """A KV block ``{attention layer idx: (keys [Hkv, block_size, Dk], values [Hkv, block_size, Dv])}`` as
    safetensors bytes."""
    tensors = {}
    for idx, (keys, values) in kv.items():
        tensors[f"keys.{idx}"], tensors[f"values.{idx}"] = keys, values
    return _encode("kv", block_hash, token_ids, tensors)


def encode_checkpoint(block_hash: BlockHash, token_ids, states: dict[int, LayerState]) -> bytes:
    """A checkpoint ``{mamba layer idx: (conv [1, C, W], ssm)}`` as safetensors bytes."""
    tensors = {}
    for idx, (conv, ssm) in states.items():
        tensors[f"conv.{idx}"], tensors[f"ssm.{idx}"] = conv, ssm
    return _encode("checkpoint", block_hash, token_ids, tensors)


def _expected(kind: str, spec: ModelStateSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if kind == "kv":
        bs, expected = spec.block_size, {}
        for a in spec.attention:
            expected[f"keys.{a.layer_idx}"] = ((a.num_kv_heads, bs, a.head_dim), a.dtype)
            expected[f"values.{a.layer_idx}"] = ((a.num_kv_heads, bs, a.value_head_dim), a.dtype)
        return expected
    expected = {}
    for m in spec.mamba:
        expected[f"conv.{m.layer_idx}"] = ((1, *m.conv.shape), m.conv.dtype)
        expected[f"ssm.{m.layer_idx}"] = ((1, *m.ssm.shape), m.ssm.dtype)
    return expected


def decode(
    value: bytes | None, kind: str, block_hash: BlockHash, token_ids, spec: ModelStateSpec
) -> dict[str, torch.Tensor] | None:
    """The tensors of an entry of ``kind`` (``"kv"`` or ``"checkpoint"``) for the block ``block_hash`` holding
    ``token_ids``, on the CPU; None unless the value is an intact entry of exactly that block, kind and model
    layout."""
    if value is None:
        return None
    try:
        tensors = load(value)
        with_meta = _metadata(value)
    except Exception as error:  # safetensors raises several types for truncated or garbled bytes
        logger.debug("a remote %s entry cannot be read as safetensors: %s", kind, error)
        return None
    fits = (
        with_meta.get("format") == FORMAT
        and with_meta.get("kind") == kind
        and with_meta.get("block_hash") == block_hash.hex()
        and with_meta.get("token_ids") == json.dumps(list(token_ids))
        and {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()} == _expected(kind, spec)
        and with_meta.get("sha256") == _digest(tensors)
    )
    if not fits:
        logger.debug("a remote %s entry does not verify (corrupt, tampered or foreign); treated as a miss", kind)
        return None
    return tensors


def _metadata(value: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (``load`` returns tensors only)."""
    header_bytes = int.from_bytes(value[:8], "little")
    header = json.loads(value[8 : 8 + header_bytes])
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise ValueError("metadata is not a mapping")
    return metadata


def kv_tensors(tensors: dict[str, torch.Tensor]) -> dict[int, KVBlock]:
    """Decoded KV tensors as ``{attention layer idx: (keys, values)}``."""
    layers = {int(name.split(".")[1]) for name in tensors}
    return {idx: (tensors[f"keys.{idx}"], tensors[f"values.{idx}"]) for idx in sorted(layers)}


def checkpoint_states(tensors: dict[str, torch.Tensor]) -> dict[int, LayerState]:
    """Decoded checkpoint tensors as ``{mamba layer idx: (conv, ssm)}``."""
    layers = {int(name.split(".")[1]) for name in tensors}
    return {idx: (tensors[f"conv.{idx}"], tensors[f"ssm.{idx}"]) for idx in sorted(layers)}
