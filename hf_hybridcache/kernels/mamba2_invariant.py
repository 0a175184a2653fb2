"""Mamba-2's scan with one arithmetic for a token, however it arrives, and its gated RMSNorm with one arithmetic for
a row, whatever shares its call (issue 46, ingredients of deterministic mode; wired in
:mod:`hf_hybridcache.models.mamba2_deterministic`).

A Mamba-2 prefill runs the chunked SSD scan (:func:`~hf_hybridcache.kernels.mamba2_chunk_scan`; Dao & Gu 2024,
"Transformers are SSMs"), whose float32 sums follow a chunk grid that starts where the call starts, and a decode step
runs the recurrence (:func:`~hf_hybridcache.kernels.state_update.mamba2_state_update`, with ``dt * B * x`` in the
model dtype and the output from a ``bmm``); so the same token's state differs between a prefill and a decode step and
with the offset a prefill starts at (``benchmarks/batch_invariance.py``, table 4: 2.4e-7 to 1.9e-6 in float32 and in
the float32 states of bf16 / fp16 models).

As for Mamba-1 (:mod:`.mamba1_invariant`), a prefill here *is* a sequence of decode steps:
:func:`mamba2_scan_invariant` runs :func:`mamba2_step_invariant` once per token on contiguous token-major slices,
and each step is elementwise float32 arithmetic plus one sum over the ``N`` states (no ``bmm``, whose float32 result
for a row depends on the row count on this CPU; softplus from ``exp`` and ``log1p``). A token's output and state are
then the same bits in a prefill at any offset, a split prompt or a decode step, whatever rows share the call.

Cost: a step per token instead of chunk-sized matrix products, so a long float32 prefill costs far more than the
chunked scan (table 6 of the benchmark); a chunk grid anchored to absolute positions is the faster design to measure
against it (docs/deterministic.md).

The gated RMSNorm after the scan (``Mamba2RMSNormGated``, ``models/mamba2/modeling_mamba2.py``; ``MambaRMSNormGated``
in 5.23) reduces each group of a row alone, but gates with ``F.silu``, whose float32 bits for an element depend on
its offset in a vectorized loop (body or scalar tail) and so on where a thread's share of the tensor ends: measured
1.2e-7 apart for one row alone and inside a batch at a width of 1000 on two threads (none at the toy's 128, nor at
1536 or 4096, whose rows fill whole vectors). :func:`gated_rms_norm_invariant` is upstream's arithmetic with
:func:`~hf_hybridcache.kernels.mamba1_invariant.silu_invariant` for the gate.

Shapes: B rows, T tokens, H heads, P head dim, G groups (divides H), N state size. Mamba's names are kept: ``B`` /
``C`` are the input / output projections and ``D`` the skip weight per head.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .mamba1_invariant import silu_invariant, softplus_invariant
from .scan_steps import check_emit_positions


def mamba2_step_invariant(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """One token of Mamba-2's recurrence, in place on ``state``: ``h = exp(dt A) h + (dt x) B``,
    ``y = sum_n h C + D x``, with ``dt`` = ``dt + dt_bias`` through softplus, clamped to ``dt_limit``; in an order that
    makes a row's result independent of the other rows and of how the token arrived.

    Args:
        state: ``[B, H, P, N]`` float32, updated in place.
        x: ``[B, H, P]``, any float dtype; dt: ``[B, H]`` (one time step per head, before bias and softplus).
        A: ``[H]`` float32 (negative); B, C: ``[B, G, N]``; D, dt_bias: ``[H]`` or None.
        dt_softplus: pass ``dt + dt_bias`` through softplus; dt_limit: clamp range of the resulting ``dt``.

    Returns:
        ``y`` ``[B, H, P]`` in ``x``'s dtype.

    Raises:
        ValueError: ``state`` is not float32.
    """
    if state.dtype != torch.float32:
        raise ValueError(f"The SSM state must be float32 for the invariant step; got {state.dtype}.")
    heads_per_group = x.shape[1] // B.shape[1]
    dt = dt.contiguous().float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = softplus_invariant(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    xf = x.contiguous().float()
    B_h = B.contiguous().float().repeat_interleave(heads_per_group, dim=1)  # [B, H, N]
    C_h = C.contiguous().float().repeat_interleave(heads_per_group, dim=1)
    state.mul_(torch.exp(dt * A.float())[..., None, None])
    state.add_((dt[..., None] * xf)[..., None] * B_h[:, :, None, :])
    y = (state * C_h[:, :, None, :]).sum(-1)
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype)


def mamba2_scan_invariant(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_state: torch.Tensor | None = None,
    emit_positions: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Mamba-2 scan as one :func:`mamba2_step_invariant` per token: the arguments of
    :func:`~hf_hybridcache.kernels.mamba2_chunk_scan` without ``chunk_size``, equal to it within float32 round-off
    and the input dtype's rounding of ``y``, and equal bit for bit to running the tokens as steps, one call per token
    or in any split.

    Args:
        x: ``[B, T, H, P]``; dt: ``[B, T, H]``; A: ``[H]`` float32; B, C: ``[B, T, G, N]``; D, dt_bias: ``[H]`` or
            None; dt_softplus, dt_limit: as :func:`mamba2_step_invariant`.
        initial_state: ``[B, H, P, N]`` (any float dtype; float32 is exact) or None for a zero state.
        emit_positions: strictly increasing token counts in ``[1, T]``; the state after each is returned.

    Returns:
        ``(y [B, T, H, P] in x's dtype (the chunked scan's is float32), final state [B, H, P, N] float32,
        [state [B, H, P, N] float32 per emit position])``; the emitted states are new tensors.

    Raises:
        ValueError: ``emit_positions`` out of range or not strictly increasing.
    """
    batch, seq_len, heads, head_dim = x.shape
    emit = set(check_emit_positions(emit_positions, seq_len))
    if initial_state is None:
        state = torch.zeros(batch, heads, head_dim, B.shape[-1], dtype=torch.float32, device=x.device)
    else:
        state = initial_state.float().clone()
    # Token-major copies, so each step reads contiguous slices, as a decode step does.
    x_t, dt_t = x.transpose(0, 1).contiguous(), dt.transpose(0, 1).contiguous()
    B_t, C_t = B.transpose(0, 1).contiguous(), C.transpose(0, 1).contiguous()
    outputs, emitted = [], []
    for t in range(seq_len):
        outputs.append(mamba2_step_invariant(state, x_t[t], dt_t[t], A, B_t[t], C_t[t], D, dt_bias, dt_softplus,
                                             dt_limit))
        if t + 1 in emit:
            emitted.append(state.clone())
    return torch.stack(outputs, dim=1), state, emitted


def gated_rms_norm_invariant(
    y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """Mamba-2's gated RMSNorm, ``weight * rmsnorm_per_group(y * silu(gate))`` in float32 with the result rounded to
    ``y``'s dtype before the weight, as ``Mamba2RMSNormGated.forward`` (transformers 5.23.0 - 5.25.0, there
    ``MambaRMSNormGated`` in 5.23) computes it, with the gate's silu taken from ``exp`` (bitwise the same at any
    offset in the tensor); every other op is elementwise or reduces one group of one row.

    Args:
        y: ``[..., I]`` (the scan output; any float dtype); gate: ``[..., I]``, any float dtype and strides.
        weight: ``[I]``; group_size: channels per group (``I / n_groups``); eps: the variance epsilon.

    Returns:
        ``[..., I]`` in the promotion of ``weight``'s and ``y``'s dtypes (as upstream).

    Raises:
        ValueError: ``I`` is not a multiple of ``group_size``.
    """
    width = y.shape[-1]
    if width % group_size:
        raise ValueError(f"The gated norm's width {width} is not a multiple of its group size {group_size}.")
    input_dtype = y.dtype
    hidden = y.float() * silu_invariant(gate.float())
    groups = hidden.reshape(*hidden.shape[:-1], width // group_size, group_size)
    groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    return weight * groups.reshape(hidden.shape).to(input_dtype)
