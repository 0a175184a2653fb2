"""Which requests feed which tokens in the next step, under the engine's bounds. No tensors, no store: admission
and preemption are the engine's, called back from here.

Each step, in this order (vLLM's and transformers' continuous-batching policy: decodes first, then chunked prefill):

1. Every decoding request feeds its one token (oldest first, within the token budget). When the pages they need are
   not free, the newest running requests are preempted (they give their slot and private pages back and wait to be
   recomputed through the store) until the rest fit. Then each one's draft tokens, if it has any
   (:mod:`~hf_hybridcache.engine.speculative`), as far as the tokens and pages left go: a draft is cut, never a
   request's own token.
2. Requests in prefill continue with the next chunk of their remaining tokens, oldest first, as far as the token
   budget and the free pages go; a chunk that stops short of the end is cut at a block boundary, so the next one
   starts on a page boundary and equal chunks of several requests form one group.
3. Waiting requests are admitted in arrival order while a slot, tokens and pages remain (admission may defer a
   request whose prefix another running request is computing; it keeps its place).

Requests ``held`` (a draft engine's requests whose targets are not drafting) are left out of the step.

Requests in a probe group (they were in a forward that raised) are scheduled like any other: the engine runs each
group in a forward of its own (:mod:`~hf_hybridcache.engine.isolation`), so nothing waits behind them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .requests import EngineRequest


@dataclass(frozen=True)
class Chunk:
    """``request`` feeds ``num_tokens`` of its remaining tokens in the step."""

    request: EngineRequest
    num_tokens: int


class Scheduler:
    """The running and waiting requests and the choice of each step.

    Args:
        max_batch_tokens: tokens per step.
        block_size: tokens per page.

    Attributes:
        running: admitted requests, oldest first.
        waiting: requests not admitted (new ones, deferred ones, preempted ones first), in order.
    """

    def __init__(self, max_batch_tokens: int, block_size: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.block_size = block_size
        self.running: list[EngineRequest] = []
        self.waiting: deque[EngineRequest] = deque()

    def pages_needed(self, request: EngineRequest, num_tokens: int) -> int:
        """New pages ``request`` needs to feed ``num_tokens`` more tokens."""
        return max(-(-(request.past + num_tokens) // self.block_size) - len(request.pages), 0)

    def choose(
        self,
        free_pages: int,
        has_free_slot: Callable[[], bool],
        admit: Callable[[EngineRequest], bool],
        preempt: Callable[[EngineRequest], None],
    ) -> list[Chunk]:
        """The chunks of the next step. ``free_pages``: pages the running requests may still take;
        ``admit(request)`` admits a waiting request (slot, prefix hit, pages of the hit) or defers it (False);
        ``preempt(request)`` gives a running request's slot and pages back (it is put first in ``waiting`` here)."""
        chunks: list[Chunk] = []
        budget = self.max_batch_tokens
        decoding = [r for r in self.running if r.is_decoding and not r.held][:budget]
        while sum(self.pages_needed(r, 1) for r in decoding) > free_pages and len(self.running) > 1:
            victim = self.running[-1]
            free_pages += self.requeue(victim, preempt)
            decoding = [r for r in decoding if r is not victim]
        free_pages -= sum(self.pages_needed(r, 1) for r in decoding)
        budget -= len(decoding)
        for request in decoding:
            extra = min(len(request.draft), budget)
            while extra and self.pages_needed(request, 1 + extra) - self.pages_needed(request, 1) > free_pages:
                extra -= 1
            request.draft = request.draft[:extra]
            chunks.append(Chunk(request, 1 + extra))
            free_pages -= self.pages_needed(request, 1 + extra) - self.pages_needed(request, 1)
            budget -= extra
        for request in [r for r in self.running if not r.is_decoding and not r.held]:
            chunk = self._chunk(request, budget, free_pages)
            if chunk is None:
                continue
            chunks.append(chunk)
            budget -= chunk.num_tokens
            free_pages -= self.pages_needed(request, chunk.num_tokens)
        for request in list(self.waiting):
            if budget < 1 or free_pages < 1 or not has_free_slot():
                break
            if request.held or not admit(request):
                continue
            self.waiting.remove(request)
            self.running.append(request)
            chunk = self._chunk(request, budget, free_pages)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_tokens
                free_pages -= self.pages_needed(request, chunk.num_tokens)
        if not chunks and len(self.running) > 1 and not all(r.held for r in self.running):
            # every running request waits for pages: make room for the oldest
            freed = self.requeue(self.running[-1], preempt)
            return self.choose(free_pages + freed, has_free_slot, admit, preempt)
        return chunks

    def _chunk(self, request: EngineRequest, budget: int, free_pages: int) -> Chunk | None:
        """The next chunk of ``request`` within ``budget`` tokens and ``free_pages`` pages, or None."""
        remaining = len(request.remaining_tokens)
        room = (len(request.pages) + free_pages) * self.block_size - request.past
        num_tokens = min(remaining, budget, room)
        if num_tokens < remaining:
            cut = num_tokens - (request.past + num_tokens) % self.block_size
            num_tokens = cut if cut > 0 else num_tokens
        return Chunk(request, num_tokens) if num_tokens > 0 else None

    def requeue(self, request: EngineRequest, preempt: Callable[[EngineRequest], None]) -> int:
        """Preempt running ``request`` with ``preempt`` and put it first in ``waiting``; returns the pages it gave back."""
        freed = len(request.own_pages)
        self.running.remove(request)
        preempt(request)
        self.waiting.appendleft(request)
        return freed

    def remove(self, request: EngineRequest) -> None:
        """Forget ``request`` (finished, failed or cancelled)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
