"""What every caller of the store shares: one :class:`CacheCore` per cache, used by the cache, its salted views and
a serving engine alike (the store under one budget, the hash roots, the weights state, the remote tier, the counters
and the locks), the rows a request stores through it and the reports of why it hit.

Modules, one job each: ``sharing`` (:class:`CacheCore`), ``calls`` (how calls from several threads share it),
``weights`` (the identity of the weights entries were computed under), ``rows`` (a request's rows and storing their
blocks and checkpoints), ``explain`` (:class:`HitReport`: why a row hit what it hit), ``history`` (the evictions and
earlier weights states a miss is explained from), ``persistence`` (a cache saved to a file and loaded back) and
``checks`` (the store's invariants, checked from outside).
"""

from .calls import CallGate, CallScopes
from .checks import check_store, entry_digests
from .explain import HITS_LOGGER, NOT_CACHEABLE, REASONS, HitReport, log_request, not_cacheable
from .persistence import load_cache, save_cache
from .rows import Row, replay_start
from .sharing import CacheCore
from .weights import WeightsTracker, weights_identity

__all__ = [
    "HITS_LOGGER",
    "NOT_CACHEABLE",
    "REASONS",
    "CacheCore",
    "CallGate",
    "CallScopes",
    "HitReport",
    "Row",
    "WeightsTracker",
    "check_store",
    "entry_digests",
    "load_cache",
    "log_request",
    "not_cacheable",
    "replay_start",
    "save_cache",
    "weights_identity",
]
