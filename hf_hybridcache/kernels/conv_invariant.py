"""The recurrent mixers' depthwise causal conv with one arithmetic for a token, however it arrives (issue 46, an
ingredient of deterministic mode; not used by any forward yet).

Every Mamba-1 / Mamba-2 mixer (and the short-conv and linear-attention ones) runs its input through a depthwise causal
conv of width ``W`` (``d_conv``, 4 in most configs). A prefill runs it as ``F.conv1d`` over the prompt, a decode step
as the product of the cached window with the weight (:func:`~hf_hybridcache.kernels.state_update.causal_conv1d_update`,
in the weight's dtype), so the same token's output differs: by 3.1e-2 in bf16 and 9.5e-7 in float32 on this CPU
(``benchmarks/batch_invariance.py``, table 4), and the activation (``F.silu``) gives an element other bits in a
vectorized loop's scalar tail than in its body, so its result moves with the tensor's length.

:func:`causal_conv_invariant` is one function for both: it takes the cached window and any number of new inputs,
and each output is ``W`` float32 products added left to right, plus the bias, through
:func:`~hf_hybridcache.kernels.mamba1_invariant.silu_invariant`, rounded once to the input dtype. Each of those is
an elementwise operation, whose IEEE result does not depend on the element's place in the tensor, so a token's output
is the same bits in a prefill (at any offset, in any split) as in a one-token decode call, whatever rows share it.

Inkling 2's dynamic short conv (``Inkling2DynamicShortConvolution``) adds per-token taps to its static ones: token
t's tap ``k`` (``k`` steps back) on channel ``c`` of head ``h`` is ``static[k, c] + dynamic[t, h, k]``, the dynamic
taps a projection of the layer input (a row-invariant linear in deterministic mode). :func:`dynamic_conv_invariant`
forms each tap elementwise and adds the ``W`` products in the fixed order ``k = 0 .. W-1`` in float32, over the same
window of raw inputs, so a token's output is again the same bits in a prefill, a chunk or a decode step (upstream
reduces ``windows * weights`` over the taps with ``sum(-1)``).

Shapes: B rows, C channels, T new tokens, W conv width, H heads (the dynamic taps are shared by a head's channels).
"""

from __future__ import annotations

import torch

from .mamba1_invariant import silu_invariant

#: Activations :func:`causal_conv_invariant` takes (transformers' names).
ACTIVATIONS = (None, "silu", "swish")


def causal_conv_invariant(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    conv_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of ``x`` continued from ``conv_state`` (the last ``W`` raw inputs before ``x``, of which
    the conv reads the last ``W - 1``; zeros, as a fresh prefill pads, when None):
    ``y_t = act(bias + sum_k weight[:, k] * window_t[k])`` over token t's window of ``W`` inputs ending at t, the terms
    added in order ``k = 0 .. W-1`` in float32. A decode step is the call with ``T = 1``.

    Args:
        x: new conv inputs ``[B, C, T]``, any float dtype.
        weight: ``[C, W]`` (the conv1d weight ``[C, 1, W]`` squeezed); bias: ``[C]`` or None.
        activation: ``"silu"`` / ``"swish"`` or None.
        conv_state: ``[B, C, W]`` or None; read, not written.

    Returns:
        ``(y [B, C, T] in x's dtype, the new conv state [B, C, W] in conv_state's dtype, x's without one)``: the last
        ``W`` raw inputs after ``x``, what ``causal_conv1d_update`` leaves in the cache.

    Raises:
        ValueError: another activation, or a weight / state whose width does not match.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv_invariant takes the activations {ACTIVATIONS}; got {activation!r}.")
    width = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(*x.shape[:-1], width)
    if conv_state.shape[-1] != width:
        raise ValueError(f"The conv state holds {conv_state.shape[-1]} inputs; the weight is {width} wide.")
    inputs = torch.cat([conv_state.to(x.dtype), x], dim=-1)  # token t's window: inputs[t + 1 : t + 1 + W]
    seq_len = x.shape[-1]
    w = weight.float()
    out = inputs[..., 1 : 1 + seq_len].float() * w[:, 0:1]
    for k in range(1, width):
        out = out + inputs[..., 1 + k : 1 + k + seq_len].float() * w[:, k : k + 1]
    if bias is not None:
        out = out + bias.float()[:, None]
    if activation is not None:
        out = silu_invariant(out)
    return out.to(x.dtype), inputs[..., -width:].to(conv_state.dtype).contiguous()


def dynamic_conv_invariant(
    x: torch.Tensor,
    static_weight: torch.Tensor,
    dynamic_weight: torch.Tensor,
    conv_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of ``x`` with per-token taps, continued from ``conv_state`` (as
    :func:`causal_conv_invariant`'s): ``y_t[c] = sum_k (static[k, c] + dynamic[t, h(c), k]) * x_{t-k}[c]``, the taps
    formed and the terms added in order ``k = 0 .. W-1`` in float32 (``k``: the backward distance, ``h(c)``: the head
    of ``C // H`` consecutive channels holding ``c``). No bias or activation (Inkling 2's has none).

    Args:
        x: new conv inputs ``[B, C, T]``, any float dtype.
        static_weight: ``[W, C]`` (``static_weight[0]`` weights the current token).
        dynamic_weight: ``[B, T, H, W]`` per-token taps of each head (float32 in Inkling 2).
        conv_state: ``[B, C, W]`` or None (zeros); read, not written.

    Returns:
        ``(y [B, C, T] float32, the new conv state [B, C, W])``: the last ``W`` raw inputs after ``x``.

    Raises:
        ValueError: a state whose width does not match, or channels not a multiple of the heads.
    """
    width, channels = static_weight.shape
    batch, seq_len, heads = dynamic_weight.shape[:3]
    if channels % heads:
        raise ValueError(f"dynamic_conv_invariant needs the channels ({channels}) to be a multiple of the heads "
                         f"({heads}).")
    if conv_state is None:
        conv_state = x.new_zeros(*x.shape[:-1], width)
    if conv_state.shape[-1] != width:
        raise ValueError(f"The conv state holds {conv_state.shape[-1]} inputs; the weight is {width} wide.")
    inputs = torch.cat([conv_state.to(x.dtype), x], dim=-1)  # token t's input: inputs[..., width + t]
    static = static_weight.float()
    per_channel = dynamic_weight.float().permute(0, 2, 3, 1)[:, :, None]  # [B, H, 1, W, T]
    per_channel = per_channel.expand(batch, heads, channels // heads, width, seq_len).reshape(batch, channels, width,
                                                                                              seq_len)
    out = None
    for k in range(width):
        tap = static[k][None, :, None] + per_channel[:, :, k]  # [B, C, T]
        term = inputs[..., width - k : width - k + seq_len].float() * tap
        out = term if out is None else out + term
    return out, inputs[..., -width:].to(conv_state.dtype).contiguous()
