"""One engine step: the packed forward of a :class:`~hf_hybridcache.engine.plan.StepPlan`, then sampling.

The model's own forward runs on ``input_ids`` / ``position_ids`` ``[1, N]`` with the
:class:`~hf_hybridcache.engine.views.StepCache` as its cache, a mask mapping that builds no masks (the groups carry
their own), and ``logits_to_keep`` = the sampled positions, so only ``[M, V]`` logits are computed. Sampling is
transformers' continuous batching's after the grammar masks of requests that follow one
(:mod:`~hf_hybridcache.engine.grammar`): the end-of-sequence floor of ``min_new_tokens`` / ``min_length``
(:class:`~hf_hybridcache.engine.generation_fields.EosFloor`), its logits processors (per-request temperature, top-k,
top-p), then argmax or ``multinomial`` from one generator (seeded by ``ContinuousBatchingConfig.seed``), or from a
request's own generator when it was added with a ``seed``. A segment that verifies draft tokens has a row of logits
per position, each masked and processed as that position's own next-token choice (its grammar advanced over the
drafts before it, its end-of-sequence floor counting them), and keeps what :mod:`~hf_hybridcache.engine.verify`
accepts: argmax tokens greedily, rejection sampling when sampling.
"""

from __future__ import annotations

import contextlib

import torch

from .. import _compat
from ..models.decode_linear import decode_threads
from .._compat.continuous_batching import processor_args, warpers_only
from .._compat.mtp import final_hidden_states
from . import grammar, scoring, verify
from .generation_fields import EosFloor
from .plan import Segment, StepPlan
from .speculative import drafted_probs
from .verify import Pick
from .views import StepCache


class _NoMasks(dict):
    """A mask mapping that answers None for every layer type: the model builds no attention masks (the engine's
    groups carry them)."""

    def __missing__(self, key):
        return None


class StepRunner:
    """Runs steps of one model.

    Args:
        model: the ``*ForCausalLM``.
        processors: transformers' ``ContinuousBatchingLogitsProcessorList``.
        do_sample: sample (else greedy argmax).
        return_logprobs: also return the log-probability of each sampled token.
        seed: seed of the sampling generator (None: random).
        floor: ``min_new_tokens`` / ``min_length`` of the generation config, applied before the processors as
            ``generate()`` orders them (None: neither is set).

    Attributes:
        keep_hidden: keep the final hidden states of each forward (set by an engine whose drafter wants them).
        hidden: the last forward's final hidden states ``[N, H]`` (the pack's tokens; None unless ``keep_hidden``).
    """

    keep_hidden = False
    hidden: torch.Tensor | None = None

    def __init__(self, model, processors, do_sample: bool, return_logprobs: bool, seed: int | None,
                 floor: EosFloor | None = None) -> None:
        self.model = model
        self.processors = processors
        self.floor = floor
        self.do_sample = do_sample
        self.return_logprobs = return_logprobs
        self._warpers_only = warpers_only(processors)
        self.device = model.get_input_embeddings().weight.device
        self.generator = torch.Generator(device=self.device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    @torch.no_grad()
    def run(self, plan: StepPlan, cache: StepCache, inputs: dict | None = None
            ) -> tuple[list[Pick], list[list[float]] | None]:
        """The tokens each of ``plan.sampled`` emits and how many of them are its drafts (one token and 0 for a
        segment without drafts), and their log-probabilities when asked; ``inputs``: the forward's image inputs
        (:func:`~hf_hybridcache.engine.images.forward_inputs`: ``mm_encoder_outputs``, 3D ``position_ids``). Raises
        whatever the forward raises; the caller fails or retries the step's requests."""
        kwargs = {_compat.cache_kwarg(self.model): cache, **(inputs or {})}
        position_ids = kwargs.pop("position_ids", plan.position_ids)
        kept = scoring.kept_logits(plan)  # a request scoring its prompt: the logits of those positions too
        if kept is not None:
            kwargs["logits_to_keep"] = kept.index.to(self.device)
        elif plan.logits_index.numel() == 0:
            kwargs["logits_to_keep"] = 1  # a step of mid-prompt chunks only: nothing is sampled
        else:
            kwargs["logits_to_keep"] = plan.logits_index.to(self.device)
        hidden = final_hidden_states(self.model) if self.keep_hidden else contextlib.nullcontext([])
        with cache.pages.in_use(), _compat.package_forward(), decode_threads(self.model, plan.input_ids.numel()), \
                hidden as captured:
            out = self.model(
                input_ids=plan.input_ids.to(self.device),
                position_ids=position_ids.to(self.device),
                attention_mask=_NoMasks() if cache.spec.attention else None,  # Mamba's mixers read it as is
                use_cache=True,
                **kwargs,
            )
        self.hidden = captured[0][0] if captured else None
        logits = out.logits[0].float()
        if kept is not None:
            scoring.score_segments(kept, logits, plan.groups[0].page_size)
            logits = logits.index_select(0, kept.sample_rows.to(logits.device))
        if not plan.sampled:
            return [], None
        return self._sample(logits, plan)

    def _sample(self, logits: torch.Tensor, plan: StepPlan) -> tuple[list[Pick], list[list[float]] | None]:
        """Picks for logits ``[M, V]`` float32 of the sampled positions (scored from the raw logits when asked)."""
        segments = plan.sampled
        rows = [(s, i) for s in segments for i in range(s.num_logits)]  # each row's segment and draft position
        raw = scoring.log_softmax_sampled(plan, logits)
        requests = [segment.request for segment in segments]
        logits = grammar.mask_logits(logits, grammar.grammar_rows(segments))  # a matcher that raises: its rows alone
        if self.floor is not None:
            logits = self.floor.apply(logits, [s.request for s, _ in rows], [i for _, i in rows])
        probs = None
        if self._argmax_rows(plan):
            picks = self._greedy(logits, segments)
        else:
            if self.processors.do_processing:
                last = torch.tensor([s.tokens[len(s.tokens) - s.num_logits + i] for s, i in rows], device=logits.device)
                args = processor_args(self.processors, [s.request.sampling for s, _ in rows]).to(logits.device)
                logits = self.processors(last, logits, args)
            if self.do_sample or self.return_logprobs:
                probs = torch.softmax(logits, dim=-1)
            picks = self._draw(probs, segments) if self.do_sample else self._greedy(logits, segments)
        if raw is not None:
            scoring.score_sampled(plan, raw, picks)
        logprobs = None
        if self.return_logprobs:  # of each emitted token, at its own position
            index = [(first + j, token) for first, (tokens, _) in zip(_firsts(segments), picks)
                     for j, token in enumerate(tokens)]
            values = iter(probs[[i for i, _ in index], [t for _, t in index]].log().tolist())
            logprobs = [[next(values) for _ in tokens] for tokens, _ in picks]
        grammar.advance(requests, [tokens for tokens, _ in picks])  # last: a step that raised took no token
        return picks, logprobs

    @staticmethod
    def _greedy(logits: torch.Tensor, segments: list[Segment]) -> list[Pick]:
        choices = logits.argmax(dim=-1).tolist()
        return [([choices[first]], 0) if not s.draft else
                verify.accept_greedy(choices[first : first + s.num_logits], s.draft, _limit(s), s.request.eos_token_ids)
                for first, s in zip(_firsts(segments), segments)]

    def _argmax_rows(self, plan: StepPlan) -> bool:
        """Whether every sampled row is a top-k 1 request of a sampling manager (the server's greedy requests) whose
        processors are only transformers' temperature, top-k and top-p warpers, and no processed log-probabilities
        are asked: then the processed distribution keeps only the argmax of the logits (temperature > 0 keeps the
        order), so the step takes ``argmax`` without the warpers' sort over the vocabulary, the softmax and the draw
        (a fifth of a 65,536-token model's decode step on a CPU). A draw among exactly tied maxima becomes the first
        of them."""
        return (self.do_sample and not self.return_logprobs and self._warpers_only
                and all(s.request.sampling.get("top_k") == 1 and s.request.sampling.get("temperature", 1.0) > 0
                        for s in plan.sampled))

    def _draw(self, probs: torch.Tensor, segments: list[Segment]) -> list[Pick]:
        """Picks for ``probs`` ``[M, V]`` (the rows of ``segments``): a seeded request draws from its own generator,
        the others from the shared one, which only they draw from (so the shared stream does not depend on seeded
        requests beside them); a segment with drafts verifies them by rejection sampling, after the others' draws."""
        firsts = _firsts(segments)
        plain = [j for j, s in enumerate(segments) if not s.draft]
        picks: list[Pick | None] = [None] * len(segments)
        shared = [j for j in plain if segments[j].request.seed is None]
        if shared:
            rows = torch.tensor([firsts[j] for j in shared], device=probs.device)
            drawn = torch.multinomial(probs.index_select(0, rows), num_samples=1, generator=self.generator)[:, 0]
            for j, token in zip(shared, drawn.tolist()):
                picks[j] = ([token], 0)
        for j, segment in enumerate(segments):
            request = segment.request
            if request.seed is not None and request.generator is None:
                request.generator = torch.Generator(device=probs.device).manual_seed(request.seed)
            generator = self.generator if request.seed is None else request.generator
            if segment.draft:
                picks[j] = verify.accept_sampled(probs[firsts[j] : firsts[j] + segment.num_logits], segment.draft,
                                                 _limit(segment), request.eos_token_ids, generator,
                                                 drafted_probs(segment))
            elif request.seed is not None:
                picks[j] = ([int(torch.multinomial(probs[firsts[j]], num_samples=1, generator=generator)[0])], 0)
        return picks


def _firsts(segments: list[Segment]) -> list[int]:
    """The first row of each sampled segment among the sampled rows."""
    firsts, row = [], 0
    for segment in segments:
        firsts.append(row)
        row += segment.num_logits
    return firsts


def _limit(segment: Segment) -> int:
    """New tokens the segment's request may still emit."""
    return segment.request.max_new_tokens - len(segment.request.generated)
