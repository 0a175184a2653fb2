"""One request of the engine: what the user asked for, where it stands, and what it holds while it runs.

Lifecycle (``status``, transformers' ``RequestStatus``)::

    PENDING ──admit──> PREFILLING ──prompt done──> DECODING ──EOS / max_new_tokens──> FINISHED
       ^                   │                          │
       └──── preempted ────┴──────────────────────────┘       (any state) ──error / cancel / stop──> FAILED

While admitted a request holds a state slot (its conv + recurrent states), a page table (the KV pages of its tokens:
pages shared from a prefix hit, then pages of its own) and a :class:`~hf_hybridcache.core.rows.Row` (its chain in the
store, pinned). A preempted request gives all three back and re-enters the queue with its prompt and the tokens it
generated so far, which it recomputes from the store's longest hit when admitted again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .._compat.continuous_batching import EngineOutput, RequestStatus
from ..core import HitReport, Row
from ..hashing import BlockHash
from ..structured.grammar import GrammarMatcher


@dataclass(eq=False)
class EngineRequest:
    """A request and its running state.

    Attributes:
        request_id: the user's id (children of a request with ``num_return_sequences`` are ``{id}__child#{k}``).
        prompt: the prompt's token ids.
        max_new_tokens: tokens to generate at most.
        eos_token_ids: token ids that finish the request (included in its output).
        sampling: logits-processor kwargs of this request (``temperature``, ``top_k``, ``top_p``).
        seed: seed of this request's own sampling generator (None: it draws from the engine's shared one), so that
            its samples do not depend on the requests it runs with.
        generator: that generator, made by the runner at its first sample.
        salt: the tenant salt of its prefix chains (None: unsalted).
        streaming: deliver an output after every token (else only at the end).
        record_timestamps: record when each token was generated.
        generated: the tokens generated so far.
        hit_tokens: prompt tokens its first admission restored from the store.
        hit_report: why that hit is that long (:class:`~hf_hybridcache.core.explain.HitReport`), or None before it.
        status, error, created_time, lifespan, timestamps: as transformers' ``GenerationOutput``.
        slot: its state slot while admitted, else None.
        pages: its page table while admitted: page ``i`` holds tokens ``[i * block_size, (i + 1) * block_size)``.
        own_pages: the pages of ``pages`` it allocated and the store does not own (the engine's running pages).
        past: tokens whose KV is in its pages and whose state is in its slot.
        fresh: its slot holds no state yet (admitted without a hit, before its first chunk).
        row: its chain in the store while admitted.
        root: the root hash of its chains (salt and weights state at its first admission).
        chain_hashes: hashes of the full blocks of ``tokens`` (for the in-flight prefix index), or None.
        extra_boundaries: boundaries other requests asked it to keep a checkpoint at (they share its prefix).
        asked: while waiting, it asked the running request computing its prefix to keep a checkpoint for it.
        probe: its probe group while it is suspect (it was in a forward of several requests that raised), else None:
            the group runs in a forward of its own (:mod:`~hf_hybridcache.engine.isolation`).
        suspect_until: tokens it must have run in a forward that succeeded to leave its probe group (where its
            last segment in a forward that raised ended).
        suspect_decode: a decode step of it was in a forward that raised: only a decode step past ``suspect_until``
            takes it out of its probe group (a recompute by prefill runs other code).
        raised: the forwards of several requests that raised with it in them and that no failed request explains
            (ids); at :data:`~hf_hybridcache.engine.isolation.RETRY_BUDGET` of them it runs alone, past it it fails.
        counted: its prompt and hit were counted in the cache's counters.
        score_prompt, score_generated: alternatives per token (0-5, 0-20) of the logprobs it asks for its prompt
            tokens and its generated tokens (:mod:`~hf_hybridcache.engine.scoring`); None: none asked.
        prompt_scores: the :class:`~hf_hybridcache.engine.scoring.TokenScore` of its prompt tokens ``0 ..`` so far
            (entry 0 None), computed or restored with a hit (:mod:`~hf_hybridcache.engine.score_store`).
        token_scores: the scores of its generated tokens.
        grammar: its :class:`~hf_hybridcache.structured.GrammarMatcher` when its output follows a grammar (the
            step masks what it does not allow, :mod:`~hf_hybridcache.engine.grammar`), else None.
        sample_error: why its sampling failed in the step just run (its grammar raised), or None: the engine fails it
            alone when it settles the step.
        replay_of: for a reply replay (``replay_replies``), the prompt length of the finished request whose tokens
            it runs again as one prefill to store them as a prefill computes them
            (:mod:`~hf_hybridcache.generate.reply_replay`; its checkpoints are kept as that request's would be); it
            samples nothing and is never delivered. 0: a user's request.
        images: its images (a :class:`~hf_hybridcache.engine.images.RequestImages`: items, token keys, 3D rotary
            positions), or None for a text prompt.
        features: its images' feature rows while its prompt runs (a :class:`~hf_hybridcache.engine.images.Features`),
            else None.
        num_speculative_tokens: draft tokens it may verify per step (None: the engine's default, 0: it does not
            speculate; :mod:`~hf_hybridcache.engine.speculative`).
        draft, draft_probs: the draft tokens of its next step and their draft distributions ``[k, V]`` (None: proposed
            with certainty), set before each step.
        held: it is left out of the steps for now (a draft engine's request whose target is not drafting).
        speculating: what it feeds now is not its own for good (a draft engine's request feeding draft tokens): its
            steps store nothing.
        admissions: times it was admitted (a preempted request is admitted again).
    """

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    sampling: dict = field(default_factory=dict)
    seed: int | None = None
    generator: torch.Generator | None = field(default=None, repr=False)
    salt: str | None = None
    streaming: bool = False
    record_timestamps: bool = False
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    hit_tokens: int = 0
    hit_report: HitReport | None = None
    status: RequestStatus = RequestStatus.PENDING
    error: str | None = None
    created_time: float = field(default_factory=time.perf_counter)
    lifespan: tuple[float, float] = (-1, -1)
    timestamps: list[float] | None = None
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    own_pages: set[int] = field(default_factory=set)
    past: int = 0
    fresh: bool = True
    row: Row | None = None
    root: BlockHash | None = None
    chain_hashes: list[BlockHash] | None = None
    extra_boundaries: set[int] = field(default_factory=set)
    asked: bool = False
    probe: int | None = None
    suspect_until: int = 0
    suspect_decode: bool = False
    raised: set[int] = field(default_factory=set)
    counted: bool = False
    replay_of: int = 0
    score_prompt: int | None = None
    score_generated: int | None = None
    prompt_scores: list = field(default_factory=list)
    token_scores: list = field(default_factory=list)
    grammar: GrammarMatcher | None = field(default=None, repr=False)
    sample_error: str | None = None
    images: object | None = field(default=None, repr=False)
    features: object | None = field(default=None, repr=False)
    num_speculative_tokens: int | None = None
    draft: tuple[int, ...] = ()
    draft_probs: torch.Tensor | None = field(default=None, repr=False)
    held: bool = False
    speculating: bool = False
    admissions: int = 0

    @property
    def tokens(self) -> list[int]:
        """The tokens the model must have seen (or been fed) to continue: the prompt, then every generated token."""
        return self.prompt + self.generated

    @property
    def key_tokens(self) -> list[int]:
        """What it is looked up, stored and shared in flight by: :attr:`tokens` with each image's placeholder ids
        replaced by its token keys (:mod:`~hf_hybridcache.multimodal.prompt`)."""
        if self.images is None:
            return self.tokens
        tokens, keys = self.tokens, self.images.keys
        return keys[: len(tokens)] + tokens[len(keys) :]

    def keys_of(self, start: int, tokens: list[int]) -> list[int]:
        """The token keys of ``tokens``, fed from position ``start`` on (``key_tokens[start : start + len(tokens)]``
        without building the whole list)."""
        if self.images is None:
            return tokens
        keys = self.images.keys[start : start + len(tokens)]
        return keys + tokens[len(keys) :]

    @property
    def retention_prompt_tokens(self) -> int:
        """The prompt length its checkpoints are retained by (a replay's: the replayed request's)."""
        return self.replay_of or len(self.prompt)

    @property
    def is_admitted(self) -> bool:
        return self.slot is not None

    @property
    def is_decoding(self) -> bool:
        """Its next step feeds one generated token (its prompt and all but the last generated token are in)."""
        return self.is_admitted and self.past == len(self.tokens) - 1 and bool(self.generated)

    @property
    def remaining_tokens(self) -> list[int]:
        """The tokens still to feed before it samples its next token."""
        return self.tokens[self.past :]

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    def take(self, tokens: list[int], logprobs: list[float] | None, scores: list | None, now: float) -> None:
        """Append the ``tokens`` a step emitted (with their ``logprobs`` and ``scores`` when it asked for them)."""
        self.generated.extend(tokens)
        if logprobs is not None:
            self.logprobs.extend(logprobs)
        if scores:
            self.token_scores.extend(scores)
        if self.timestamps is not None:
            self.timestamps.extend([now] * len(tokens))
        self.status = RequestStatus.DECODING

    def to_output(self) -> EngineOutput:
        """Its transformers ``GenerationOutput`` (copies of the lists)."""
        return EngineOutput(
            request_id=self.request_id,
            prompt_ids=list(self.prompt),
            generated_tokens=list(self.generated),
            logprobs=list(self.logprobs),
            error=self.error,
            status=self.status,
            created_time=self.created_time,
            lifespan=self.lifespan,
            timestamps=None if self.timestamps is None else list(self.timestamps),
            hit_tokens=self.hit_tokens,
            hit_report=self.hit_report,
            prompt_scores=None if self.score_prompt is None else list(self.prompt_scores),
            token_scores=None if self.score_generated is None else list(self.token_scores),
        )


def validation_error(
    prompt, max_new_tokens, vocab_size: int, max_request_tokens: int, salt, seed=None, num_sequences: int = 1
) -> str | None:
    """Why a request cannot run, as a sentence that says what to do, or None when it can (``num_sequences``: the
    ``num_return_sequences`` whose seeds are ``seed`` up to ``seed + num_sequences - 1``)."""
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
        return f"input_ids must be a list of token ids, got {type(prompt).__name__}; tokenize the prompt first."
    if len(prompt) == 0:
        return "The prompt is empty: pass at least one token id (e.g. the BOS token)."
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return "input_ids must be a flat list of ints (token ids); pass one prompt per request."
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab_size:
        return (
            f"Token id {low if low < 0 else high} is outside the model's vocabulary [0, {vocab_size}); check that the "
            "tokenizer belongs to this model."
        )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        return f"max_new_tokens must be a positive int, got {max_new_tokens!r}."
    if len(prompt) + max_new_tokens > max_request_tokens:
        return (
            f"The prompt ({len(prompt)} tokens) plus max_new_tokens ({max_new_tokens}) is over this engine's limit "
            f"of {max_request_tokens} tokens per request; shorten the prompt or lower max_new_tokens."
        )
    if salt is not None and (not isinstance(salt, str) or not salt):
        return f"cache_salt must be a non-empty string naming the tenant, or None; got {salt!r}."
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        return f"seed must be an int or None, got {seed!r}."
    if seed is not None and not -(2**63) <= seed <= 2**64 - num_sequences:  # torch.Generator.manual_seed's range
        return f"seed must be in [-2**63, 2**64 - {num_sequences}] (seeds up to seed + {num_sequences - 1}), got {seed}."
    return None


def first_eos_ids(*candidates) -> frozenset[int]:
    """The EOS token ids of the first candidate that is not None (an id or a list of ids; negative ids dropped)."""
    for candidate in candidates:
        if candidate is not None:
            ids = candidate if isinstance(candidate, (list, tuple, set)) else [candidate]
            return frozenset(int(i) for i in ids if int(i) >= 0)
    return frozenset()
