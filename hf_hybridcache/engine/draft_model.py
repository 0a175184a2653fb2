"""A draft model for speculative steps: a smaller causal LM with the target's tokenizer proposes each request's next
tokens, greedily.

The draft model is served by an :class:`~hf_hybridcache.engine.engine.Engine` of its own over its own
:class:`~hf_hybridcache.HybridPrefixCache`, so a hybrid draft model gets what the target gets: its own state slots and
pages, and prefix reuse through its own store (a draft request hits what earlier draft requests, or ``generate()``
calls on the draft cache, stored). Each target request that speculates has a *mirror* request in the draft engine
whose tokens are the target's tokens kept so far. One round of :meth:`DraftModelDrafter.propose`, for every mirror at
once:

1. the mirror feeds the target's tokens it has not fed yet (the tokens the last step kept: a prefill chunk over its
   own state, stored as any request's tokens are) and samples ``d_1``; its state after them is copied aside;
2. it feeds ``d_1 .. d_{k-1}`` one decode step at a time, sampling ``d_2 .. d_k``, storing nothing (``speculating``);
3. it is set back: its length to the target's tokens, its slot to the copy. The draft tokens' keys and values stay in
   its own pages past its length, where the next round's tokens overwrite them.

That is ``k`` draft forwards per round, as a draft model that keeps its accepted drafts' states would run (it would
feed the bonus token and the last draft the same way), without per-token states in the draft model. Mirrors of
requests that do not draft this round are ``held`` out of the draft engine's steps. A mirror preempted by the draft
engine resumes from the draft store like any request.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import GenerationConfig

from .._compat.continuous_batching import ContinuousBatchingConfig, RequestStatus, logits_processors
from .._compat.engine_attention import install_router
from ..core import CacheCore
from .drafters import Drafter
from .engine import Engine
from .grouping import wrap_stateful_modules
from .limits import EngineLimits
from .requests import EngineRequest
from .runner import StepRunner
from .speculative import MAX_SPECULATIVE_TOKENS


class DraftModelDrafter(Drafter):
    """Drafts with another model (its greedy tokens), run by an engine of its own.

    Args:
        cache: the draft model's :class:`~hf_hybridcache.HybridPrefixCache` (its store, budget and retention serve
            the draft requests; a hybrid of any supported family, not the target model object itself; a copy with
            the same weights drafts what the target would, every draft accepted).
        limits: the draft engine's :class:`~hf_hybridcache.engine.EngineLimits` (None: the target engine's, with
            room for the draft tokens).

    Raises:
        TypeError: ``cache`` is not a ``HybridPrefixCache`` (a model, a path), or ``limits`` not ``EngineLimits``.

    Attributes:
        engine: the draft engine while the target engine runs, else None.
    """

    def __init__(self, cache, limits: EngineLimits | None = None) -> None:
        if not isinstance(getattr(cache, "core", None), CacheCore) or not hasattr(cache, "model"):
            raise TypeError(f"DraftModelDrafter takes the draft model's HybridPrefixCache "
                            f"(DraftModelDrafter(HybridPrefixCache(small_model))), got {type(cache).__name__}.")
        if limits is not None and not isinstance(limits, EngineLimits):
            raise TypeError(f"limits must be an EngineLimits or None, got {type(limits).__name__}.")
        self.cache, self.limits = cache, limits
        self.engine: Engine | None = None
        self._vocab_size = 0
        self._mirrors: dict[EngineRequest, EngineRequest] = {}

    def start(self, engine) -> None:
        model, target = self.cache.model, engine.cache.model
        if model is target:
            raise ValueError("The draft model is the target model itself: pass a HybridPrefixCache of another model "
                             "(a smaller one with the same tokenizer, or a copy of this one for a ceiling).")
        self._vocab_size = target.get_input_embeddings().num_embeddings
        if model.get_input_embeddings().num_embeddings < self._vocab_size:
            raise ValueError(f"The draft model's vocabulary ({model.get_input_embeddings().num_embeddings} tokens) "
                             f"is smaller than the target's ({self._vocab_size}); use a draft model with the target's "
                             "tokenizer.")
        self.close()
        install_router(model)
        wrap_stateful_modules(model)
        limits = self.limits or EngineLimits(
            max_running_requests=engine.limits.max_running_requests, max_batch_tokens=engine.limits.max_batch_tokens,
            max_running_pages=engine.limits.max_running_pages,
            max_request_tokens=engine.limits.max_request_tokens + MAX_SPECULATIVE_TOKENS + 1)
        greedy = GenerationConfig(do_sample=False)
        runner = StepRunner(model, logits_processors(model, greedy, ContinuousBatchingConfig()), False, False, None)
        self.engine = Engine(self.cache, limits, runner)

    def propose(self, requests: Sequence[EngineRequest], num_tokens: Sequence[int]) -> list[list[int]]:
        rounds = [(self._mirror(request), len(request.tokens), n) for request, n in zip(requests, num_tokens)]
        drafting = {mirror for mirror, _, _ in rounds}
        for mirror in self._mirrors.values():
            mirror.held = mirror not in drafting
        copies = self._run(rounds)
        drafts = []
        for mirror, length, n in rounds:
            drafts.append(self._cut(mirror.tokens[length : length + n]))
            self._set_back(mirror, length, copies.get(mirror))
        return drafts

    def _mirror(self, request: EngineRequest) -> EngineRequest:
        """``request``'s mirror, its tokens set to the request's (made and queued on first use)."""
        mirror = self._mirrors.get(request)
        if mirror is None or mirror.is_finished:
            mirror = EngineRequest(f"{request.request_id}__draft", list(request.prompt),
                                   request.max_new_tokens + MAX_SPECULATIVE_TOKENS + 1, salt=request.salt)
            self._mirrors[request] = mirror
            self.engine.add(mirror)
        mirror.generated = list(request.generated)
        return mirror

    def _run(self, rounds: list[tuple[EngineRequest, int, int]]) -> dict[EngineRequest, tuple[int, dict]]:
        """Step the draft engine until every mirror of ``rounds`` drafted its tokens (or no step runs); returns each
        one's admission count and state copy after the target's tokens."""
        copies: dict[EngineRequest, tuple[int, dict]] = {}
        while True:
            pending = {m for m, length, n in rounds if not m.is_finished and len(m.tokens) < length + n}
            if not pending:
                return copies
            for mirror, _, _ in rounds:
                mirror.held = mirror not in pending
            steps = self.engine.steps
            self.engine.step()
            for mirror, length, _ in rounds:
                if mirror not in copies and mirror.is_admitted and len(mirror.tokens) == length + 1:
                    copies[mirror] = (mirror.admissions, self.engine.slots.read(mirror.slot))
                    mirror.speculating = True
            if self.engine.steps == steps:  # nothing could run (no slot or page): draft what there is
                return copies

    def _set_back(self, mirror: EngineRequest, length: int, copy: tuple[int, dict] | None) -> None:
        """Set ``mirror`` back to the target's ``length`` tokens (its state from ``copy``: its admission count and the
        slot's state after them), or make it recompute them from the store when that state is gone."""
        mirror.speculating = False
        del mirror.generated[length - len(mirror.prompt) :]
        if not mirror.is_admitted or mirror.past <= length:
            return
        if copy is not None and copy[0] == mirror.admissions:
            self.engine.slots.write(mirror.slot, copy[1])
            mirror.past = length
        else:  # preempted and admitted again while it fed draft tokens: its slot holds them
            self.engine.scheduler.requeue(mirror, self.engine.preempt)

    def _cut(self, tokens: list[int]) -> list[int]:
        """``tokens`` up to the first the target's vocabulary lacks."""
        return tokens[: next((i for i, t in enumerate(tokens) if t >= self._vocab_size), len(tokens))]

    def release(self, request: EngineRequest) -> None:
        mirror = self._mirrors.pop(request, None)
        if mirror is not None and not mirror.is_finished and self.engine is not None:
            self.engine.finish(mirror, RequestStatus.FINISHED)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine, self._mirrors = None, {}
