"""The tier's namespace: one hash seed shared by every cache of the same model, so their block hashes agree.

A cache draws a random hash seed (:func:`~hf_hybridcache.sharing.hash_seed`), so two processes would never compute
the same block hash. With a tier, the seed is instead read from the tier under a key derived from the model identity
(class, config, dtype; :func:`~hf_hybridcache.hashing.model_identity`) and the hf_hybridcache and transformers
versions (stored states are only reused under the versions that computed them). The first cache to ask stores 32
random bytes there with ``SET NX``; every later one, in any process, adopts them. The weights state (weights
fingerprint and adapters) and the cache salt are mixed into every root hash after the seed, so caches of other
weights or other tenants still never share an entry. A seed given with ``seed=`` is used as it is (every process that
should share must then pass the same bytes).
"""

from __future__ import annotations

import os

from .. import _compat
from .client import TierClient
from .codec import namespace_key

SEED_BYTES = 32


def namespace_identity(model_identity: str) -> str:
    """What the namespace key is derived from: the model identity and the versions that compute the states."""
    from .. import __version__

    return f"{model_identity}|hf_hybridcache {__version__}|transformers {_compat.TRANSFORMERS_VERSION}"


def shared_seed(client: TierClient, key_prefix: str, model_identity: str) -> bytes | None:
    """The namespace seed stored in the tier for this model (stored now if there is none); None when the tier did not
    answer or holds something that is not a seed."""
    key = namespace_key(key_prefix, namespace_identity(model_identity))
    value = client.get_or_set(key, os.urandom(SEED_BYTES))
    if not isinstance(value, bytes) or len(value) != SEED_BYTES:
        return None
    return value
