"""ZAYA's convolutional q|k mixing and its router's GELU in a form whose bits do not depend on how a token arrives
(issue 46, ingredients of deterministic mode; :mod:`hf_hybridcache.models.zaya_deterministic` runs them).

- ZAYA's CCA projection (``ZayaCCAProjection``, ``transformers/models/zaya/modeling_zaya.py``, 5.23 - 5.25; the
  compressed convolutional attention of arXiv 2510.04476) mixes its concatenated q|k projections ``[B, C, T]`` over
  time with a depthwise conv (width ``K0 = cca_time0``, bias) and then a grouped conv (width ``K1 = cca_time1``, bias,
  one group per attention head and per key head, ``C / G`` channels each). Upstream runs ``F.conv1d`` twice over the
  cached window and the call's inputs, whose reduction (the grouped conv's sum over a group's channels and taps) takes
  another order with the number of tokens in the call, so a token's q and k moved between a prefill, a chunk and a
  decode step. :func:`cca_conv_invariant` runs the depthwise conv as
  :func:`~hf_hybridcache.kernels.conv_invariant.causal_conv_invariant` (``K0`` float32 products left to right, plus
  the bias, rounded to the input dtype as upstream's conv output is) and the grouped conv as
  :func:`grouped_conv_invariant`: each output channel ``bias + sum_i sum_k w[o, i, k] * d[g(o), i, t + k]`` over its
  group's input channels ``i`` (outer) and taps ``k`` (inner), one elementwise float32 multiply and add per term,
  so each term and each partial sum is an IEEE operation on one element whose result does not depend on the
  element's place in the tensor or on the call's length.
- ZAYA's router MLP activation (``nn.GELU()``, the erf form): ``F.gelu`` runs a vectorized erf in its loop's body
  and ``std::erf`` in its scalar tail, which gave a float32 element other bits alone (a one-token decode of a router
  width off the vector width) than inside a longer tensor (measured here: 37 of 92 single elements differed).
  :func:`gelu_invariant` is ``0.5 * x * (1 + erf(x / sqrt(2)))`` in float32 with ``torch.erf``, whose body and tail
  agreed on 4096 single elements here (``tests/test_zaya_invariant.py`` probes it), rounded once by the caller.
  That agreement is the CPU's and torch's, so :func:`gelu_invariance_failures` measures it where the mode is built
  (deterministic mode refuses ZAYA where it fails).

Shapes: B rows, C channels (``(H + Hkv) * D``), G groups, T new tokens, W = ``(K0 - 1) + (K1 - 1)`` cached inputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .conv_invariant import causal_conv_invariant


def grouped_conv_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           groups: int) -> torch.Tensor:
    """A valid (unpadded) grouped conv1d of ``x`` with the terms added in a fixed order (module docstring).

    Args:
        x: ``[B, C, L]``, any float dtype.
        weight: ``[C, C / groups, K]`` (``nn.Conv1d``'s); bias: ``[C]`` or None.
        groups: G; ``C`` a multiple of it.

    Returns:
        ``[B, C, L - K + 1]`` float32: ``F.conv1d(x, weight, bias, groups=groups)`` within float32 round-off.

    Raises:
        ValueError: ``C`` is not a multiple of ``groups`` or the weight does not match, or ``L < K``.
    """
    batch, channels, length = x.shape
    per_group, width = weight.shape[1], weight.shape[2]
    if channels % groups or weight.shape[0] != channels or per_group * groups != channels:
        raise ValueError(f"grouped_conv_invariant needs a weight [C, C / groups, K] for C={channels} and "
                         f"groups={groups}; got {tuple(weight.shape)}.")
    if length < width:
        raise ValueError(f"grouped_conv_invariant needs at least K={width} inputs; got {length}.")
    out_len = length - width + 1
    x = x.float().view(batch, groups, 1, per_group, length)  # [B, G, 1, Cg_in, L]
    w = weight.float().view(groups, per_group, per_group, width)  # [G, Cg_out, Cg_in, K]
    out = None
    for i in range(per_group):
        for k in range(width):
            term = x[:, :, :, i, k:k + out_len] * w[None, :, :, i, k, None]  # [B, G, Cg_out, T']
            out = term if out is None else out + term
    out = out.reshape(batch, channels, out_len)
    return out if bias is None else out + bias.float()[:, None]


def cca_conv_invariant(x: torch.Tensor, conv_state: torch.Tensor | None, depthwise_weight: torch.Tensor,
                       depthwise_bias: torch.Tensor | None, grouped_weight: torch.Tensor,
                       grouped_bias: torch.Tensor | None, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ZAYA's depthwise-then-grouped causal conv of the new q|k inputs ``x`` continued from ``conv_state``.

    Args:
        x: new conv inputs ``[B, C, T]``, any float dtype.
        conv_state: the last ``W`` raw inputs before ``x`` ``[B, C, W]``, or None (zeros, as upstream pads a fresh
            prompt); read, not written.
        depthwise_weight: ``[C, 1, K0]``; grouped_weight: ``[C, C / groups, K1]``; biases ``[C]`` or None.

    Returns:
        ``(y [B, C, T] in x's dtype, the window after x [B, C, W] in conv_state's dtype, x's without one)``: ``y`` is
        upstream's ``conv_qk_grouped(conv_qk_depthwise(window + x))`` within round-off, the depthwise output rounded
        to ``x``'s dtype in between as upstream's is.

    Raises:
        ValueError: a state whose width is not ``W`` (or the weights' shapes, from :func:`grouped_conv_invariant`).
    """
    k0, k1 = depthwise_weight.shape[-1], grouped_weight.shape[-1]
    width = (k0 - 1) + (k1 - 1)
    if conv_state is None:
        conv_state = x.new_zeros(*x.shape[:-1], width)
    if conv_state.shape[-1] != width:
        raise ValueError(f"The conv state holds {conv_state.shape[-1]} inputs; the CCA conv reads {width}.")
    inputs = torch.cat([conv_state.to(x.dtype), x], dim=-1)  # [B, C, W + T]
    # The depthwise outputs the grouped conv reads: the last K1 - 1 + T, each from the K0 inputs ending at it.
    before = F.pad(inputs[..., :k0 - 1], (1, 0))  # causal_conv_invariant reads the last K0 - 1 of its state
    mixed, _ = causal_conv_invariant(inputs[..., k0 - 1:], depthwise_weight.squeeze(1), depthwise_bias, None, before)
    out = grouped_conv_invariant(mixed, grouped_weight, grouped_bias, groups)
    window = inputs[..., inputs.shape[-1] - width:]
    return out.to(x.dtype), window.to(conv_state.dtype).contiguous()


def gelu_invariant(x: torch.Tensor) -> torch.Tensor:
    """``gelu(x) = 0.5 * x * (1 + erf(x / sqrt(2)))`` (the erf form) elementwise in ``x``'s dtype (pass float32)."""
    return 0.5 * x * (1 + torch.erf(x * (1 / math.sqrt(2))))


def gelu_invariance_failures(count: int = 64, seed: int = 0) -> int:
    """How many of ``count`` float32 elements (``randn * 3``, seeded) :func:`gelu_invariant` gives other bits alone
    (a one-element call: the elementwise loop's scalar path) than inside the whole tensor (its vectorized body); 0
    where ``torch.erf``'s two paths agree, as measured here."""
    x = torch.randn(count, generator=torch.Generator().manual_seed(seed)) * 3
    whole = gelu_invariant(x)
    return sum(not torch.equal(gelu_invariant(x[i:i + 1]), whole[i:i + 1]) for i in range(count))
