"""Log-probabilities a request asks for: of its prompt tokens (``prompt_logprobs``, what eval harnesses score a prompt
with) and of the tokens it generates (``logprobs``), each with its ``k`` most likely alternatives.

They are the model's own distribution: ``log_softmax`` in float32 of the raw logits, before the end-of-sequence floor,
temperature, top-k and top-p (vLLM's default ``raw_logprobs``; OpenAI's ``logprobs`` are of the model's distribution
too). Token ``t`` of the prompt is scored by the logits at position ``t - 1`` (token 0 has no score), the first
generated token by those of the prompt's last position.

In a step, the forward computes the logits of every position of a segment that scores prompt tokens (besides the
sampled positions of all segments, :func:`kept_logits`); :func:`score_segments` turns them into each segment's
:class:`TokenScore` list, and keeps the whole log-softmax row at the block boundaries where the request stores a
checkpoint, so that a later request restoring that boundary can score the boundary's first token
(:mod:`~hf_hybridcache.engine.score_store`). :func:`score_sampled` scores the sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan import Segment, StepPlan

#: Alternatives kept per prompt token (OpenAI's completions take ``logprobs`` up to 5).
PROMPT_TOP_K = 5
#: Alternatives per generated token at most (OpenAI's chat ``top_logprobs`` is 0-20).
MAX_TOP_K = 20


@dataclass(frozen=True)
class TokenScore:
    """One token's log-probability under the model and the ``k`` most likely tokens at its position, most likely
    first (``top_ids`` and ``top_logprobs`` of equal length)."""

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


def request_error(logprobs, prompt_logprobs) -> str | None:
    """Why these per-request scoring arguments cannot run, as a sentence, or None when they can."""
    for name, value, most in (("logprobs", logprobs, MAX_TOP_K), ("prompt_logprobs", prompt_logprobs, PROMPT_TOP_K)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most):
            return f"{name} must be None or an int in [0, {most}] (alternatives per token), got {value!r}."
    return None


def scored_positions(segment: Segment) -> int:
    """Positions of ``segment`` whose logits score a prompt token: ``past .. min(end, L - 1) - 1`` (the prompt's
    last position scores the first generated token, as a sampled position)."""
    request = segment.request
    if request.score_prompt is None:
        return 0
    return max(0, min(segment.end, len(request.prompt) - 1) - segment.past)


@dataclass
class KeptLogits:
    """The positions a step's forward computes logits for when some segment scores its prompt.

    Attributes:
        index: ``[R]`` int64 pack offsets (``logits_to_keep``), in pack order.
        sample_rows: ``[M]`` int64 rows of ``index`` that are the sampled segments' last positions, in
            ``plan.sampled`` order.
        spans: ``(segment, first row, rows)`` of each segment that scores prompt tokens.
    """

    index: torch.Tensor
    sample_rows: torch.Tensor
    spans: list[tuple[Segment, int, int]]


def kept_logits(plan: StepPlan) -> KeptLogits | None:
    """The logits the step must compute, or None when no segment scores its prompt (then only ``plan.logits_index``)."""
    if not any(scored_positions(s) for s in plan.segments):
        return None
    index, sample_rows, spans, offset = [], [], [], 0
    for segment in plan.segments:  # pack order
        scored = scored_positions(segment)
        if scored:
            spans.append((segment, len(index), scored))
            index.extend(range(offset, offset + scored))
        for position in range(len(segment.tokens) - segment.num_logits, len(segment.tokens)):  # none unless sampled
            sample_rows.append(len(index))
            index.append(offset + position)
        offset += len(segment.tokens)
    return KeptLogits(torch.tensor(index, dtype=torch.int64), torch.tensor(sample_rows, dtype=torch.int64), spans)


def score_segments(kept: KeptLogits, logits: torch.Tensor, block_size: int) -> None:
    """Set ``segment.scores`` (:class:`TokenScore` of tokens ``past + 1 ..``, top :data:`PROMPT_TOP_K`) and
    ``segment.boundary_rows`` for every span of ``kept``, from ``logits`` ``[R, V]`` float32 (the rows of
    ``kept.index``)."""
    rows = torch.cat([torch.arange(first, first + n) for _, first, n in kept.spans]).to(logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, rows), dim=-1)
    targets = torch.tensor([t for segment, _, n in kept.spans
                            for t in segment.request.prompt[segment.past + 1 : segment.past + 1 + n]],
                           device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    top = logprobs.topk(min(PROMPT_TOP_K, logprobs.shape[-1]), dim=-1)
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    at = 0
    for segment, _, n in kept.spans:
        segment.scores = [TokenScore(chosen[i], tuple(top_ids[i]), tuple(top_values[i])) for i in range(at, at + n)]
        for boundary in _row_boundaries(segment, n, block_size):
            segment.boundary_rows[boundary] = logprobs[at + boundary - 1 - segment.past].to("cpu", copy=True)
        at += n


def _row_boundaries(segment: Segment, scored: int, block_size: int) -> list[int]:
    """The block boundaries ``b`` whose log-softmax row (at position ``b - 1``) the segment keeps: those where it
    hands over a checkpoint (its emit positions, and its end when aligned), within its scored positions."""
    ends = {segment.past + t for t in segment.emit_positions}
    if segment.end % block_size == 0:
        ends.add(segment.end)
    return sorted(b for b in ends if b % block_size == 0 and segment.past < b <= segment.past + scored)


def log_softmax_sampled(plan: StepPlan, logits: torch.Tensor) -> torch.Tensor | None:
    """``log_softmax`` of the sampled rows ``logits`` ``[M, V]`` (raw, before any processor) when a sampled request
    scores its generated tokens, else None."""
    if not any(s.request.score_generated is not None for s in plan.sampled):
        return None
    return torch.log_softmax(logits, dim=-1)


def score_sampled(plan: StepPlan, logprobs: torch.Tensor, picks: list) -> None:
    """Set ``segment.sampled_scores`` of each sampled segment whose request scores its generated tokens, from
    ``logprobs`` ``[M, V]`` (:func:`log_softmax_sampled`, a row per sampled position) and the tokens each emitted
    (``picks``: ``(tokens, accepted drafts)`` in ``plan.sampled`` order; token ``j`` is scored at its row ``j``)."""
    rows, tokens, owners, first = [], [], [], 0
    for segment, (emitted, _) in zip(plan.sampled, picks):
        if segment.request.score_generated is not None:
            rows.extend(range(first, first + len(emitted)))
            tokens.extend(emitted)
            owners.extend([segment] * len(emitted))
            segment.sampled_scores = []
        first += segment.num_logits
    k = min(max(s.request.score_generated for s in owners), logprobs.shape[-1])
    picked = logprobs.index_select(0, torch.tensor(rows, device=logprobs.device))
    chosen = picked.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
    top = picked.topk(k, dim=-1) if k else None
    for j, segment in enumerate(owners):
        want = segment.request.score_generated
        ids = tuple(top.indices[j, :want].tolist()) if top is not None else ()
        values = tuple(top.values[j, :want].tolist()) if top is not None else ()
        segment.sampled_scores.append(TokenScore(chosen[j], ids, values))
