"""The engine: admits requests through the cache's store, runs steps, and settles each step's results. It runs in
one thread (the manager's loop, :mod:`~hf_hybridcache.engine.manager`); the store it shares with ``generate()``
calls in other threads is reached only through :class:`~hf_hybridcache.core.sharing.CacheCore`, whose short store lock
it takes around each store operation, never around a forward.

Admission (:meth:`Engine.admit`) looks the request's tokens up in the store (the remote tier, salts and the weights
identity included): on a hit the stored blocks' pages join the request's page table by reference (no KV copy), the
checkpoint at the hit is copied into its state slot, and its chain is pinned. A request whose next uncached blocks
another running request is computing right now waits for them instead of computing them too (bounded: only while
that request's prefill moves toward them), and that request keeps a checkpoint where their prompts part, so the
shared prefix is computed once.
"""

from __future__ import annotations

import logging
import time

import torch

from .._compat.continuous_batching import RequestStatus
from ..core import Row
from ..multimodal import placeholder_ids
from . import images
from .inflight import InflightPrefixes
from .isolation import Isolation, forwards, probe_after
from .limits import EngineLimits
from .plan import Segment, StepPlan
from .requests import EngineRequest
from .runner import StepRunner
from .score_store import ScoreStore, scored_report
from .scheduler import Chunk, Scheduler
from .slots import StateSlots
from .speculative import Speculation, Speculator
from .storing import emit_positions, replay_request, store_segment
from .views import StepCache

logger = logging.getLogger("hf_hybridcache")

#: Seconds a reply replay (bf16/fp16) waits before it may run: a chat's next turn sent within them starts with the
#: reply, and its own prefill stores the reply as a prefill computes it, so the replay is dropped instead of making
#: that turn wait for one more forward (measured back to back: TTFT p50 of turns 2-6 0.45 s without replays, 0.76 s
#: with replays that ran at once). A later turn hits inside the stored reply.
REPLAY_GRACE_S = 1.0


class Engine:
    """Requests of one cache (and so one model) served in packed steps.

    Args:
        cache: the :class:`~hf_hybridcache.HybridPrefixCache` whose store (and budget, retention, salts, tier) the
            engine shares.
        limits: the engine's bounds.
        runner: runs a step's forward and samples.
        speculation: the drafter and draft length of speculative steps (None: none).

    Attributes:
        scheduler: the running and waiting requests.
        slots: the running requests' state slots.
        tables: page tables ``[max_running_requests, max pages per request]`` int64, one row per slot.
        preempted: requests preempted so far (each resumed later from the store).
        steps, forwards: steps that ran a forward so far, and forwards (one per step plus one per probe group).
        isolation: judges the forwards that raise (:class:`~hf_hybridcache.engine.isolation.Isolation`).
        peak_running_pages, peak_batch_tokens: the most private pages running requests held at once and the most
            tokens one step fed (each stays within its bound in ``limits``).
        speculator: its speculative steps (:class:`~hf_hybridcache.engine.speculative.Speculator`, with ``stats``).
    """

    def __init__(self, cache, limits: EngineLimits, runner: StepRunner, speculation: Speculation | None = None) -> None:
        self.cache, self.core, self.spec = cache, cache.core, cache.spec
        self.limits, self.runner = limits, runner
        self.block_size = self.spec.block_size
        self.pages = self.core.store.pages
        self.pages.ensure_devices()
        self.slots = StateSlots(self.spec, limits.max_running_requests, self.core.devices)
        max_pages = -(-limits.max_request_tokens // self.block_size) + 1
        self.tables = torch.zeros(limits.max_running_requests, max_pages, dtype=torch.int64)
        self.scheduler = Scheduler(limits.max_batch_tokens, self.block_size)
        self.inflight = InflightPrefixes(self.core, self.block_size)
        self.scores = ScoreStore(self.block_size, limits.max_score_bytes)  # prompt logprobs of stored prefixes
        self.epoch = self.core.epoch
        self.core.pinning.append(self.pinned_block_ids)
        self._refused: list[EngineRequest] = []
        self.preempted = 0
        self.isolation, self.steps, self.forwards = Isolation(), 0, 0
        self.peak_running_pages = self.peak_batch_tokens = 0
        self.flushing = False  # the manager is stopping: reply replays run without their grace period
        self.placeholders = placeholder_ids(cache.model)  # a vision-language wrapper's image placeholder ids
        self.speculator = Speculator(speculation, self)

    # ------------------------------------------------------------------ requests in and out

    def add(self, request: EngineRequest) -> None:
        """Queue ``request``. A reply replay still waiting whose tokens the new request's prompt starts with is dropped:
        that prompt's own prefill stores the reply as a prefill computes it."""
        if not request.replay_of:
            for replay in [r for r in self.scheduler.waiting if r.replay_of and r.salt == request.salt]:
                if request.key_tokens[: len(replay.prompt)] == replay.key_tokens:
                    self.scheduler.remove(replay)
        self.scheduler.waiting.append(request)

    @property
    def has_work(self) -> bool:
        """A request runs or may be admitted now (a reply replay in its grace period may not, unless flushing)."""
        return bool(self.scheduler.running) or any(not self._in_grace(r) for r in self.scheduler.waiting)

    def _in_grace(self, request: EngineRequest) -> bool:
        """A reply replay waits :data:`REPLAY_GRACE_S` for the conversation's next turn (which drops it, see
        :meth:`add`) before it may run, unless the engine is flushing (the manager is stopping)."""
        return (bool(request.replay_of) and not self.flushing
                and time.perf_counter() - request.created_time < REPLAY_GRACE_S)

    def find(self, request_id: str) -> EngineRequest | None:
        return next((r for r in (*self.scheduler.running, *self.scheduler.waiting) if r.request_id == request_id), None)

    def finish(self, request: EngineRequest, status: RequestStatus, error: str | None = None) -> None:
        """End ``request`` (finished, failed or cancelled): give back its slot and pages, unpin its chain."""
        if request.is_admitted:
            self._release(request)
        self.speculator.release(request)
        self.scheduler.remove(request)
        request.status, request.error = status, error
        request.lifespan = (request.lifespan[0], time.perf_counter())

    def abort(self, reason: str) -> list[EngineRequest]:
        """Fail every request left with ``reason`` and give everything back (:meth:`close`); returns them. A request
        whose slot or chain cannot be given back is failed all the same (logged): each gets its final output."""
        self.follow_store()
        left = [*self.scheduler.running, *self.scheduler.waiting]
        for request in left:
            try:
                self.finish(request, RequestStatus.FAILED, reason)
            except Exception:  # noqa: BLE001 - the others must still be failed and the store left usable
                logger.exception("giving back request %s failed", request.request_id)
                request.status, request.error = RequestStatus.FAILED, reason
        self.close()
        return left

    def close(self) -> None:
        """Give back everything (the requests left are the caller's to fail)."""
        if self.pinned_block_ids in self.core.pinning:
            self.core.pinning.remove(self.pinned_block_ids)
        for request in list(self.scheduler.running):
            try:
                self._release(request)
            except Exception:  # noqa: BLE001 - what could not be given back stays with the request; the rest goes
                logger.exception("giving back request %s failed", request.request_id)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        self.speculator.close()

    def pinned_block_ids(self) -> set[int]:
        """Blocks the running requests keep pinned (for the store's checks)."""
        return {b for r in self.scheduler.running if r.row is not None for b in r.row.block_ids}

    # ------------------------------------------------------------------ one step

    def step(self) -> list[EngineRequest]:
        """Run one step; returns the requests whose output changed (a new token, finished, failed). Code it calls back
        (processors, grammars, hooks, the vision tower) cannot call what waits for its end (``core.engine_scope``)."""
        with self.core.engine_scope():
            return self._step()

    def _step(self) -> list[EngineRequest]:
        self.follow_store()
        if self.inflight:
            for request in self.scheduler.waiting:
                self.inflight.ask_for_checkpoint(request)
        self.speculator.draft(self.scheduler.running, self._refuse)  # a drafter's fault fails its requests alone
        own = sum(len(r.own_pages) for r in self.scheduler.running)
        chunks = self.scheduler.choose(
            self.limits.max_running_pages - own, lambda: self.slots.num_free > 0, self.admit, self.preempt
        )
        refused, self._refused = self._refused, []
        if not chunks:
            return refused
        segments = [self._segment(chunk) for chunk in chunks]
        own = sum(len(r.own_pages) for r in self.scheduler.running)
        self.peak_running_pages = max(self.peak_running_pages, own)
        self.peak_batch_tokens = max(self.peak_batch_tokens, sum(len(s.tokens) for s in segments))
        self.steps += 1
        changed = refused
        # One forward per probe group (a raise touches only its requests), and apart from images what feeds a
        # placeholder id without its image.
        for group in (part for probe in forwards(segments) for part in images.split_forwards(probe, self.placeholders)):
            plan = StepPlan(group, self.tables, self.block_size)
            cache = StepCache(plan, self.spec, self.slots, self.pages)
            self.forwards += 1
            try:
                picks, logprobs = self.runner.run(plan, cache, images.forward_inputs(plan))
            except Exception as error:  # noqa: BLE001 - a failed forward fails its requests, never the engine
                changed += self._step_failed(group, error)
            else:
                changed += self._settle(plan, picks, logprobs)
        return changed

    def follow_store(self) -> None:
        """The store was emptied (``cache.clear()``): the running requests' chains are gone, so they store no more
        (their pages, held by the requests themselves, stay valid)."""
        if self.core.epoch == self.epoch:
            return
        self.epoch = self.core.epoch
        self.scores.clear()
        for request in self.scheduler.running:
            request.row.block_ids.clear()
            request.row.block_hashes.clear()
            request.row.storing = False

    def _segment(self, chunk: Chunk) -> Segment:
        """The chunk's segment, with the pages it writes allocated."""
        request = chunk.request
        needed = self.scheduler.pages_needed(request, chunk.num_tokens)
        if needed:
            with self.core.store_lock:
                new = self.pages.allocate(needed)
            self.tables[request.slot, len(request.pages) : len(request.pages) + needed] = torch.tensor(new)
            request.pages.extend(new)
            request.own_pages.update(new)
        tokens = request.remaining_tokens[: chunk.num_tokens]
        draft = request.draft[: chunk.num_tokens - len(tokens)] if request.is_decoding else ()
        segment = Segment(request, tokens + list(draft), request.past, request.fresh, draft=draft,
                          samples=request.past + len(tokens) == len(request.tokens) and not request.replay_of)
        segment.emit_positions = self.speculator.positions(segment, emit_positions(segment, self.core.options))
        return segment

    def _settle(self, plan: StepPlan, picks: list, logprobs: list | None) -> list[EngineRequest]:
        changed = []
        options = self.core.options
        self.speculator.keep(plan, picks, self.slots, options)  # verified segments cut to the tokens they keep
        bs = self.block_size  # weights edited while a request ran: it stores nothing more (one look per storing step)
        self.core.check_weights(s.request.row for s in plan.segments if s.captured or s.end // bs > s.past // bs)
        for segment in plan.segments:
            request = segment.request
            request.past, request.fresh, request.probe = segment.end, False, probe_after(segment)
            store_segment(self.core, segment, self.slots, self.placeholders)
            self.scores.settle(segment)
            if request.past >= len(request.prompt):
                self.inflight.leave(request)
                request.features = None  # its images' rows fed every placeholder
                if request.replay_of:  # stored as a prefill computes it: done, nothing to deliver
                    self.core.count_replayed_reply_tokens(len(request.prompt) - request.hit_tokens)
                    self.finish(request, RequestStatus.FINISHED)
        now = time.perf_counter()
        for i, (segment, (tokens, _)) in enumerate(zip(plan.sampled, picks)):
            request = segment.request
            if request.sample_error is not None:  # its grammar raised: its own fault (engine/grammar.py)
                self.finish(request, RequestStatus.FAILED, request.sample_error)
                changed.append(request)
                continue
            request.take(tokens, None if logprobs is None else logprobs[i], segment.sampled_scores, now)
            if tokens[-1] in request.eos_token_ids or len(request.generated) >= request.max_new_tokens:
                replay = replay_request(self.core, request) if options.replay_replies else None
                self.finish(request, RequestStatus.FINISHED)
                if replay is not None:
                    self.add(replay)
            changed.append(request)
        return changed

    def _step_failed(self, segments: list[Segment], error: Exception) -> list[EngineRequest]:
        """A forward raised: the requests :meth:`Isolation.judge <hf_hybridcache.engine.isolation.Isolation.judge>`
        fails (alone in it, or over their retry budget) fail; the others are preempted and put first in the queue in
        order, in their probe groups (:mod:`~hf_hybridcache.engine.isolation`), and run on beside the shared forward."""
        logger.warning("an engine forward of %d requests raised %s: %s", len({s.request for s in segments}),
                       type(error).__name__, error)
        failed, retried = self.isolation.judge(segments, error)
        for request in retried:
            self.scheduler.running.remove(request)
            self.preempt(request)
        self.scheduler.waiting.extendleft(reversed(retried))
        for request, message in failed.items():
            self.finish(request, RequestStatus.FAILED, message)
        self.isolation.acquit(failed, [*self.scheduler.running, *self.scheduler.waiting])
        return list(failed)

    # ------------------------------------------------------------------ admission and preemption

    def admit(self, request: EngineRequest) -> bool:
        """Admit a waiting request (a free slot was checked): its longest stored prefix is shared by reference and
        its checkpoint copied into the slot. False: it waits for a prefix another request is computing, or it failed
        (the model changed dtype or devices since the cache was built, or its vision tower raised on its images;
        returned by the next :meth:`step`)."""
        if self._in_grace(request):
            return False
        core, tokens, bs = self.core, request.key_tokens, self.block_size
        try:
            cause = core.check_model(self.cache.model)  # dropout on in training mode: nothing reused or stored
        except ValueError as error:
            return self._refuse(request, str(error))
        root, generation = core.request_start(request.salt)
        self.inflight.hash_chain(request, root)
        with core.store_lock:
            hit = stored = core.lookup(tokens, root, None if cause is None else len(tokens))
            if request.score_prompt is not None:  # it restores only what the scores of its prompt are kept for
                tail = core.options.min_tail_tokens
                hit = self.scores.restorable(request, hit, lambda b: core.store.find(tokens[: b + tail], root,
                                                                                     tail).hit_tokens)
            if cause is None and self.inflight.waits_for(request, hit.hit_tokens // bs):
                return False
            report = None if request.counted else core.report(tokens, root, stored, cause)
            if report is not None and request.score_prompt is not None:
                report = scored_report(report, hit.hit_tokens)
            pages = core.store.page_table(hit.block_ids).tolist()
            self.pages.ref(pages)
            core.pin(hit.block_ids)
            checkpoint = core.store.checkpoint_copy(hit.block_ids[-1]) if hit.hit_tokens else None
        request.slot = self.slots.take()
        if checkpoint is not None:
            self.slots.write(request.slot, checkpoint)
        self.tables[request.slot, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
        request.pages, request.own_pages, request.admissions = pages, set(), request.admissions + 1
        request.past, request.fresh = hit.hit_tokens, hit.hit_tokens == 0
        request.row = Row(request.retention_prompt_tokens, token_ids=tokens[: hit.hit_tokens], hit_tokens=hit.hit_tokens,
                          root=root, block_ids=list(hit.block_ids), block_hashes=list(hit.block_hashes),
                          divergence_tokens=hit.divergence_tokens, weights_generation=generation, storing=not cause)
        if not request.counted:
            core.count_request(len(request.prompt), hit.hit_tokens, [report.reason])
            request.counted, request.hit_tokens, request.hit_report = True, hit.hit_tokens, report
            request.lifespan = (time.perf_counter(), -1)
        elif request.replay_of:
            request.hit_tokens = hit.hit_tokens
        request.status = RequestStatus.PREFILLING
        self.inflight.claim(request, hit.hit_tokens)
        error = images.encode_counted(self.core, request)  # what its hit leaves in its tail
        return True if error is None else self._refuse(request, error)

    def _refuse(self, request: EngineRequest, error: str) -> bool:
        """Fail ``request`` at admission with ``error`` (its output goes with the next :meth:`step`'s); False."""
        self.finish(request, RequestStatus.FAILED, error)
        self._refused.append(request)
        return False

    def preempt(self, request: EngineRequest) -> None:
        """Give ``request``'s slot and pages back; it resumes from the store when admitted again."""
        self._release(request)
        request.status = RequestStatus.PENDING
        request.past, request.fresh = 0, True
        self.preempted += 1

    def _release(self, request: EngineRequest) -> None:
        self.inflight.leave(request)
        with self.core.store_lock:
            self.core.release(request.row.block_ids)
            self.pages.unref(request.pages)
        self.slots.give_back(request.slot)
        request.slot, request.row = None, None
        request.pages, request.own_pages = [], set()
