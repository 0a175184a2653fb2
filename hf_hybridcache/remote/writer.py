"""The write path: every KV block and checkpoint the local store keeps is published to the tier by a background
thread, off the request's critical path, and values that failed verification are removed from it.

The request thread only queues ``(key, encode)`` with references to the stored tensors (which are never written
after they are stored, so reading them later is safe; an evicted entry's tensors stay alive until written). The
writer thread encodes them (:mod:`~hf_hybridcache.remote.codec`) and stores them with ``SET NX`` in pipelined batches.
The queue is bounded: when it is full the entry is dropped and counted (``remote_dropped_writes``) rather than making
the request wait; an entry the tier refused or could not take (breaker open, timeout) is counted the same way.

Healing: a key whose value failed verification (damaged, tampered, unsigned under a secret) is queued as ``(key,
None)`` and deleted (``DEL``) in queue order, so the same process's own recomputed entry, queued after it, is
written by ``SET NX``; until a key is removed, every process that reads it misses. Two readers of one damaged value
may race: a late ``DEL`` can remove the replacement another process wrote meanwhile, which costs a recomputation,
never a wrong state (the late reader recomputes and writes that entry again). A removal that finds the queue full is
skipped; the next reader of that value queues it again.
"""

from __future__ import annotations

import atexit
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable

from ..hashing import BlockHash
from .client import TierClient
from .codec import Codec, Entry

logger = logging.getLogger("hf_hybridcache")

#: Entries written per round trip.
WRITE_BATCH = 16
#: How long the interpreter's exit waits for queued writes.
EXIT_FLUSH_S = 2.0


class Publisher:
    """A bounded queue of entries to publish and the daemon thread that writes them.

    Args:
        client: the tier's connection.
        codec: the keys and values of the tier's entries.
        max_pending: entries the queue holds before new ones are dropped.

    Attributes:
        muted: while True nothing is queued (set while entries fetched from the tier are inserted locally).
    """

    def __init__(self, client: TierClient, codec: Codec, max_pending: int) -> None:
        self.client = client
        self.codec = codec
        self.muted = False
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def publish(self, kind: str, block_hash: BlockHash, token_ids, entry: Entry, wait: bool = False) -> None:
        """Queue a stored entry of ``kind`` (``"kv"`` or ``"checkpoint"``, as :meth:`Codec.encode` takes it) of the
        block ``block_hash``; ``wait``: for room in a full queue instead of dropping it (never on a request's
        path)."""
        if self.muted:
            return
        encode = functools.partial(self.codec.encode, kind, block_hash, token_ids, entry)
        if not self._offer((self.codec.key(kind, block_hash), encode), wait):
            self.client.count("remote_dropped_writes")

    def remove(self, keys: list[str]) -> None:
        """Queue the deletion of ``keys``, whose values failed verification (see the module docstring)."""
        for key in keys:
            self._offer((key, None), False)

    def _offer(self, item: tuple[str, Callable[[], bytes] | None], wait: bool) -> bool:
        self._ensure_thread()
        try:
            self._queue.put(item, block=wait)
        except queue.Full:
            return False
        return True

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hf_hybridcache-remote-writer", daemon=True)
                self._thread.start()
                atexit.register(self.flush, EXIT_FLUSH_S)

    def _run(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while len(batch) < WRITE_BATCH and batch[-1] is not None:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = batch[-1] is None
            try:
                self._write([item for item in batch if item is not None])
            finally:
                for _ in batch:
                    self._queue.task_done()

    def close(self, timeout_s: float = 10.0) -> bool:
        """Write what is queued (waiting up to ``timeout_s``), then stop the writer thread; the next entry to publish
        starts a new one. False if the queue was not written in time (the thread then stops after it)."""
        with self._start_lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return True
            atexit.unregister(self.flush)
        flushed = self.flush(timeout_s)
        try:
            self._queue.put(None, timeout=max(timeout_s, 0.1))
        except queue.Full:
            return False
        thread.join(timeout_s)
        return flushed and not thread.is_alive()

    def _write(self, batch: list[tuple[str, Callable[[], bytes] | None]]) -> None:
        items = []
        for key, encode in batch:
            try:
                items.append((key, None if encode is None else encode()))
            except Exception as error:  # a device error while copying to the host must not kill the writer
                logger.debug("could not encode %s for the remote tier: %s", key, error)
                self.client.count("remote_dropped_writes")
        if items and not self.client.write(items):
            self.client.count("remote_dropped_writes", sum(1 for _, value in items if value is not None))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued entry is written (or dropped); False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True
