"""The prefix store: stored KV blocks and checkpoints under one byte budget, the hit search and eviction.

Modules, one job each: ``block_pool`` (block tree, ref counts, evictable leaves; no tensors), ``pages`` (the page
pool: ref-counted KV pages of one growable tensor per attention layer, shared with a serving engine), ``kv_store``
(stored KV blocks as pages), ``checkpoints`` (checkpoint tensors), ``checkpoint_links`` (which checkpoint a hit backs off to),
``lookup`` (hit search and divergence point), ``retention`` (which boundaries keep their checkpoints), ``eviction``
(the policies), ``entries`` (records for persistence and checks) and ``prefix_store`` (:class:`PrefixStore`, which
composes them).
"""

from .checkpoints import LayerState
from .entries import StoredBlock
from .eviction import (
    DEFAULT_FLOP_ALPHA,
    EVICTION_POLICIES,
    EntryKey,
    EntryKind,
    EntryValue,
    EvictionPolicy,
    FlopAwareEviction,
    LRUEviction,
    make_eviction,
)
from .prefix_store import Hit, PrefixStore
from .retention import last_boundary, retained_boundaries

__all__ = [
    "DEFAULT_FLOP_ALPHA",
    "EVICTION_POLICIES",
    "EntryKey",
    "EntryKind",
    "EntryValue",
    "EvictionPolicy",
    "FlopAwareEviction",
    "Hit",
    "LRUEviction",
    "LayerState",
    "PrefixStore",
    "StoredBlock",
    "last_boundary",
    "make_eviction",
    "retained_boundaries",
]
