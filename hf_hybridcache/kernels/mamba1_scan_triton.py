"""Triton Mamba-1 selective scan with an initial state and state emission (torch reference:
:func:`~hf_hybridcache.kernels.mamba1_scan.selective_scan_ref`, same signature).

One program owns ``BLOCK_I`` channels x all N states of one batch row and walks the tokens in order, keeping the
state in registers (the layout of state-spaces/mamba's ``selective_state_update``, Gu & Dao 2023, run over T tokens).
Every token's state exists at some point, so emitting the state after token t is a masked store: a per-token slot
table says where (or -1). The time-step bias and softplus, and the ``D`` / ``silu(z)`` gate, run in torch around the
kernel exactly as the reference computes them, so the two differ only in the order of fp32 operations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .scan_steps import check_emit_positions, gate, time_steps


@triton.jit
def _selective_scan_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, h0_ptr, y_ptr, h_out_ptr, slot_ptr, emitted_ptr,
    seq_len, channels, state_size,
    stride_u_b, stride_u_i, stride_u_t,
    stride_dt_b, stride_dt_i, stride_dt_t,
    stride_B_b, stride_B_n, stride_B_t,
    stride_C_b, stride_C_n, stride_C_t,
    stride_emit_slot,
    HAS_H0: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_n = tl.arange(0, BLOCK_N)
    mask_i = offs_i < channels
    mask_n = offs_n < state_size
    mask_in = mask_i[:, None] & mask_n[None, :]
    # States are [B, I, N] contiguous: h0, the final state and each emitted state.
    state_offs = b * channels * state_size + offs_i[:, None] * state_size + offs_n[None, :]
    batch_states = tl.num_programs(0) * channels * state_size

    A = tl.load(A_ptr + offs_i[:, None] * state_size + offs_n[None, :], mask=mask_in, other=0.0).to(tl.float32)
    if HAS_H0:
        h = tl.load(h0_ptr + state_offs, mask=mask_in, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BLOCK_I, BLOCK_N], dtype=tl.float32)

    for t in range(seq_len):
        u = tl.load(u_ptr + b * stride_u_b + offs_i * stride_u_i + t * stride_u_t, mask=mask_i, other=0.0)
        dt = tl.load(dt_ptr + b * stride_dt_b + offs_i * stride_dt_i + t * stride_dt_t, mask=mask_i, other=0.0)
        B = tl.load(B_ptr + b * stride_B_b + offs_n * stride_B_n + t * stride_B_t, mask=mask_n, other=0.0)
        C = tl.load(C_ptr + b * stride_C_b + offs_n * stride_C_n + t * stride_C_t, mask=mask_n, other=0.0)
        dt = dt.to(tl.float32)
        h = tl.exp(A * dt[:, None]) * h + (dt * u.to(tl.float32))[:, None] * B.to(tl.float32)[None, :]
        y = tl.sum(h * C.to(tl.float32)[None, :], axis=1)
        tl.store(y_ptr + (b * channels + offs_i) * seq_len + t, y, mask=mask_i)
        # slot >= 0: the state after this token is wanted, in emitted[slot]. Broadcasting the scalar keeps the mask
        # a block (the interpreter rejects a scalar-and-block mask).
        slot = tl.load(slot_ptr + t * stride_emit_slot) + tl.zeros([BLOCK_I, BLOCK_N], dtype=tl.int32)
        tl.store(emitted_ptr + slot * batch_states + state_offs, h, mask=mask_in & (slot >= 0))

    tl.store(h_out_ptr + state_offs, h, mask=mask_in)


def selective_scan_triton(
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
    *,
    block_channels: int = 32,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Same arguments, results and errors as :func:`~hf_hybridcache.kernels.mamba1_scan.selective_scan_ref`; CUDA
    tensors (or CPU tensors under ``TRITON_INTERPRET=1``). ``block_channels`` (a power of two) is the channels per
    program."""
    batch, channels, seq_len = u.shape
    state_size = A.shape[-1]
    positions = check_emit_positions(emit_positions, seq_len)
    device = u.device
    dt = time_steps(delta, delta_bias, delta_softplus)
    A = A.float().contiguous()
    h0 = initial_state.float().contiguous() if initial_state is not None else A  # A: unused placeholder pointer
    y = torch.empty(batch, channels, seq_len, dtype=torch.float32, device=device)
    h_out = torch.empty(batch, channels, state_size, dtype=torch.float32, device=device)
    emitted = torch.empty(max(len(positions), 1), batch, channels, state_size, dtype=torch.float32, device=device)
    slots = torch.full((seq_len,), -1, dtype=torch.int32)
    slots[[t - 1 for t in positions]] = torch.arange(len(positions), dtype=torch.int32)
    slots = slots.to(device)

    grid = (batch, triton.cdiv(channels, block_channels))
    _selective_scan_kernel[grid](
        u, dt, A, B, C, h0, y, h_out, slots, emitted,
        seq_len, channels, state_size,
        *u.stride(), *dt.stride(), *B.stride(), *C.stride(), slots.stride(0),
        HAS_H0=initial_state is not None,
        BLOCK_I=block_channels,
        BLOCK_N=triton.next_power_of_2(state_size),
    )  # fmt: skip
    # Separate copies: a checkpoint must not keep the other emitted states alive through a shared storage.
    return gate(y.to(u.dtype), u, D, z), h_out, [state.clone() for state in emitted[: len(positions)]]
