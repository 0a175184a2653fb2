"""The life of one ``generate()`` call, in the order it happens: the model's wrapped ``generate()`` and forwards call
the lifecycle (``lifecycle``), which restores each row's longest stored prefix into fresh live layers (``live``;
batches: ``batch``), brackets every forward of the live request, which stores its new blocks and checkpoints through
the :class:`~hf_hybridcache.core.CacheCore`, and at the end stores a reply as a prefill computes it (``reply_replay``).
``live_cache`` is the face the cache shows transformers and the patched mixers during the call; ``dry_run`` is
``cache.explain``, the same lookup changing nothing.
"""

from .dry_run import explain_call
from .lifecycle import HOOKS, check_request, end_live_requests, end_request, start_request
from .live import LiveRequest, restore_row
from .live_cache import LiveCache, LiveState
from .reply_replay import replay_replies, replays_by_default

__all__ = [
    "HOOKS",
    "LiveCache",
    "LiveRequest",
    "LiveState",
    "check_request",
    "end_live_requests",
    "end_request",
    "explain_call",
    "replay_replies",
    "replays_by_default",
    "restore_row",
    "start_request",
]
