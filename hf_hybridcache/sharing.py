"""What a :class:`~hf_hybridcache.HybridPrefixCache` and its salted views share, and the lock that serializes them.

Threading model: a cache and every view made by ``with_salt`` share one store and one re-entrant lock.

- A ``generate()`` call holds the lock from start to end, so calls from several threads (a Gradio or FastAPI app)
  run one at a time and each sees a consistent store; the live state of a call is its view's live layers.
- Every forward with the cache holds the lock for that forward (re-entrant inside the thread's own ``generate()``);
  both are released in ``finally`` blocks, so a ``KeyboardInterrupt`` or ``SystemExit`` inside a call leaves no lock
  held.
- ``save()``, ``clear()``, ``reset()``, ``stats`` and budget changes take the lock too, so they wait for a running
  call. From inside a running ``generate()`` (a streamer or stopping criterion, same thread) the operations that would
  change the store under it, and a second ``generate()`` with the same cache, raise ``RuntimeError`` at once instead
  of deadlocking or corrupting the call.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from .hashing import BlockHash, root_hash
from .weights import WeightsTracker


def hash_seed(seed: bytes | None) -> bytes:
    """``seed``, or 32 random bytes when it is None.

    Raises:
        ValueError: ``seed`` is neither bytes nor None.
    """
    if seed is not None and not isinstance(seed, bytes):
        raise ValueError(f"`seed` must be bytes (e.g. b'my-app') or None for a random one, got {type(seed).__name__}.")
    return os.urandom(32) if seed is None else seed


@dataclass(eq=False)
class SharedState:
    """State shared by a cache and its views.

    Attributes:
        seed: bytes mixed into every root hash (saved with the cache so stored hashes stay valid).
        identity: the model identity mixed into every root hash.
        weights: the model's weights state, re-read at every request; its fingerprint is mixed into every root hash.
        dtype, devices: the model's dtype and each cache layer's device when the cache was built; stored entries
            are only valid while the model keeps them.
        options: the validated :class:`~hf_hybridcache.config.CacheOptions`.
        active: the view whose request is live (its chain is pinned); a new request on any view ends it first.
        warned_masked_prompt: the warning that a prompt's mask ruled out reuse was given (it is given once).
    """

    seed: bytes
    identity: str
    weights: WeightsTracker
    dtype: torch.dtype
    devices: dict[int, torch.device]
    options: Any
    active: Any = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    generating_thread: int | None = None
    warned_masked_prompt: bool = False

    def root(self, salt: str | None) -> BlockHash:
        """The root of the block hash chains of requests under ``salt`` with the current weights state."""
        return root_hash(self.seed, f"{self.identity}|{self.weights.fingerprint}", salt)

    @contextlib.contextmanager
    def generate_scope(self):
        """Hold the lock for one ``generate()`` call.

        Raises:
            RuntimeError: this thread is already inside a ``generate()`` call with this cache or one of its views.
        """
        me = threading.get_ident()
        if self.generating_thread == me:
            raise RuntimeError(
                "This HybridPrefixCache is already running a generate() call in this thread (a streamer, logits "
                "processor or stopping criterion calling generate() again?); one cache serves one call at a time, "
                "so call generate() again after the running call returns, or use another HybridPrefixCache."
            )
        with self.lock:
            self.generating_thread = me
            try:
                yield
            finally:
                self.generating_thread = None

    @contextlib.contextmanager
    def idle(self, operation: str):
        """Hold the lock for an operation that changes the store (waits for a call running in another thread).

        Raises:
            RuntimeError: called from inside a running ``generate()`` call in this thread.
        """
        if self.generating_thread == threading.get_ident():
            raise RuntimeError(
                f"{operation} cannot run while generate() is running with this HybridPrefixCache in the same thread "
                "(from a streamer or a stopping criterion?); call it after generate() returns."
            )
        with self.lock:
            yield
