"""Mamba-1 selective scan that starts from a given SSM state and emits the states at requested positions.

``mamba-ssm``'s fused selective scan (and transformers' torch fallback for it) always starts from a zero state, which
is why a multi-token forward over an existing cache restarts the recurrence in transformers 5.23. The reference here
mirrors transformers' sequential loop (``modeling_jamba.mamba_selective_scan``) operation for operation, adding the
initial state and the state emission that checkpoints need (the ``initial_states`` / final-state hooks of
state-spaces/mamba, Gu & Dao 2023).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def selective_scan_ref(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    emit_positions: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Token-by-token selective scan.

    Args:
        u: inputs ``[B, I, T]``, model dtype.
        delta: time steps before bias/softplus ``[B, I, T]``.
        A: ``[I, N]`` float32 (negative).
        B, C: ``[B, N, T]``.
        D: skip weights ``[I]``; z: gate ``[B, I, T]`` (output is multiplied by ``silu(z)``).
        delta_bias: ``[I]`` float32, added to ``delta`` before the softplus.
        initial_state: SSM state ``[B, I, N]`` after the tokens before this call, or None for a zero state.
        emit_positions: sorted token counts ``t`` in ``[1, T]``; the state after the first ``t`` tokens is returned.

    Returns:
        ``(y [B, I, T] in u's dtype, final state [B, I, N] float32, [state [B, I, N] float32 per emit position])``.
    """
    input_dtype = u.dtype
    batch_size, channels, seq_len = u.shape
    dt = delta
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    B = B.transpose(1, 2)
    C = C.transpose(1, 2)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    deltaB_u = dt[:, :, :, None] * B[:, None, :, :].float() * u[:, :, :, None].float()

    if initial_state is None:
        ssm_state = torch.zeros(batch_size, channels, A.shape[-1], dtype=input_dtype, device=u.device)
    else:
        ssm_state = initial_state.float()
    emit = set(emit_positions)
    emitted = []
    outputs = []
    for index in range(seq_len):
        ssm_state = discrete_A[:, :, index] * ssm_state + deltaB_u[:, :, index]
        outputs.append(torch.matmul(ssm_state.to(input_dtype), C[:, index, :].unsqueeze(-1))[:, :, 0])
        if index + 1 in emit:
            emitted.append(ssm_state.clone())
    y = torch.stack(outputs, dim=-1)
    if D is not None:
        y = y + u * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return y, ssm_state.float(), emitted


def selective_scan(*args, **kwargs):
    """Dispatch point for the Mamba-1 scan with initial state and state emission (same signature as
    :func:`selective_scan_ref`)."""
    return selective_scan_ref(*args, **kwargs)
