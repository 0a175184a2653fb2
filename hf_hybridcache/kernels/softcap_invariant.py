"""Inkling 2's elementwise and per-head ops in a form whose bits do not depend on a token's place in the call (issue
46, ingredients of deterministic mode; no family's forward uses them yet: Inkling 2 is refused).

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
