"""Token-by-token Mamba-2 recurrence with an initial state and state emission: the reference the Triton Mamba-2
chunked scan (``mamba2_scan_triton``) is tested against.

Stand-in: the package's Mamba-2 torch reference for Zamba2 / Falcon-H1 (``kernels/mamba2_scan.py``,
``mamba2_chunk_scan_ref``, written on another branch) had not landed when the kernel was written. This function
takes the same arguments and returns the same results as that one (``chunk_size`` is accepted and has no effect:
the recurrence has no chunks), so the kernel can be held against either.

The recurrence (Dao & Gu 2024, "Transformers are SSMs", eq. for the scalar-times-identity SSM of Mamba-2), per head
h: ``h_t = exp(dt_t A_h) h_{t-1} + dt_t x_t B_t^T`` and ``y_t = h_t C_t + D_h x_t``, all in float32.

Shapes: B batch, T tokens, H heads, P head dim (``mamba_headdim``), G groups (``n_groups``, divides H), N state size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .mamba1_scan import check_emit_positions


def discretize_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float]
) -> torch.Tensor:
    """``clamp(softplus(dt + dt_bias), *dt_limit)`` in ``dt``'s dtype, as transformers' Mamba-2 mixers compute it."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])


def mamba2_scan_recurrent_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int = 256,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_state: torch.Tensor | None = None,
    emit_positions: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Mamba-2 scan from ``initial_state``, one token at a time, emitting the states after requested token counts.

    Args:
        x: inputs ``[B, T, H, P]``, model dtype.
        dt: time steps before bias/softplus ``[B, T, H]``.
        A: ``[H]`` float32, negative (``-exp(A_log)``).
        B, C: ``[B, T, G, N]``.
        chunk_size: accepted for signature compatibility with the chunked scans; no effect.
        D: skip weights ``[H]``; dt_bias: ``[H]``, added to ``dt`` before the softplus.
        dt_softplus: apply softplus to ``dt`` (after the bias); dt_limit: clamp range of the discretized ``dt``.
        initial_state: SSM state ``[B, H, P, N]`` after the tokens before this call, or None for a zero state.
        emit_positions: strictly increasing token counts ``t`` in ``[1, T]``; the state after ``t`` tokens is
            returned for each.

    Returns:
        ``(y [B, T, H, P] float32, final state [B, H, P, N] float32, [state [B, H, P, N] float32 per emit
        position])``, all new tensors.

    Raises:
        ValueError: ``emit_positions`` out of range or not strictly increasing.
    """
    batch, seq_len, num_heads, head_dim = x.shape
    emit = set(check_emit_positions(emit_positions, seq_len))
    heads_per_group = num_heads // B.shape[2]
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit).float()
    B = B.float().repeat_interleave(heads_per_group, dim=2)
    C = C.float().repeat_interleave(heads_per_group, dim=2)
    x = x.float()
    if initial_state is None:
        state = x.new_zeros(batch, num_heads, head_dim, B.shape[-1])
    else:
        state = initial_state.float().clone()
    outputs, emitted = [], []
    for t in range(seq_len):
        decay = torch.exp(dt[:, t] * A.float())[:, :, None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
        if t + 1 in emit:
            emitted.append(state.clone())
    y = torch.stack(outputs, dim=1)
    if D is not None:
        y = y + D.float()[:, None] * x
    return y, state, emitted
