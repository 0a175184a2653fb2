"""Chained block hashes.

Block ``i``'s hash is ``sha256(hash(block i-1) || token ids of block i)``, and block 0's parent is a root hash made of
a per-cache seed, the model identity and an optional salt. So block ``i``'s hash certifies the whole prefix
``[0, (i + 1) * block_size)`` and everything that changes the meaning of those tokens. The idea follows vLLM's prefix
caching (``vllm/v1/core/kv_cache_utils.py``), which moved to SHA-256 because weaker block hashes can be collided on
purpose; stored blocks also keep their token ids, and a hit re-compares them (as nano-vllm does).
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from collections.abc import Sequence
from typing import NewType

import torch

BlockHash = NewType("BlockHash", bytes)


def hash_seed(seed: bytes | None) -> bytes:
    """``seed``, or 32 random bytes when it is None.

    Raises:
        ValueError: ``seed`` is neither bytes nor None.
    """
    if seed is not None and not isinstance(seed, bytes):
        raise ValueError(f"`seed` must be bytes (e.g. b'my-app') or None for a random one, got {type(seed).__name__}.")
    return os.urandom(32) if seed is None else seed


def root_hash(seed: bytes, model_identity: str, salt: str | None = None) -> BlockHash:
    """The parent hash of block 0: mixes the per-cache seed, the model identity and the cache salt."""
    h = hashlib.sha256(b"hf_hybridcache-root\0")
    for part in (seed, model_identity.encode(), (salt or "").encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return BlockHash(h.digest())


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block of ``token_ids`` (Python ints) chained to ``parent``."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    return BlockHash(h.digest())


def chain_hashes(parent: BlockHash, token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, in order; a trailing partial block is not hashed."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


#: Config entries that do not change the states a model computes: where it was loaded from, the version that wrote
#: the config file, the class names and dtype that ``save_pretrained`` records (the model's dtype is mixed in itself).
NON_IDENTITY_CONFIG_KEYS = ("_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype")


def identity_config(model: torch.nn.Module) -> dict:
    """The model's config as a JSON-ready dict, without :data:`NON_IDENTITY_CONFIG_KEYS`."""
    config = model.config.to_dict()
    for key in NON_IDENTITY_CONFIG_KEYS:
        config.pop(key, None)
    return json.loads(json.dumps(config, sort_keys=True, default=str))


def model_identity(model: torch.nn.Module, deterministic: bool = False) -> str:
    """A stable string naming the model class, config (:func:`identity_config`), dtype and, when on, deterministic
    mode, mixed into every block hash: the same model loaded from another folder, or saved with ``save_pretrained``
    meanwhile, keeps it. Deterministic mode's states come from other arithmetic than the default mode's (bitwise
    equal only among themselves), so its entries never meet the other mode's, in a remote tier or a file."""
    payload = {"class": type(model).__name__, "dtype": str(model.dtype), "config": identity_config(model)}
    if deterministic:
        payload["deterministic"] = True
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
