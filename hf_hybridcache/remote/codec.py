"""The tier's wire format: where an entry lives (its key) and its value, safetensors bytes that verify themselves.

Keys: ``{namespace}:kv:{block hash hex}`` for a KV block and ``{namespace}:ck:{block hash hex}`` for the checkpoint
at the end of that block, where the namespace is ``{key prefix}:{FORMAT}:hfhc-{version}:tf-{version}`` (the
hf_hybridcache and transformers versions that compute the states: a cache given ``seed=`` derives no seed from them),
followed by ``:signed-{tag}`` under a secret (``tag``: 16 hex digits of an HMAC of a fixed label under the secret,
which names the secret without revealing it). So processes under other versions, other secrets, or with and without
a secret never write or read each other's keys: they cannot serve each other's entries, nor fight over a key (each
one finding the other's value unverifiable and removing it). The versions in the key also let an operator delete an
old version's entries by pattern.

Values: the entry's named tensors in the layout shared with cache files (:mod:`~hf_hybridcache.store.layout`), in the
stored dtypes; the safetensors metadata names the format, the kind, the block hash, the block's token ids and a
SHA-256 over every tensor's name, shape, dtype and bytes, and, under a secret, an HMAC-SHA256 (RFC 2104, Python's
``hmac``) of all of that. Decoding checks everything against what the reader expects (the hash it computed from its
own prompt, the prompt's tokens, its model's layout, its secret) and returns None for anything that does not fit, so
a corrupt, truncated, tampered, unsigned or foreign entry is a miss. Without a secret the checksum only catches
damage: anyone who can write to the server can store a well-formed entry with a matching checksum. Never pickle:
safetensors and JSON cannot run code.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging

import torch
from safetensors.torch import load, save

from ..config import ModelStateSpec, StateKey
from ..hashing import BlockHash
from ..store import KINDS, entry_layout
from .namespace import computing_versions

logger = logging.getLogger("hf_hybridcache")

#: Bump when the value layout changes: keys of other formats are never read. Version 3: tensors named and shaped by
#: :mod:`~hf_hybridcache.store.layout` (a checkpoint's states without their batch dim; a layer's later states as
#: ``conv.{layer}.{state idx}``), and an HMAC under a secret.
FORMAT = "hfhc-remote/3"
_KEY_KINDS = {"kv": "kv", "checkpoint": "ck"}
_NAMESPACE_LABEL = b"hf_hybridcache remote key namespace"

Entry = dict[StateKey, tuple[torch.Tensor, torch.Tensor]]


def key_namespace(key_prefix: str, secret: bytes | None) -> str:
    """The part of every key before the kind and the block hash, under the running versions."""
    ours, transformers = computing_versions()
    namespace = f"{key_prefix}:{FORMAT}:hfhc-{ours}:tf-{transformers}"
    if secret is None:
        return namespace
    return f"{namespace}:signed-{hmac.new(secret, _NAMESPACE_LABEL, hashlib.sha256).hexdigest()[:16]}"


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Codec:
    """Keys and values of one model's entries under one key prefix and secret.

    Args:
        spec: the model's state spec (the layouts of its entries).
        key_prefix: first part of every key.
        secret: the HMAC key (None: values are not signed, and unsigned values are accepted).
    """

    def __init__(self, spec: ModelStateSpec, key_prefix: str, secret: bytes | None = None) -> None:
        self.layouts = {kind: entry_layout(spec, kind) for kind in KINDS}
        self.namespace = key_namespace(key_prefix, secret)
        self._secret = secret
        self._warned = False

    def key(self, kind: str, block_hash: BlockHash) -> str:
        """The key of the ``kind`` (``"kv"`` or ``"checkpoint"``) entry of the block ``block_hash``."""
        return f"{self.namespace}:{_KEY_KINDS[kind]}:{block_hash.hex()}"

    def encode(self, kind: str, block_hash: BlockHash, token_ids, entry: Entry) -> bytes:
        """A stored entry (KV ``{attention layer idx: (keys [Hkv, block_size, Dk], values [Hkv, block_size, Dv])}``
        or checkpoint ``{state key: (conv [1, C, W], ssm [1, ...])}``, on any device) as safetensors bytes."""
        named = self.layouts[kind].tensors(entry)
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in named.items()}
        metadata = {
            "format": FORMAT,
            "kind": kind,
            "block_hash": block_hash.hex(),
            "token_ids": json.dumps(list(token_ids)),
            "sha256": _digest(tensors),
        }
        if self._secret is not None:
            metadata["hmac"] = self._mac(metadata)
        return save(tensors, metadata=metadata)

    def decode(self, value: bytes | None, kind: str, block_hash: BlockHash, token_ids) -> Entry | None:
        """The entry of ``kind`` for the block ``block_hash`` holding ``token_ids``, as the store keeps it (CPU
        tensors); None unless ``value`` is an intact entry of exactly that block, kind and layout, signed under this
        codec's secret when it has one."""
        if value is None:
            return None
        try:
            tensors = load(value)
            metadata = _metadata(value)
        except Exception as error:  # safetensors raises several types for truncated or garbled bytes
            logger.debug("a remote %s entry cannot be read as safetensors: %s", kind, error)
            return None
        fits = (
            metadata.get("format") == FORMAT
            and metadata.get("kind") == kind
            and metadata.get("block_hash") == block_hash.hex()
            and metadata.get("token_ids") == json.dumps(list(token_ids))
            and {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()} == self.layouts[kind].shapes()
            and metadata.get("sha256") == _digest(tensors)
        )
        if not fits:
            logger.debug("a remote %s entry does not verify (corrupt, tampered or foreign); treated as a miss", kind)
            return None
        if self._secret is not None and not self._signed(metadata):
            self._warn_unsigned(kind)
            return None
        return self.layouts[kind].entry(tensors)

    def _mac(self, metadata: dict[str, str]) -> str:
        message = json.dumps({k: v for k, v in metadata.items() if k != "hmac"}, sort_keys=True).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def _signed(self, metadata: dict[str, str]) -> bool:
        mac = metadata.get("hmac")
        return isinstance(mac, str) and hmac.compare_digest(mac, self._mac(metadata))

    def _warn_unsigned(self, kind: str) -> None:
        # An intact entry without a valid signature under this deployment's namespace was written by someone without
        # the secret: worth one warning per process, not one per request.
        if not self._warned:
            self._warned = True
            logger.warning(
                "the remote tier holds a well-formed %s entry that is not signed under this cache's secret (someone "
                "without the secret writes to the server); it and any others are treated as misses and removed", kind,
            )
        logger.debug("a remote %s entry is unsigned or signed under another secret; treated as a miss", kind)


def _metadata(value: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (``load`` returns tensors only)."""
    header_bytes = int.from_bytes(value[:8], "little")
    header = json.loads(value[8 : 8 + header_bytes])
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise ValueError("metadata is not a mapping")
    return metadata
