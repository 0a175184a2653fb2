"""Which draft tokens a speculative step keeps, from the target model's distributions at the verified positions.

A request that verifies ``k`` draft tokens ``d_1 .. d_k`` gets ``k + 1`` rows of (processed) logits or probabilities:
row ``i`` is the target's next-token distribution ``p_i`` after its tokens and ``d_1 .. d_i``. It emits between 1 and
``k + 1`` tokens:

- greedy (:func:`accept_greedy`): ``t_i = argmax p_i``; the drafts are kept while ``d_{i+1} == t_i``, and the first
  ``t_i`` that differs is emitted in its place (or ``t_k``, the bonus token, when all were kept). The tokens are plain
  greedy decoding's.
- sampled (:func:`accept_sampled`): speculative sampling (Leviathan et al. 2023, "Fast inference from transformers via
  speculative decoding"; Chen et al. 2023, "Accelerating large language model decoding with speculative sampling"):
  ``d_{i+1}`` is kept with probability ``min(1, p_i(d) / q_i(d))`` (``q_i`` the draft's distribution; a point mass at
  ``d`` for a drafter that proposes tokens without one, which makes it ``p_i(d)``); the first one rejected is
  replaced by a draw from ``max(0, p_i - q_i)`` normalized, and when all are kept a bonus token is drawn from
  ``p_k``. Each emitted token is then distributed as ``p`` alone would draw it.

Either way the tokens stop early at an end-of-sequence token or at the request's ``limit`` of new tokens, so what
follows them is neither emitted nor kept. Shapes: ``probs`` ``[k + 1, V]`` float32, ``draft_probs`` ``[k, V]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: The tokens a request emits from one step, and how many of them are its draft tokens (a prefix of them).
Pick = tuple[list[int], int]


def _ends(token: int, emitted: list[int], limit: int, eos: frozenset[int]) -> bool:
    return token in eos or len(emitted) >= limit


def accept_greedy(choices: Sequence[int], draft: Sequence[int], limit: int, eos: frozenset[int]) -> Pick:
    """The tokens emitted for argmax ``choices`` (``len(draft) + 1`` of them) of a request with ``draft``, at most
    ``limit`` (>= 1), ending at the first of ``eos``."""
    emitted: list[int] = []
    for i, token in enumerate(choices):
        emitted.append(token)
        if _ends(token, emitted, limit, eos) or i == len(draft) or token != draft[i]:
            return emitted, min(i + (i < len(draft) and token == draft[i]), len(draft))
    raise AssertionError("choices must hold len(draft) + 1 rows")


def accept_sampled(probs: torch.Tensor, draft: Sequence[int], limit: int, eos: frozenset[int],
                   generator: torch.Generator, draft_probs: torch.Tensor | None = None) -> Pick:
    """The tokens emitted by speculative sampling for a request with ``draft`` under the target's ``probs``
    ``[len(draft) + 1, V]`` (and the draft's ``draft_probs`` ``[len(draft), V]``, None for a point mass), drawn from
    ``generator`` (``len(draft)`` uniforms first, whatever is accepted, then one draw from a residual or the bonus
    row), at most ``limit`` (>= 1) tokens, ending at the first of ``eos``."""
    k = len(draft)
    device = probs.device
    emitted: list[int] = []
    if k:
        index = torch.tensor(list(draft), device=device)
        target = probs[:k].gather(1, index[:, None])[:, 0]
        ratio = target if draft_probs is None else (target / draft_probs.gather(1, index[:, None])[:, 0]).clamp(max=1)
        uniforms = torch.rand(k, generator=generator, device=device)
        for i, keep in enumerate((uniforms < ratio).tolist()):
            if not keep:
                residual = probs[i].clone()
                if draft_probs is None:
                    residual[draft[i]] = 0
                else:
                    residual = (residual - draft_probs[i]).clamp(min=0)
                if not bool(residual.sum() > 0):  # p_i == q_i up to rounding: p_i itself
                    residual = probs[i]
                emitted.append(int(torch.multinomial(residual, 1, generator=generator)))
                return emitted, i
            emitted.append(draft[i])
            if _ends(draft[i], emitted, limit, eos):
                return emitted, i + 1
    emitted.append(int(torch.multinomial(probs[k], 1, generator=generator)))
    return emitted, k
