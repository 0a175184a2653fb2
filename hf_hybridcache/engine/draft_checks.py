"""What a drafter's ``propose`` may return for one request, checked before the engine verifies it.

A draft the engine cannot verify fails its own request with a sentence naming the drafter and what is wrong; the
engine and the other requests go on (:meth:`~hf_hybridcache.engine.speculative.Speculator.draft`). A draft
distribution is checked too: rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding") keeps the target's distribution only when each draft token was drawn from the ``probs`` row
given for it, so a row that is not a distribution over the vocabulary, or that gives its own token probability 0,
would bias the output without any error.
"""

from __future__ import annotations

import torch

from .drafters import Draft

#: How far a draft distribution's row may sum from 1 (float32 softmax rows are within 1e-6; warped and renormalized
#: rows within a few ulps more).
ROW_SUM_TOLERANCE = 1e-3


class DraftError(ValueError):
    """A drafter's draft for one request that cannot be verified; the message says why and what to fix."""


def draft_parts(draft, num_tokens: int, vocab_size: int, probs_width: int, device: torch.device, name: str
                ) -> tuple[tuple[int, ...], torch.Tensor | None]:
    """The draft tokens (at most ``num_tokens``, as ints) and their distributions (``[len(tokens), probs_width]``
    float32 rows, or None for a point mass) of ``draft``: a :class:`~hf_hybridcache.engine.Draft`, a sequence of
    token ids, or None (no draft).

    Raises:
        DraftError: ``draft`` is none of those; a token is not an int in ``[0, vocab_size)``; ``probs`` is not a
            floating tensor of shape ``[len(draft.tokens), probs_width]`` on ``device``, or a row kept is not a
            distribution (a negative or non-finite entry, a sum away from 1) or gives its own token probability 0.
    """
    if draft is None:
        return (), None
    tokens, probs = (draft.tokens, draft.probs) if isinstance(draft, Draft) else (draft, None)
    try:
        if isinstance(tokens, (str, bytes, dict)):
            raise TypeError
        tokens = tuple(tokens)
    except TypeError:
        raise DraftError(f"The drafter {name} proposed {_shown(draft)} for a request: propose() returns, per request, "
                         "a list of token ids, a Draft, or None for no draft; fix the drafter's propose().") from None
    bad = next((t for t in tokens if not is_token_id(t, vocab_size)), None)
    if bad is not None:
        raise DraftError(f"The drafter {name} proposed {_shown(bad)}, which is not a token id of the model's "
                         f"vocabulary (an int in [0, {vocab_size})); fix the drafter's propose().")
    kept = tuple(int(t) for t in tokens[:num_tokens])
    if probs is None or not kept:
        return kept, None
    _check_probs(probs, len(tokens), kept, probs_width, device, name)
    return kept, probs[: len(kept)]


def _check_probs(probs, num_tokens: int, kept: tuple[int, ...], width: int, device: torch.device, name: str) -> None:
    where = f"The drafter {name}'s Draft.probs"
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
        raise DraftError(f"{where} is {_shown(probs)}; it must be a float32 tensor [len(tokens), V] of the "
                         "distributions the tokens were drawn from, or None for tokens proposed with certainty.")
    if tuple(probs.shape) != (num_tokens, width) or probs.device != device:
        raise DraftError(f"{where} has shape {list(probs.shape)} on {probs.device}; it must be [{num_tokens}, {width}] "
                         f"(a row per draft token over the model's {width} logits) on {device}.")
    rows = probs[: len(kept)].float()
    sums = rows.sum(-1)
    if not bool(torch.isfinite(rows).all()) or bool((rows < 0).any()) or bool(
            ((sums - 1).abs() > ROW_SUM_TOLERANCE).any()):
        raise DraftError(f"{where} holds a row that is not a probability distribution (row sums "
                         f"{[round(float(s), 4) for s in sums]}); each row must be finite, non-negative and sum to 1.")
    chosen = rows.gather(1, torch.tensor(kept, device=rows.device)[:, None])[:, 0]
    if bool((chosen <= 0).any()):
        position = int((chosen <= 0).nonzero()[0])
        raise DraftError(f"{where} gives draft token {position} ({kept[position]}) probability 0, so it cannot have "
                         "been drawn from that row; give the row each token was sampled from.")


def is_token_id(token, vocab_size: int) -> bool:
    """Whether ``token`` (a Python or NumPy int, or a 0-d integer tensor) is an id in ``[0, vocab_size)``."""
    if isinstance(token, torch.Tensor):
        if token.ndim != 0 or token.is_floating_point() or token.is_complex() or token.dtype == torch.bool:
            return False
        token = token.item()
    if isinstance(token, bool) or not hasattr(token, "__index__"):
        return False
    return 0 <= token.__index__() < vocab_size


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
