"""The tier's namespace: one hash seed shared by every cache of the same model, so their block hashes agree.

A cache draws a random hash seed (:func:`~hf_hybridcache.hashing.hash_seed`), so two processes would never compute
the same block hash. With a tier and no ``seed=``, the seed is instead derived from the key prefix, the model identity
(class, config, dtype; :func:`~hf_hybridcache.hashing.model_identity`) and the hf_hybridcache and transformers
versions (stored states are only reused under the versions that computed them). The weights state (the weights
identity over every element, computed when the cache is built, and the adapters) and the cache salt are mixed into
every root hash after the seed, so caches of other weights or other tenants never share an entry.

Derived rather than drawn once and kept in the tier (``SET NX``): a seed kept there would be lost when the server
restarts or its ``allkeys-lru`` policy evicts that key, and processes started afterwards would draw a new one and stop
sharing with those started before; a derived one needs no round trip and no server at construction. It hides nothing
from whoever can read the tier (a stored seed would not either). To keep a deployment's hashes unguessable, pass the
same secret ``seed=`` bytes to every cache that should share; it is then used as it is. (``RemoteConfig(secret=...)``
is another matter: it signs values and names the keys' namespace, :mod:`~hf_hybridcache.remote.codec`, and leaves
the seed alone.)
"""

from __future__ import annotations

import hashlib

from .. import _compat, _version


def computing_versions() -> tuple[str, str]:
    """The versions that compute the states, hf_hybridcache's and transformers': states are only reused under
    them, so they are in every key (:func:`~hf_hybridcache.remote.codec.key_namespace`) as well as in the derived
    seed (a given ``seed=`` names no version)."""
    return _version.__version__, _compat.TRANSFORMERS_VERSION


def namespace_identity(model_identity: str) -> str:
    """What the namespace seed is derived from besides the key prefix: the model identity and the versions that
    compute the states."""
    ours, transformers = computing_versions()
    return f"{model_identity}|hf_hybridcache {ours}|transformers {transformers}"


def namespace_seed(key_prefix: str, model_identity: str) -> bytes:
    """The hash seed of every cache of this model using the tier under ``key_prefix`` without a ``seed=``."""
    h = hashlib.sha256(b"hf_hybridcache-remote-namespace\0")
    for part in (key_prefix, namespace_identity(model_identity)):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part.encode())
    return h.digest()
