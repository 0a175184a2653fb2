"""Inkling 2's elementwise and per-head ops in a form whose bits do not depend on a token's place in the call (issue
46, ingredients of deterministic mode; Inkling 2 and Inkling 2 Loop run them: ``models/inkling2_deterministic.py``).

- A softcap ``cap * tanh(x / cap)`` (Inkling 2's experts bound their SwiGLU's linear gate factor and ``up`` with one)
  as ``cap * (1 - 2 / (exp(2 x / cap) + 1))``: IEEE operations and ``exp``, whose vectorized body and scalar tail agree
  here (``benchmarks/batch_invariance.py``, table 2), so an element's bits do not move with its offset in the tensor
  (``torch.tanh`` and ``torch.sigmoid`` are vectorized functions of their own, not measured here).
- The softcapped SwiGLU (``Inkling2SoftcappedSwiGLU``): ``softcap(gate) * sigmoid(gate) * softcap(up)`` in float32,
  the sigmoid as :func:`~hf_hybridcache.kernels.gated_delta_invariant.sigmoid_invariant`, rounded once to the input
  dtype.
- The l2 clip (``Inkling2L2Clip``, on the keys and, after a learned scale, the queries and relative states): each head
  vector scaled down to a norm of ``threshold``, its norm ``sqrt(sum x^2)`` over the contiguous last dim of fixed length
  (a reduction whose order depends on that length only, not on how many vectors are reduced).
- The block attention residual (``Inkling2BlockAttentionResidual``): at each position, learned queries attend over
  the RMS-normed states of the earlier blocks and the current one (upstream: SDPA with the positions as heads, whose
  kernel and split depend on the call's shape). Here each score is a sum over the contiguous hidden dim and the
  softmax and weighted sum run over the ``L`` stacked states, a last dim whose length is the layer's, not the call's.
"""

from __future__ import annotations

import torch

from .gated_delta_invariant import sigmoid_invariant


def softcap_invariant(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` from ``exp`` (module docstring), in ``x``'s dtype and shape."""
    return cap * (1 - 2 / (torch.exp(2 * (x / cap)) + 1))


def softcapped_swiglu_invariant(gate: torch.Tensor, up: torch.Tensor, gate_cap: float, up_cap: float) -> torch.Tensor:
    """``softcap(gate) * sigmoid(gate) * softcap(up)`` in float32, rounded once to ``gate``'s dtype."""
    dtype = gate.dtype
    gate, up = gate.float(), up.float()
    return (softcap_invariant(gate, gate_cap) * sigmoid_invariant(gate) * softcap_invariant(up, up_cap)).to(dtype)


def l2_clip_invariant(x: torch.Tensor, threshold: float, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Each vector along the last dim of ``x`` (after ``* scale`` in float32, where given) scaled by
    ``min(1, threshold / (norm + 1e-6))`` in float32, rounded once to ``x``'s dtype (``Inkling2L2Clip`` /
    ``Inkling2ScaledL2Clip``)."""
    dtype = x.dtype
    x = x.float() if scale is None else x.float() * scale.float()
    norm = (x * x).sum(-1, keepdim=True).sqrt()
    return (x * (threshold / (norm + 1e-6)).clamp(max=1.0)).to(dtype)


def block_residual_invariant(query: torch.Tensor, stacked: torch.Tensor, scaling: float) -> torch.Tensor:
    """``softmax(scaling * q s^T) s`` at each position, in float32: ``query`` ``[Q, N]`` or ``[N]`` (the learned
    queries), ``stacked`` ``[B, T, L, N]`` (the normed block states; ``L`` fixed per layer); returns float32
    ``[B, T, Q, N]``."""
    hidden = stacked.shape[-1]
    q = (query.float().view(-1, hidden) * scaling)[None, None, :, None, :]  # [1, 1, Q, 1, N]
    states = stacked.float()
    scores = (q * states[:, :, None]).sum(-1)  # [B, T, Q, L]
    probs = torch.exp(scores - scores.amax(-1, keepdim=True))
    weighted = (probs[..., None, :] * states.transpose(-1, -2)[:, :, None]).sum(-1)  # [B, T, Q, N]
    return weighted / probs.sum(-1)[..., None]
