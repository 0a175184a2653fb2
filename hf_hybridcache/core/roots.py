"""The roots of a request's block hash chains (the seed, the model identity, the weights state, the salt) and how a
change of the weights reaches them: read at every request (:mod:`~hf_hybridcache.core.weights`), or declared once
per step by a trainer (:meth:`WeightsRoots.weights_step`).

A trainer changes every weight at every optimizer step, and weights of a past step never come back. Reading the
weights at each request would cost a walk of every tensor per request (:func:`~hf_hybridcache.core.weights.weights_key`)
and a read of every element per step (:func:`~hf_hybridcache.core.weights.weights_identity`: 13 s for a 0.8B model on
a 2-core CPU); a declared step costs neither, and its ``retire`` drops the entries of the steps before it at once, so
the store holds one step's entries however long the training runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from ..hashing import BlockHash, root_hash
from .history import WeightsHistory
from .rows import Row
from .weights import WeightsTracker

logger = logging.getLogger("hf_hybridcache")


class WeightsRoots:
    """The roots and weights state of a :class:`~hf_hybridcache.core.sharing.CacheCore` (its base class): it sets
    ``seed``, ``identity``, ``weights``, ``weights_history``, ``store_lock`` and ``_warned_generation``, and has
    ``clear_store``."""

    seed: bytes
    identity: str
    weights: WeightsTracker
    weights_history: WeightsHistory
    store_lock: threading.RLock
    _warned_generation: int

    def root(self, salt: str | None) -> BlockHash:
        """The root of the block hash chains of requests under ``salt`` with the current weights state."""
        return root_hash(self.seed, f"{self.identity}|{self.weights.fingerprint}", salt)

    def request_root(self, salt: str | None) -> BlockHash:
        """The root of :meth:`request_start` alone (a lookup that stores nothing)."""
        return self.request_start(salt)[0]

    def request_start(self, salt: str | None) -> tuple[BlockHash, int]:
        """Re-read the model's weights state (:mod:`~hf_hybridcache.core.weights`; nothing is read between declared
        steps) and return the root a new request under ``salt`` chains its blocks from, with the weights generation
        it runs under (its rows' ``weights_generation``: :meth:`check_weights`)."""
        with self.store_lock:
            before = self.weights.fingerprint
            changed = self.weights.refresh()
            if changed:
                self.weights_history.weights_changed(before)
            root, generation = self.root(salt), self.weights.generation
        if changed:
            logger.warning(
                "The model's weights or adapters changed since the last request: prefixes stored under other weights "
                "are not served (they are again if those weights come back; cache.clear() drops them)."
            )
        self.weights_history.saw_root(root, salt)
        return root, generation

    def weights_step(self, retire: bool) -> int:
        """The weights changed and the caller (a trainer, after an optimizer step) says so: the weights state becomes
        the next declared step (:meth:`~hf_hybridcache.core.weights.WeightsTracker.declare_step`, O(1)), and requests
        read no weight until :meth:`~hf_hybridcache.core.weights.WeightsTracker.refresh` with ``full`` (``clear()``,
        ``save()``). ``retire``: every stored entry is dropped now (all were computed under earlier weights, which a
        training run never comes back to), as :meth:`clear_store` drops them. The caller holds ``idle()``. Returns
        the step's number."""
        with self.store_lock:
            before = self.weights.fingerprint
            step = self.weights.declare_step()
            self.weights_history.weights_changed(before)
            if retire:
                self.clear_store()
        return step

    def check_weights(self, rows: Iterable[Row]) -> None:
        """Before storing what a forward computed for ``rows``: a row whose request began under an earlier weights
        generation (the weights were edited while it ran) stores nothing more (``row.stale``), since its states mix
        two weights states and its root names the first. Costs one :func:`~hf_hybridcache.core.weights.weights_key`
        (nothing between declared steps)."""
        rows = [row for row in rows if not row.stale and row.storing]  # a row storing nothing cannot go stale
        if not rows:
            return
        with self.store_lock:
            generation = self.weights.observe()
        stale = [row for row in rows if row.weights_generation != generation]
        for row in stale:
            row.stale = True
        if stale and self._warned_generation != generation:
            self._warned_generation = generation
            logger.warning("The model's weights changed while requests ran: they go on under the new weights, and "
                           "nothing more of them is stored (docs/concurrency.md: weights updated while serving).")

    def previous_roots(self, root: BlockHash) -> list[BlockHash]:
        """The roots a request given ``root`` by :meth:`request_root` would have had under each remembered earlier
        weights state, the most recent first (none when its salt is no longer remembered)."""
        known, salt = self.weights_history.salt_of(root)
        if not known:
            return []
        current = self.weights.fingerprint
        return [root_hash(self.seed, f"{self.identity}|{fingerprint}", salt)
                for fingerprint in self.weights_history.previous if fingerprint != current]
