"""Where a request's outputs go: a handler registered for it (called on its asyncio event loop, as transformers'
``OutputRouter`` does for ``transformers serve``), or else a queue read by ``get_result`` / ``request_id_iter``.

Unlike transformers' router, outputs that arrived before a handler was registered are handed to the handler when it
is (a request refused at ``add_request`` delivers its error at once), and a reader waiting for one request's outputs
takes them without disturbing other readers (no re-queueing). A handler whose event loop was closed (its reader went
away: an ``asyncio.run`` that returned, a server shutting down) is dropped with its outputs and its request is named
to the caller, which cancels it: delivering runs in the engine's thread, and the closed loop's ``RuntimeError`` used
to end that thread, failing every request.

A loop is woken once for all the outputs that arrive before it runs them: an output for a loop that already has a
wake-up pending joins that batch instead of writing to the loop's self-pipe again (``call_soon_threadsafe``, where
the engine's thread waits for the GIL while the loop runs).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .._compat.continuous_batching import GenerationOutput

logger = logging.getLogger("hf_hybridcache")


@dataclass
class ThreadStatus:
    """What ``transformers serve`` reads of the manager's loop (``background_thread_status.fatal_error``)."""

    fatal_error: BaseException | None = None


class OutputRouter:
    """Routes :class:`~hf_hybridcache._compat.continuous_batching.EngineOutput` objects (thread-safe)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[GenerationOutput] = deque()
        self._handlers: dict[str, tuple[Callable, asyncio.AbstractEventLoop]] = {}
        self._pending: dict[asyncio.AbstractEventLoop, list] = {}  # (callback, output) a woken loop has not run yet

    def deliver(self, outputs: list[GenerationOutput]) -> list[str]:
        """Hand ``outputs`` to their handlers or the queue, in order; returns the ids of requests whose handler's event
        loop is closed (their handlers and these outputs are dropped: no one reads them)."""
        wake = []
        with self._cond:
            for output in outputs:
                entry = self._handlers.get(output.request_id)
                if entry is None:
                    self._queue.append(output)
                    continue
                callback, loop = entry
                if self._add_pending(loop, [(callback, output)]):
                    wake.append(loop)
                if output.is_finished():
                    del self._handlers[output.request_id]
            self._cond.notify_all()
        gone = []
        for loop in wake:
            gone += self._wake(loop)
        return gone

    def _add_pending(self, loop: asyncio.AbstractEventLoop, calls: list) -> bool:
        """Add ``calls`` to ``loop``'s pending batch (under the lock); True if the loop must be woken for it."""
        batch = self._pending.get(loop)
        if batch is not None:
            batch.extend(calls)
            return False
        self._pending[loop] = list(calls)
        return True

    def _wake(self, loop: asyncio.AbstractEventLoop) -> list[str]:
        """Have ``loop`` run its pending batch; the request ids dropped if it is closed."""
        try:
            loop.call_soon_threadsafe(self._run_pending, loop)
        except RuntimeError:  # the loop is closed
            with self._cond:
                batch = self._pending.pop(loop, [])
            return self._drop_loop(loop, batch)
        return []

    def _run_pending(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._cond:
            batch = self._pending.pop(loop, [])
        for callback, output in batch:
            callback(output)

    def _drop_loop(self, loop: asyncio.AbstractEventLoop, batch: list) -> list[str]:
        """Forget the handlers on the closed ``loop``; returns their request ids and those of ``batch``."""
        with self._cond:
            gone = [request_id for request_id, (_, on) in self._handlers.items() if on is loop]
            for request_id in gone:
                del self._handlers[request_id]
        gone = list(dict.fromkeys([*(output.request_id for _, output in batch), *gone]))
        logger.warning("the event loop of the result handlers of %s is closed: their outputs are dropped and the "
                       "requests cancelled", ", ".join(gone))
        return gone

    def register(self, request_id: str, callback: Callable[[GenerationOutput], None],
                 loop: asyncio.AbstractEventLoop) -> None:
        """Call ``callback(output)`` on ``loop`` for each output of ``request_id`` (queued ones first); forgotten
        after its final output."""
        with self._cond:
            queued = [o for o in self._queue if o.request_id == request_id]
            for output in queued:
                self._queue.remove(output)
            if not any(o.is_finished() for o in queued):
                self._handlers[request_id] = (callback, loop)
            # Through the pending batch, so a later output never runs before these.
            wake = bool(queued) and self._add_pending(loop, [(callback, o) for o in queued])
        if wake:
            loop.call_soon_threadsafe(self._run_pending, loop)

    def get(self, request_id: str | None, timeout: float | None, alive: Callable[[], bool]) -> GenerationOutput | None:
        """The next queued output (of ``request_id`` if given), waiting up to ``timeout`` seconds while ``alive()``;
        None if there is none."""

        def ready():
            return any(request_id is None or o.request_id == request_id for o in self._queue) or not alive()

        with self._cond:
            self._cond.wait_for(ready, timeout=timeout)
            for output in self._queue:
                if request_id is None or output.request_id == request_id:
                    self._queue.remove(output)
                    return output
        return None

    def wake(self) -> None:
        """Wake the readers (the loop stopped)."""
        with self._cond:
            self._cond.notify_all()
