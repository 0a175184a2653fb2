"""The prefix store: what is stored (KV blocks and checkpoints under one byte budget) and what policy keeps it.

Modules, one job each: ``block_pool`` (block tree, ref counts, evictable leaves; no tensors), ``pages`` (the page
pool: ref-counted KV pages of one growable tensor per attention layer, shared with a serving engine), ``kv_store``
(stored KV blocks as pages), ``checkpoints`` (checkpoint tensors), ``checkpoint_links`` (which checkpoint a hit backs
off to), ``placement`` (the device or host memory stored tensors live in), ``lookup`` (hit search and divergence
point), ``retention`` (which boundaries keep their checkpoints), ``flops`` (the prefill FLOPs a hit saves),
``eviction`` (the policies), ``entries`` (records for persistence and checks), ``layout`` (an entry as named tensors,
for the cache file and the remote tier) and ``prefix_store`` (:class:`PrefixStore`, which composes them).
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
from .flops import FlopModel
from .layout import KINDS, EntryLayout, entry_layout
from .placement import Placement, layer_devices, synchronize
from .prefix_store import Hit, PrefixStore
from .retention import last_boundary, retained_boundaries

__all__ = [
    "DEFAULT_FLOP_ALPHA",
    "EVICTION_POLICIES",
    "EntryKey",
    "EntryKind",
    "EntryLayout",
    "EntryValue",
    "EvictionPolicy",
    "FlopAwareEviction",
    "FlopModel",
    "Hit",
    "KINDS",
    "LRUEviction",
    "LayerState",
    "Placement",
    "PrefixStore",
    "StoredBlock",
    "entry_layout",
    "last_boundary",
    "layer_devices",
    "make_eviction",
    "retained_boundaries",
    "synchronize",
]
