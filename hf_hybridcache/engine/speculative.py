"""Speculative steps: a decoding request feeds its last token and ``k`` draft tokens in one step, and keeps the drafts
the target model agrees with (:mod:`~hf_hybridcache.engine.verify`), so one forward can emit up to ``k + 1`` tokens.

Before a step the :class:`Speculator` asks the drafter (:mod:`~hf_hybridcache.engine.drafters`) for the drafts of the
decoding requests that speculate; the scheduler fits them in the step's tokens and pages (a draft is cut before a
request's one token is). The request's segment is ``[last token, d_1 .. d_k]``, run in a *verify group* beside the
step's decodes and prefill chunks (:mod:`~hf_hybridcache.engine.plan`), and every one of its positions is sampled.

A recurrent layer cannot be cut back to an earlier token, so the segment asks the mixers for its states after every
position, through the same emission that hands a prefill's checkpoints over (``emit_positions``, the mixers'
``capture_states``). When the step is settled (:meth:`Speculator.keep`) the request keeps the tokens it fed up to
the last one emitted: the segment is cut there, the state after that position is copied into its slot (the slot holds
the state after the whole segment), and the states at positions cut off are dropped. The keys and values of the
tokens cut off stay in the request's own pages past its length, where its next tokens overwrite them; the store gets
only blocks and checkpoints of tokens kept (``store_segment`` of the cut segment), so a later request hits exactly as
it would without speculation.

Requests opt out with ``num_speculative_tokens=0`` (``add_request``); a request in a probe group (it was in a forward
that raised, :mod:`~hf_hybridcache.engine.isolation`) decodes plainly until it leaves it, and drafts never carry a
vision-language wrapper's image placeholder ids (fed without their image they would end the request's storing).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import CacheOptions
from .draft_checks import DraftError, draft_parts
from .drafters import Drafter, claim, release
from .plan import Segment, StepPlan
from .requests import EngineRequest
from .slots import StateSlots
from .storing import checkpoint_plan
from .verify import Pick

logger = logging.getLogger("hf_hybridcache")

#: The most draft tokens a request may verify in one step.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class Speculation:
    """How an engine speculates: ``cache.init_continuous_batching(..., speculation=Speculation(NgramDrafter()))``.

    Args:
        drafter: proposes the drafts (:class:`~hf_hybridcache.engine.NgramDrafter`,
            :class:`~hf_hybridcache.engine.DraftModelDrafter`, or a :class:`~hf_hybridcache.engine.Drafter` of yours).
        num_speculative_tokens: draft tokens per request and step at most (``add_request(...,
            num_speculative_tokens=n)`` takes 0 to this; 0 turns it off for that request).

    Raises:
        ValueError: ``num_speculative_tokens`` outside ``1 .. 16`` or a drafter that is not a ``Drafter``.
    """

    drafter: Drafter
    num_speculative_tokens: int = 4

    def __post_init__(self) -> None:
        n = self.num_speculative_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an int in [1, {MAX_SPECULATIVE_TOKENS}], got {n!r}.")
        if not isinstance(self.drafter, Drafter):
            raise ValueError(f"drafter must be a hf_hybridcache.engine.Drafter (NgramDrafter(), "
                             f"DraftModelDrafter(draft_cache)), got {type(self.drafter).__name__}.")


def speculation_error(num_speculative_tokens, speculation: Speculation | None) -> str | None:
    """Why a request cannot ask for ``num_speculative_tokens`` under ``speculation`` (the manager's), or None."""
    n = num_speculative_tokens
    if n is None or n == 0 and not isinstance(n, bool):
        return None
    most = 0 if speculation is None else speculation.num_speculative_tokens
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= most:
        if speculation is None:
            return (f"num_speculative_tokens={n!r}: this manager does not speculate; pass speculation=Speculation(...) "
                    "to init_continuous_batching, or leave num_speculative_tokens unset.")
        return f"num_speculative_tokens must be an int in [0, {most}] (the manager's speculation), got {n!r}."
    return None


@dataclass
class SpeculationStats:
    """What an engine's speculative steps drafted and kept.

    Attributes:
        verify_segments: request-steps that verified a draft.
        drafted_by_position, accepted_by_position: per draft position ``i`` (0 first), the drafts that had a token
            there, and those whose token there was kept (a kept token's earlier ones were kept too).
        emitted_tokens: tokens the verifying request-steps emitted (the kept drafts and one more each, less what an
            end-of-sequence token or ``max_new_tokens`` cut).
    """

    verify_segments: int = 0
    drafted_by_position: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)
    accepted_by_position: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)
    emitted_tokens: int = 0

    @property
    def drafted_tokens(self) -> int:
        return sum(self.drafted_by_position)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted_by_position)

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (nan before any draft)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else float("nan")

    def count(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        self.verify_segments += 1
        self.emitted_tokens += num_emitted
        for i in range(num_drafted):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < num_accepted


class Speculator:
    """The engine's side of speculation: drafts before a step, what a verified segment keeps after it.

    Args:
        speculation: the drafter and the default draft length; None: the engine does not speculate (nothing here
            does anything).
        engine: the :class:`~hf_hybridcache.engine.engine.Engine` (started here with the drafter: ``Drafter.start``).

    Attributes:
        stats: :class:`SpeculationStats` of the engine so far.
    """

    def __init__(self, speculation: Speculation | None, engine) -> None:
        self.drafter = None if speculation is None else speculation.drafter
        self.default = 0 if speculation is None else speculation.num_speculative_tokens
        self.placeholders = engine.placeholders  # a vision-language wrapper's: drafts stop before one
        self.stats = SpeculationStats()
        self._faulted: dict[EngineRequest, str] = {}  # requests whose drafter's observe() raised: failed next step
        self.runner = engine.runner
        model = engine.cache.model
        self.vocab_size = model.get_input_embeddings().num_embeddings
        head = model.get_output_embeddings()
        self.probs_width = head.weight.shape[0] if head is not None else self.vocab_size  # the logits' width
        self.device = (head if head is not None else model.get_input_embeddings()).weight.device
        self.runner.keep_hidden = self.drafter is not None and self.drafter.wants_hidden_states  # an MTP head's
        if self.drafter is not None:
            claim(self.drafter, engine)
            try:
                self.drafter.start(engine)
            except BaseException:
                release(self.drafter, engine)
                raise
        self._engine = weakref.ref(engine)

    def num_tokens(self, request: EngineRequest) -> int:
        """Draft tokens ``request`` may verify in its next step: its own setting (else the default), less than the
        new tokens it may still emit (one more is always emitted); none for a grammar matcher that cannot take a
        verified draft back (a grammar of your own without ``try_accept`` and ``rollback``)."""
        wanted = self.default if request.num_speculative_tokens is None else request.num_speculative_tokens
        if request.probe is not None or request.replay_of or not _takes_drafts_back(request.grammar):
            return 0
        return max(min(wanted, request.max_new_tokens - len(request.generated) - 1), 0)

    def draft(self, running: list[EngineRequest], fail: Callable[[EngineRequest, str], object]) -> None:
        """Set ``request.draft`` of every running request: its drafter's drafts when it is decoding and speculates,
        else none. ``fail(request, why)`` fails a request: every request the drafter was asked for when it raised,
        a request alone when its draft is not one the engine can verify (:func:`~.draft_checks.draft_parts`) or when
        the drafter's ``observe`` raised for it in the step before."""
        faulted = [(request, self._faulted.pop(request)) for request in running if request in self._faulted]
        failing = {request for request, _ in faulted}
        for request, why in faulted + self._drafts([r for r in running if r not in failing]):
            fail(request, why)

    def _drafts(self, running: list[EngineRequest]) -> list[tuple[EngineRequest, str]]:
        if self.drafter is None:
            return []
        wanted = []
        for request in running:
            request.draft, request.draft_probs = (), None
            n = self.num_tokens(request) if request.is_decoding else 0
            if n:
                wanted.append((request, n))
        if not wanted:
            return []
        name = type(self.drafter).__name__
        try:
            drafts = list(self.drafter.propose([r for r, _ in wanted], [n for _, n in wanted]))
            if len(drafts) != len(wanted):
                raise ValueError(f"it returned {len(drafts)} drafts for {len(wanted)} requests")
        except Exception as error:  # noqa: BLE001 - a drafter's fault fails the requests it drafts for, not the engine
            reason = f"The drafter {name}.propose raised {type(error).__name__}: {error}"
            return [(request, reason) for request, _ in wanted]
        failed = []
        for (request, n), draft in zip(wanted, drafts):
            try:
                tokens, probs = draft_parts(draft, n, self.vocab_size, self.probs_width, self.device, name)
            except DraftError as error:
                failed.append((request, str(error)))
                continue
            cut = next((i for i, t in enumerate(tokens) if t in self.placeholders), len(tokens))
            request.draft = tokens[:cut]
            request.draft_probs = None if probs is None or not cut else probs[:cut]
        return failed

    @staticmethod
    def positions(segment: Segment, kept: tuple[int, ...]) -> tuple[int, ...]:
        """The emit positions of ``segment`` given the checkpoint positions ``kept``: a verify segment's are after
        every token but the last (whose state the slot gets), to keep the one after the last token it keeps."""
        return tuple(sorted(set(kept) | set(range(1, len(segment.tokens))))) if segment.draft else kept

    def keep(self, plan: StepPlan, picks: list[Pick], slots: StateSlots, options: CacheOptions) -> None:
        """Cut each verified segment of ``plan`` to the tokens it keeps, given its pick (the tokens it emitted and how
        many of them are its drafts, in ``plan.sampled`` order): its last token and the drafts before the last
        emitted token. Its request's slot gets the state after them, and ``segment.captured`` keeps only the
        boundaries its cut chunk stores. A drafter that wants them then gets the final hidden states of the positions
        each segment keeps (:meth:`observe`)."""
        for segment, (tokens, num_accepted) in zip(plan.sampled, picks):
            if segment.draft:
                self._keep(segment, tokens, num_accepted, slots, options)
        self.observe(plan, self.runner.hidden)

    def _keep(self, segment: Segment, tokens: list[int], num_accepted: int, slots: StateSlots,
              options: CacheOptions) -> None:
        num_kept = len(tokens)
        self.stats.count(len(segment.draft), num_accepted, num_kept)
        if num_kept < len(segment.tokens):
            end = segment.past + num_kept
            slots.write(segment.request.slot, segment.captured[end])
            segment.tokens, segment.draft = segment.tokens[:num_kept], segment.draft[: num_kept - 1]
        wanted = checkpoint_plan(segment, options).wanted
        segment.captured = {b: states for b, states in segment.captured.items() if b in wanted and b < segment.end}

    def observe(self, plan: StepPlan, hidden: torch.Tensor | None) -> None:
        """Hand the drafter (one that wants them) the final hidden states ``[N, H]`` of the positions each segment of
        ``plan`` keeps (after :meth:`keep` cut the verified ones); a reply's replay drafts nothing and gets none."""
        if not self.runner.keep_hidden or hidden is None:
            return
        for group in plan.groups:
            for row, segment in enumerate(group.segments):
                request = segment.request
                if not request.replay_of and request not in self._faulted:
                    start = group.start + row * group.num_tokens
                    try:
                        self.drafter.observe(request, segment.past, hidden[start : start + len(segment.tokens)])
                    except Exception as error:  # noqa: BLE001 - fails its request (next step), not the engine
                        self._faulted[request] = (f"The drafter {type(self.drafter).__name__}.observe raised "
                                                  f"{type(error).__name__}: {error}")

    def release(self, request: EngineRequest) -> None:
        """``request`` left the engine: the drafter forgets it (what it raises is logged: the request is done)."""
        self._faulted.pop(request, None)
        if self.drafter is not None:
            try:
                self.drafter.release(request)
            except Exception:  # noqa: BLE001 - the request has left; the engine goes on
                logger.exception("the drafter %s.release(%s) raised", type(self.drafter).__name__, request.request_id)

    def close(self) -> None:
        """The engine closes: the drafter gives back what it holds (what it raises is logged) and is free to serve
        another engine."""
        if self.drafter is not None:
            try:
                self.drafter.close()
            except Exception:  # noqa: BLE001 - the engine's requests must still be delivered
                logger.exception("the drafter %s.close() raised", type(self.drafter).__name__)
            finally:
                release(self.drafter, self._engine())


def _takes_drafts_back(matcher) -> bool:
    """Whether a request's grammar matcher (None: it has none) can mask verified positions: advance over drafts
    (``try_accept``) and take them back (``rollback``), as :class:`~hf_hybridcache.structured.GrammarMatcher` does."""
    return matcher is None or (callable(getattr(matcher, "try_accept", None))
                               and callable(getattr(matcher, "rollback", None)))


def drafted_probs(segment: Segment) -> torch.Tensor | None:
    """The draft distributions ``[k, V]`` of a verify segment's drafts (None: proposed with certainty)."""
    probs = segment.request.draft_probs
    return None if probs is None else probs[: len(segment.draft)]
