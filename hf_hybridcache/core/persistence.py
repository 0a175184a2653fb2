"""Saving a cache to one file and loading it back: safetensors for the tensors, JSON for the rest, never pickle.

A file holds every stored KV block and checkpoint as the named tensors of their layout
(:mod:`~hf_hybridcache.store.layout`, shared with the remote tier), the entries of each name stacked along a new first
dim: ``keys.{layer} [num_blocks, Hkv, block_size, Dk]``, ``values.{layer} [num_blocks, Hkv, block_size, Dv]``,
``conv.{state} [num_checkpoints, C, W]`` and ``ssm.{state} [num_checkpoints, ...]``, in the stored dtypes. The
safetensors header's metadata carries a JSON document — versions, the model identity and the identity of its
weights (every element; :mod:`~hf_hybridcache.core.weights`), the options, the hash seed, the block tree (parent, token
ids and hash per block), which blocks have a checkpoint and the recency order — plus SHA-256 checksums of that JSON
and of every tensor. Loading checks everything before it fills the new cache, so a file that is truncated, corrupted
or made for another model or other weights is refused with a ``ValueError`` and nothing in memory changes.

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

from .. import _compat, _version
from ..config import ModelStateSpec
from ..hashing import BlockHash, block_hash, identity_config, model_identity
from ..models import support_for
from ..models.deterministic import serves_deterministic
from ..store import EntryLayout, StoredBlock, entry_layout
from .atomic_file import write_atomically

#: Version 2: the weights state (weights fingerprint and adapters) is part of every hash root. Version 3: keys and
#: values of a layer are two tensors (``keys.{layer}``, ``values.{layer}``) instead of one ``kv.{layer}
#: [num_blocks, 2, Hkv, block_size, D]``. Version 4: the weights identity reads every element (``weights_identity``)
#: where older versions sampled 64 per parameter, in the file and in every hash root.
FORMAT = "hf_hybridcache/4"
#: Formats whose weights check and hash roots came from the sampled fingerprint: refused with their own reason.
SAMPLED_FINGERPRINT_FORMATS = ("hf_hybridcache/2", "hf_hybridcache/3")


def save_cache(cache, path: str | os.PathLike) -> None:
    """Write ``cache``'s stored entries to ``path`` (see the module docstring). The caller holds the cache's lock.

    Raises:
        ValueError: ``path`` is a directory, or its directory does not exist.
        OSError: the file cannot be written (no permission, a full disk, a filesystem that holds no files); the
            message names ``path`` and the cause, and nothing is left behind.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        example = os.path.join(path, "cache.safetensors")
        raise ValueError(f"{path!r} is a directory; pass a file path such as {example!r}.")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"The folder {folder!r} does not exist; create it first (os.makedirs) or save elsewhere.")
    cache.core.weights.refresh(full=True)  # the weights now, with a write through param.data since the last request
    stored, recency = cache.store.export_entries()  # parents before children
    index = {block.block_id: i for i, block in enumerate(stored)}
    with_checkpoint = [block for block in stored if block.checkpoint is not None]
    tensors = _stack_entries(cache.spec, stored, with_checkpoint)
    blocks = [
        [-1 if block.parent_id is None else index[block.parent_id], list(block.token_ids), block.block_hash.hex()]
        for block in stored
    ]
    meta = {
        "versions": _versions(),
        "model": {**_model_facts(cache.model, serves_deterministic(cache.model)),
                  "weights_identity": cache.core.weights.identity},
        "options": {
            "block_size": cache.block_size,
            "retention_interval": cache.options.retention_interval,
            "max_cache_bytes": cache.max_cache_bytes,
            "admit_divergence": cache.options.admit_divergence,
            "eviction": cache.options.eviction,
            "replay_replies": cache.options.replay_replies,
            "deterministic": serves_deterministic(cache.model),
        },
        "seed": cache.seed.hex(),
        "blocks": blocks,
        "checkpoints": [index[block.block_id] for block in with_checkpoint],
        "recency": [[kind, index[block_id]] for kind, block_id in recency],
        "tensor_sha256": {name: _tensor_digest(t) for name, t in tensors.items()},
    }
    text = json.dumps(meta, sort_keys=True, default=str)
    metadata = {"format": FORMAT, "meta": text, "meta_sha256": hashlib.sha256(text.encode()).hexdigest()}
    write_atomically(tensors, metadata, path)


def load_cache(cls, path, model, max_cache_bytes, retention_interval, offload, remote=None, deterministic=None):
    """A new ``cls`` (HybridPrefixCache) for ``model`` holding the entries saved at ``path``; see
    :meth:`HybridPrefixCache.load`."""
    path = os.fspath(path)
    meta, tensors = _read(path)
    try:
        saved_mode = meta["options"].get("deterministic", False)
        if deterministic is None:
            deterministic = saved_mode
        elif deterministic is not saved_mode:
            raise ValueError(
                f"{path!r} was saved by a cache with deterministic={saved_mode}: its states come from that mode's "
                f"arithmetic, and deterministic mode restores only states its own arithmetic computed (docs/"
                f"deterministic.md). Load it with deterministic={saved_mode} (or leave the argument out), or warm a "
                f"cache with deterministic={deterministic}. Nothing was loaded.")
        _check_model(meta, model, path, deterministic)
        saved_weights = meta["model"]["weights_identity"]
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
        deterministic=deterministic,
        **{name: options[name] for name in ("admit_divergence", "eviction", "replay_replies") if name in options},
    )
    # Checked on the new cache, which computed the identity of every weight once; dropping it leaves the store of any
    # other cache and the model's weights as they were.
    if saved_weights != cache.core.weights.identity:
        raise ValueError(
            f"{path!r} was saved for a model with the same config but other weights (another checkpoint, a fine-tune "
            "or an edit of some weights): the identity of its weights, read over every element, differs, so its "
            "stored states would be wrong for this one. Load it with the model it was saved for."
        )
    _fill(cache, meta, tensors, plan)
    if cache.remote is not None:
        cache.remote.publish_all()
    return cache


# ---------------------------------------------------------------------- writing


def _stack_entries(spec: ModelStateSpec, blocks: list[StoredBlock], with_checkpoint: list[StoredBlock]) -> dict:
    """Entries stacked per name of their layout (:mod:`~hf_hybridcache.store.layout`), in host memory (one block at a
    time leaves its device, so saving never needs twice the cache's size on a device)."""
    tensors = {}
    for kind, entries in (("kv", [b.kv for b in blocks]), ("checkpoint", [b.checkpoint for b in with_checkpoint])):
        layout = entry_layout(spec, kind)
        rows = [layout.tensors(entry) for entry in entries]
        for name in layout.names if rows else ():
            tensors[name] = torch.stack([row[name].cpu() for row in rows])
    return {name: t.contiguous() for name, t in tensors.items()}


def _tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy()).hexdigest()


def _versions() -> dict:
    return {"hf_hybridcache": _version.__version__, "transformers": _compat.TRANSFORMERS_VERSION}


def _model_facts(model, deterministic: bool) -> dict:
    return {
        "class": type(model).__name__,
        "dtype": str(model.dtype),
        "identity": model_identity(model, deterministic),
        "config": identity_config(model),
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
    if metadata.get("format") in SAMPLED_FINGERPRINT_FORMATS:
        raise _invalid(
            path,
            f"its format {metadata['format']!r} (an older hf_hybridcache) named the weights by 64 sampled values per "
            "parameter, which misses sparse edits, so its entries cannot be shown to belong to these weights; warm a "
            "new cache and save it with this version",
        )
    if metadata.get("format") != FORMAT:
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
    return meta, tensors


def _check_model(meta: dict, model, path: str, deterministic: bool) -> None:
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
    facts, current = meta["model"], _model_facts(model, deterministic)
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
    if facts["identity"] != current["identity"]:
        raise ValueError(f"{path!r} was saved for another model (its identity differs); load it with that model.")


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
        if len(token_ids) != bs or not all(isinstance(t, int) and t < vocab_size for t in token_ids):
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
    for kind, num_entries in (("kv", len(blocks)), ("checkpoint", len(checkpoints))):
        if num_entries:
            expected.update(entry_layout(spec, kind).shapes(num_entries))
    got = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    if got != expected:
        raise ValueError(f"tensors {got} do not match the model's layers {expected}")
    return {"checkpoints": list(checkpoints), "recency": recency}


# ---------------------------------------------------------------------- filling the new cache


def _fill(cache, meta: dict, tensors: dict, plan: dict) -> None:
    """Insert the entries that fit the budget (the most recently used), in their recency order."""
    spec = cache.spec
    keep = _entries_within_budget(plan["recency"], meta["blocks"], spec, cache.store.max_cache_bytes)
    rows = {i: row for row, i in enumerate(plan["checkpoints"]) if ("checkpoint", i) in keep}
    blocks = []
    for i, (parent, token_ids, hash_hex) in enumerate(meta["blocks"]):
        if ("kv", i) not in keep:
            continue
        kv = _row(entry_layout(spec, "kv"), tensors, i)
        checkpoint = _row(entry_layout(spec, "checkpoint"), tensors, rows[i]) if i in rows else None
        blocks.append(StoredBlock(i, None if parent < 0 else parent, tuple(token_ids),
                                  BlockHash(bytes.fromhex(hash_hex)), kv, checkpoint))
    cache.store.import_entries(blocks, [key for key in plan["recency"] if key in keep])


def _row(layout: EntryLayout, tensors: dict, row: int) -> dict:
    """Entry ``row`` of the stacked ``tensors``, as the store keeps it (copies: the file's tensors are not kept)."""
    return layout.entry({name: tensors[name][row].clone() for name in layout.names})


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
