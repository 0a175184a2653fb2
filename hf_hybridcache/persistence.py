"""Saving a cache to one file and loading it back: safetensors for the tensors, JSON for the rest, never pickle.

A file holds, per attention layer, the stored KV blocks stacked ``keys.{layer} [num_blocks, Hkv, block_size, Dk]``
and ``values.{layer} [num_blocks, Hkv, block_size, Dv]`` (two tensors: MLA layers cache keys and values of
different widths) and, per Mamba layer, the checkpoints stacked ``conv.{layer} [num_checkpoints, C, W]`` and
``ssm.{layer} [num_checkpoints, ...]``, in the stored dtypes. The safetensors header's metadata carries a JSON document — versions,
the model identity and a fingerprint of its weights, the options, the hash seed, the block tree (parent, token ids
and hash per block), which blocks have a checkpoint and the recency order — plus SHA-256 checksums of that JSON and
of every tensor. Loading checks everything before it builds anything, so a file that is truncated, corrupted or made
for another model is refused with a ``ValueError`` and nothing in memory changes.

Loading cannot run code (safetensors and JSON only), but a cache file decides what the model "remembers" for a
prefix: load only files you trust, as you would a checkpoint of weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import _compat
from .config import ModelStateSpec
from .hashing import BlockHash, block_hash, identity_config, model_identity
from .models import support_for
from .store import StoredBlock
from .weights import weights_fingerprint

#: Version 2: the weights state (weights fingerprint and adapters) is part of every hash root. Version 3: keys and
#: values of a layer are two tensors (``keys.{layer}``, ``values.{layer}``) instead of one ``kv.{layer}
#: [num_blocks, 2, Hkv, block_size, D]``.
FORMAT = "hf_hybridcache/3"
#: Older formats that load: version 2 files' ``kv.{layer}`` tensors are split into keys and values on reading.
READABLE_FORMATS = ("hf_hybridcache/2", FORMAT)


def save_cache(cache, path: str | os.PathLike) -> None:
    """Write ``cache``'s stored entries to ``path`` (see the module docstring). The caller holds the cache's lock.

    Raises:
        ValueError: ``path`` is a directory, or its directory does not exist.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        example = os.path.join(path, "cache.safetensors")
        raise ValueError(f"{path!r} is a directory; pass a file path such as {example!r}.")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"The folder {folder!r} does not exist; create it first (os.makedirs) or save elsewhere.")
    stored, recency = cache._store.export_entries()  # parents before children
    index = {block.block_id: i for i, block in enumerate(stored)}
    with_checkpoint = [block for block in stored if block.checkpoint is not None]
    tensors = _stack_entries(cache.spec, stored, with_checkpoint)
    blocks = [
        [-1 if block.parent_id is None else index[block.parent_id], list(block.token_ids), block.block_hash.hex()]
        for block in stored
    ]
    meta = {
        "versions": _versions(),
        "model": _model_facts(cache.model),
        "options": {
            "block_size": cache.block_size,
            "retention_interval": cache.options.retention_interval,
            "max_cache_bytes": cache.max_cache_bytes,
            "admit_divergence": cache.options.admit_divergence,
            "eviction": cache.options.eviction,
            "replay_replies": cache.options.replay_replies,
        },
        "seed": cache._shared.seed.hex(),
        "blocks": blocks,
        "checkpoints": [index[block.block_id] for block in with_checkpoint],
        "recency": [[kind, index[block_id]] for kind, block_id in recency],
        "tensor_sha256": {name: _tensor_digest(t) for name, t in tensors.items()},
    }
    text = json.dumps(meta, sort_keys=True, default=str)
    metadata = {"format": FORMAT, "meta": text, "meta_sha256": hashlib.sha256(text.encode()).hexdigest()}
    _write_atomically(tensors, metadata, path)


def load_cache(cls, path, model, max_cache_bytes, retention_interval, offload, remote=None):
    """A new ``cls`` (HybridPrefixCache) for ``model`` holding the entries saved at ``path``; see
    :meth:`HybridPrefixCache.load`."""
    path = os.fspath(path)
    meta, tensors = _read(path)
    try:
        _check_model(meta, model, path)
    except (KeyError, TypeError, AttributeError, RecursionError) as error:
        raise _invalid(path, f"its metadata lacks {error}") from error
    try:
        options, seed = meta["options"], bytes.fromhex(meta["seed"])
        spec = support_for(model).spec_for(model, options["block_size"])
        plan = _check_entries(meta, tensors, spec, model)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError) as error:
        raise _invalid(path, f"its entries do not fit this model ({error})") from error
    cache = cls(
        model,
        block_size=options["block_size"],
        retention_interval=options["retention_interval"] if retention_interval is None else retention_interval,
        max_cache_bytes=options["max_cache_bytes"] if max_cache_bytes is None else max_cache_bytes,
        seed=seed,
        offload=offload,
        remote=remote,
        **{name: options[name] for name in ("admit_divergence", "eviction", "replay_replies") if name in options},
    )
    _fill(cache, meta, tensors, plan)
    if cache.remote is not None:
        cache.remote.publish_all()
    return cache


# ---------------------------------------------------------------------- writing


def _stack_entries(spec: ModelStateSpec, blocks: list[StoredBlock], with_checkpoint: list[StoredBlock]) -> dict:
    """Entries stacked per layer, in host memory (one block at a time leaves its device, so saving never needs
    twice the cache's size on a device)."""
    tensors = {}
    if blocks:
        for attn in spec.attention:
            for half, name in enumerate(("keys", "values")):
                stored = [block.kv[attn.layer_idx][half].cpu() for block in blocks]
                tensors[f"{name}.{attn.layer_idx}"] = torch.stack(stored)
    if with_checkpoint:
        for m in spec.mamba:
            states = [block.checkpoint[m.key] for block in with_checkpoint]
            tensors[f"conv.{m.name}"] = torch.cat([conv.cpu() for conv, _ in states])
            tensors[f"ssm.{m.name}"] = torch.cat([ssm.cpu() for _, ssm in states])
    return {name: t.contiguous() for name, t in tensors.items()}


def _write_atomically(tensors: dict, metadata: dict, path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{id(tensors):x}"
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy()).hexdigest()


def _versions() -> dict:
    from . import __version__

    return {"hf_hybridcache": __version__, "transformers": _compat.TRANSFORMERS_VERSION}


def _model_facts(model) -> dict:
    return {
        "class": type(model).__name__,
        "dtype": str(model.dtype),
        "identity": model_identity(model),
        "config": identity_config(model),
        "weights_sha256": weights_fingerprint(model),
    }


# ---------------------------------------------------------------------- reading and checking


def _invalid(path: str, why: str) -> ValueError:
    return ValueError(f"{path!r} is not a usable hf_hybridcache cache file: {why}. Nothing was loaded.")


def _read(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The metadata and all tensors (in host memory) of a cache file, checksums verified."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No cache file at {path!r}; write one with cache.save(path).")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, RuntimeError) as error:
        raise _invalid(path, f"it cannot be read as safetensors, so it is truncated or corrupted ({error})") from error
    if metadata.get("format") not in READABLE_FORMATS:
        raise _invalid(path, f"its format is {metadata.get('format')!r}, expected {FORMAT!r} (written by cache.save)")
    text = metadata.get("meta", "")
    if hashlib.sha256(text.encode()).hexdigest() != metadata.get("meta_sha256"):
        raise _invalid(path, "the checksum of its metadata does not match, so it is corrupted")
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as error:  # a crafted file can nest deeper than the parser's stack
        raise _invalid(path, f"its metadata is not usable JSON ({type(error).__name__})") from error
    digests = meta.get("tensor_sha256", {}) if isinstance(meta, dict) else None
    if not isinstance(digests, dict) or set(digests) != set(tensors):
        raise _invalid(path, f"it holds tensors {sorted(tensors)} that its metadata does not list")
    for name, tensor in tensors.items():
        if _tensor_digest(tensor) != digests[name]:
            raise _invalid(path, f"the checksum of tensor {name!r} does not match, so it is corrupted")
    return meta, _split_stacked_kv(tensors)


def _split_stacked_kv(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Version 2's ``kv.{layer} [n, 2, Hkv, bs, D]`` as version 3's ``keys.{layer}`` and ``values.{layer}``; a
    tensor of another shape is left to the shape check."""
    split = {}
    for name, tensor in tensors.items():
        if name.startswith("kv.") and tensor.dim() == 5 and tensor.shape[1] == 2:
            layer = name[len("kv."):]
            split[f"keys.{layer}"], split[f"values.{layer}"] = tensor[:, 0], tensor[:, 1]
        else:
            split[name] = tensor
    return split


def _check_model(meta: dict, model, path: str) -> None:
    """Refuse a file made under other versions or for another model, saying what differs."""
    saved, running = meta["versions"], _versions()
    for package in ("transformers", "hf_hybridcache"):
        if saved.get(package) != running[package]:
            raise ValueError(
                f"{path!r} was saved with {package} {saved.get(package)} but {running[package]} is running; stored "
                f"states are only reused under the versions that computed them. Build a new cache (or run "
                f"{package} {saved.get(package)})."
            )
    support_for(model)
    facts, current = meta["model"], _model_facts(model)
    if facts["class"] != current["class"] or facts["dtype"] != current["dtype"]:
        raise ValueError(
            f"{path!r} was saved for a {facts['class']} in {facts['dtype']}, not this {current['class']} in "
            f"{current['dtype']}; load it with the model it was saved for (same class and dtype)."
        )
    if facts["config"] != current["config"]:
        keys = sorted(k for k in set(facts["config"]) | set(current["config"])
                      if facts["config"].get(k) != current["config"].get(k))
        diff = ", ".join(f"{k}: saved {facts['config'].get(k)!r}, now {current['config'].get(k)!r}" for k in keys[:5])
        raise ValueError(f"{path!r} was saved for a model with another config ({diff}); load it with that model.")
    if facts["weights_sha256"] != current["weights_sha256"] or facts["identity"] != current["identity"]:
        raise ValueError(
            f"{path!r} was saved for a model with the same config but other weights (another checkpoint or a "
            "fine-tune); its stored states would be wrong for this one. Load it with the model it was saved for."
        )


def _check_entries(meta: dict, tensors: dict, spec: ModelStateSpec, model) -> dict:
    """Check the block tree, checkpoints, recency order and tensor shapes against ``spec``; return the insertion plan
    ``{"checkpoints": [block index per tensor row], "recency": [(kind, block index)] oldest first}``.

    Raises:
        ValueError: anything that does not fit.
    """
    blocks, bs = meta["blocks"], spec.block_size
    vocab_size = model.get_input_embeddings().num_embeddings
    if len({hash_hex for _, _, hash_hex in blocks}) != len(blocks):
        raise ValueError("a block hash is stored twice")
    for i, (parent, token_ids, hash_hex) in enumerate(blocks):
        if not -1 <= parent < i:
            raise ValueError(f"block {i} has parent {parent}, which is not stored before it")
        if len(token_ids) != bs or not all(isinstance(t, int) and 0 <= t < vocab_size for t in token_ids):
            raise ValueError(f"block {i} does not hold {bs} token ids of the vocabulary")
        if parent >= 0 and block_hash(BlockHash(bytes.fromhex(blocks[parent][2])), token_ids).hex() != hash_hex:
            raise ValueError(f"block {i}'s hash does not chain from its parent's")
    checkpoints = meta["checkpoints"]
    if len(set(checkpoints)) != len(checkpoints) or not all(0 <= i < len(blocks) for i in checkpoints):
        raise ValueError("checkpoints refer to blocks that are not stored")
    recency = [(kind, i) for kind, i in meta["recency"]]
    entries = {("kv", i) for i in range(len(blocks))} | {("checkpoint", i) for i in checkpoints}
    if len(recency) != len(entries) or set(recency) != entries:
        raise ValueError("the recency order does not list every stored entry once")
    expected = {}
    if blocks:
        for a in spec.attention:
            expected[f"keys.{a.layer_idx}"] = ((len(blocks), a.num_kv_heads, bs, a.head_dim), a.dtype)
            expected[f"values.{a.layer_idx}"] = ((len(blocks), a.num_kv_heads, bs, a.value_head_dim), a.dtype)
    if checkpoints:
        for m in spec.mamba:
            expected[f"conv.{m.name}"] = ((len(checkpoints), *m.conv.shape), m.conv.dtype)
            expected[f"ssm.{m.name}"] = ((len(checkpoints), *m.ssm.shape), m.ssm.dtype)
    got = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    if got != expected:
        raise ValueError(f"tensors {got} do not match the model's layers {expected}")
    return {"checkpoints": list(checkpoints), "recency": recency}


# ---------------------------------------------------------------------- filling the new cache


def _fill(cache, meta: dict, tensors: dict, plan: dict) -> None:
    """Insert the entries that fit the budget (the most recently used), in their recency order."""
    spec = cache.spec
    keep = _entries_within_budget(plan["recency"], meta["blocks"], spec, cache._store.max_cache_bytes)
    rows = {i: row for row, i in enumerate(plan["checkpoints"]) if ("checkpoint", i) in keep}
    blocks = []
    for i, (parent, token_ids, hash_hex) in enumerate(meta["blocks"]):
        if ("kv", i) not in keep:
            continue
        kv = {a.layer_idx: (tensors[f"keys.{a.layer_idx}"][i].clone(), tensors[f"values.{a.layer_idx}"][i].clone())
              for a in spec.attention}
        checkpoint = None if i not in rows else {
            m.key: (tensors[f"conv.{m.name}"][rows[i] : rows[i] + 1].clone(),
                    tensors[f"ssm.{m.name}"][rows[i] : rows[i] + 1].clone())
            for m in spec.mamba
        }
        blocks.append(StoredBlock(i, None if parent < 0 else parent, tuple(token_ids),
                                  BlockHash(bytes.fromhex(hash_hex)), kv, checkpoint))
    cache._store.import_entries(blocks, [key for key in plan["recency"] if key in keep])


def _entries_within_budget(recency: list, blocks: list, spec: ModelStateSpec, max_cache_bytes: int) -> set:
    """The entries a store with this budget keeps: least recently used ones are dropped first, as eviction would,
    and a block only once no kept block extends it (its checkpoint goes with it)."""
    keep = set(recency)
    children: dict[int, int] = {}
    for parent, _, _ in blocks:
        children[parent] = children.get(parent, 0) + 1
    size = {"kv": spec.kv_block_bytes, "checkpoint": spec.checkpoint_bytes}
    total = sum(size[kind] for kind, _ in keep)
    progress = True
    while total > max_cache_bytes and progress:
        progress = False
        for key in recency:
            if total <= max_cache_bytes:
                break
            kind, i = key
            if key not in keep or (kind == "kv" and children.get(i, 0)):
                continue
            for dropped in _drop(key, keep):
                total -= size[dropped[0]]
            if kind == "kv" and blocks[i][0] >= 0:
                children[blocks[i][0]] -= 1
            progress = True
    return keep


def _drop(key: tuple, keep: set) -> Iterable[tuple]:
    dropped = [key] + ([("checkpoint", key[1])] if key[0] == "kv" and ("checkpoint", key[1]) in keep else [])
    keep.difference_update(dropped)
    return dropped
