"""One engine step: the packed forward of a :class:`~hf_hybridcache.engine.plan.StepPlan`, then sampling.

The model's own forward runs on ``input_ids`` / ``position_ids`` ``[1, N]`` with the
:class:`~hf_hybridcache.engine.views.StepCache` as its cache, a mask mapping that builds no masks (the groups carry
their own), and ``logits_to_keep`` = the sampled positions, so only ``[M, V]`` logits are computed. Sampling is
transformers' continuous batching's after the grammar masks of requests that follow one
(:mod:`~hf_hybridcache.engine.grammar`): the end-of-sequence floor of ``min_new_tokens`` / ``min_length``
(:class:`~hf_hybridcache.engine.generation_fields.EosFloor`), its logits processors (per-request temperature, top-k,
top-p), then argmax or ``multinomial`` from one generator (seeded by ``ContinuousBatchingConfig.seed``), or from a
request's own generator when it was added with a ``seed``.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..models.decode_linear import decode_threads
from .._compat.continuous_batching import processor_args, warpers_only
from . import grammar, scoring
from .generation_fields import EosFloor
from .plan import StepPlan
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
    """

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
    def run(self, plan: StepPlan, cache: StepCache, inputs: dict | None = None) -> tuple[list[int], list[float] | None]:
        """The tokens sampled for ``plan.sampled`` (and their log-probabilities when asked); ``inputs``: the forward's
        image inputs (:func:`~hf_hybridcache.engine.images.forward_inputs`: ``mm_encoder_outputs``, 3D
        ``position_ids``). Raises whatever the forward raises; the caller fails or retries the step's requests."""
        kwargs = {_compat.cache_kwarg(self.model): cache, **(inputs or {})}
        position_ids = kwargs.pop("position_ids", plan.position_ids)
        kept = scoring.kept_logits(plan)  # a request scoring its prompt: the logits of those positions too
        if kept is not None:
            kwargs["logits_to_keep"] = kept.index.to(self.device)
        elif plan.logits_index.numel() == 0:
            kwargs["logits_to_keep"] = 1  # a step of mid-prompt chunks only: nothing is sampled
        else:
            kwargs["logits_to_keep"] = plan.logits_index.to(self.device)
        with cache.pages.in_use(), _compat.package_forward(), decode_threads(self.model, plan.input_ids.numel()):
            out = self.model(
                input_ids=plan.input_ids.to(self.device),
                position_ids=position_ids.to(self.device),
                attention_mask=_NoMasks() if cache.spec.attention else None,  # Mamba's mixers read it as is
                use_cache=True,
                **kwargs,
            )
        logits = out.logits[0].float()
        if kept is not None:
            scoring.score_segments(kept, logits, plan.groups[0].page_size)
            logits = logits.index_select(0, kept.sample_rows.to(logits.device))
        if not plan.sampled:
            return [], None
        return self._sample(logits, plan)

    def _sample(self, logits: torch.Tensor, plan: StepPlan) -> tuple[list[int], list[float] | None]:
        """Tokens for logits ``[M, V]`` float32 of the sampled segments (scored from the raw logits when asked)."""
        raw = scoring.log_softmax_sampled(plan, logits)
        requests = [segment.request for segment in plan.sampled]
        logits = grammar.mask_logits(logits, grammar.grammar_rows(requests))  # a matcher that raises: its row alone
        if self.floor is not None:
            logits = self.floor.apply(logits, [segment.request for segment in plan.sampled])
        if self._argmax_rows(plan):
            tokens = logits.argmax(dim=-1)
            if raw is not None:
                scoring.score_sampled(plan, raw, tokens)
            tokens = tokens.tolist()
            grammar.advance(requests, tokens)
            return tokens, None
        if self.processors.do_processing:
            last = torch.tensor([s.tokens[-1] for s in plan.sampled], device=logits.device)
            args = processor_args(self.processors, [s.request.sampling for s in plan.sampled]).to(logits.device)
            logits = self.processors(last, logits, args)
        if self.do_sample or self.return_logprobs:
            probs = torch.softmax(logits, dim=-1)
        if self.do_sample:
            tokens = self._draw(probs, [segment.request for segment in plan.sampled])
        else:
            tokens = logits.argmax(dim=-1)
        if raw is not None:
            scoring.score_sampled(plan, raw, tokens)
        logprobs = None
        if self.return_logprobs:
            logprobs = probs.gather(1, tokens[:, None])[:, 0].log().tolist()
        tokens = tokens.tolist()
        grammar.advance(requests, tokens)  # last: a step that raised (a processor, the draw) took no token
        return tokens, logprobs

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

    def _draw(self, probs: torch.Tensor, requests: list) -> torch.Tensor:
        """One token per row of ``probs`` ``[M, V]``: a seeded request's from its own generator, the others' from the
        shared one, which only they draw from (so the shared stream does not depend on seeded requests beside them)."""
        seeded = [row for row, request in enumerate(requests) if request.seed is not None]
        if not seeded:
            return torch.multinomial(probs, num_samples=1, generator=self.generator)[:, 0]
        tokens = torch.empty(len(requests), dtype=torch.int64, device=probs.device)
        shared = [row for row, request in enumerate(requests) if request.seed is None]
        if shared:
            rows = torch.tensor(shared, device=probs.device)
            tokens[rows] = torch.multinomial(probs[rows], num_samples=1, generator=self.generator)[:, 0]
        for row in seeded:
            request = requests[row]
            if request.generator is None:
                request.generator = torch.Generator(device=probs.device).manual_seed(request.seed)
            tokens[row] = torch.multinomial(probs[row], num_samples=1, generator=request.generator)[0]
        return tokens
