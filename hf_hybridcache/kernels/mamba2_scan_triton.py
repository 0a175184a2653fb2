"""Triton Mamba-2 chunked scan (SSD) from an initial state, emitting the states after arbitrary token counts.

Reference: :func:`~hf_hybridcache.kernels.mamba2_scan.mamba2_chunk_scan_ref` (same signature and results), which
:func:`~hf_hybridcache.kernels.mamba2_scan.mamba2_chunk_scan` runs off CUDA.

The SSD algorithm of Dao & Gu 2024 ("Transformers are SSMs", section 6; ``mamba_chunk_scan_combined`` in
state-spaces/mamba) in three launches:

1. ``_segment_states_kernel``: the state a run of tokens leaves behind when it starts from zero, and its total
   decay, for every chunk and for the first ``t mod chunk`` tokens of the chunk of each emit position ``t``;
2. ``_pass_states_kernel``: the state at every chunk start, carried across chunks from the initial state;
3. ``_chunk_output_kernel``: outputs, the within-chunk part as two matmuls with the causal decay mask and the
   chunk-start part read out through C.

The state after ``t`` tokens is then the start state of ``t``'s chunk times the decay of its first ``t mod chunk``
tokens plus what those tokens left (step 1), so states at block boundaries need not be chunk boundaries. Decays are
exponentials of differences of within-chunk cumulative sums of ``dt * A`` taken in the right order (always <= 0),
never ratios of products. The kernel's own chunk length (``kernel_chunk``) is independent of the model's
``chunk_size``, which changes nothing but round-off.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .scan_steps import check_emit_positions, discretize_dt


@triton.jit
def _segment_states_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, seg_start_ptr, seg_len_ptr, states_ptr, decay_ptr,
    num_heads, head_dim, state_size, heads_per_group,
    stride_x_b, stride_x_t, stride_x_h, stride_x_p,
    stride_dt_b, stride_dt_t, stride_dt_h,
    stride_B_b, stride_B_t, stride_B_g, stride_B_n,
    BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seg, bh, pid_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // num_heads, bh % num_heads
    g = h // heads_per_group
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    offs_l = tl.arange(0, BLOCK_L)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_l, mask_p, mask_n = offs_l < length, offs_p < head_dim, offs_n < state_size
    t = start + offs_l

    dt = tl.load(dt_ptr + b * stride_dt_b + t * stride_dt_t + h * stride_dt_h, mask=mask_l, other=0.0)
    dA = dt * tl.load(A_ptr + h)
    total = tl.sum(dA, axis=0)
    weight = dt * tl.exp(total - tl.cumsum(dA, axis=0))  # decay from each token to the segment end, times dt
    x = tl.load(
        x_ptr + b * stride_x_b + t[:, None] * stride_x_t + h * stride_x_h + offs_p[None, :] * stride_x_p,
        mask=mask_l[:, None] & mask_p[None, :],
        other=0.0,
    ).to(tl.float32)
    B = tl.load(
        B_ptr + b * stride_B_b + t[:, None] * stride_B_t + g * stride_B_g + offs_n[None, :] * stride_B_n,
        mask=mask_l[:, None] & mask_n[None, :],
        other=0.0,
    ).to(tl.float32)
    state = tl.dot(tl.trans(x * weight[:, None]), B, input_precision="ieee")  # [P, N]

    batch_heads = tl.num_programs(1)
    out = states_ptr + (seg * batch_heads + bh) * head_dim * state_size
    tl.store(out + offs_p[:, None] * state_size + offs_n[None, :], state, mask=mask_p[:, None] & mask_n[None, :])
    tl.store(decay_ptr + seg * batch_heads + bh, tl.exp(total))


@triton.jit
def _pass_states_kernel(
    chunk_states_ptr, decay_ptr, h0_ptr, starts_ptr,
    num_chunks, batch_heads, head_dim, state_size,
    HAS_H0: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    bh, pid_p = tl.program_id(0), tl.program_id(1)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask = (offs_p < head_dim)[:, None] & (offs_n < state_size)[None, :]
    offs = offs_p[:, None] * state_size + offs_n[None, :]
    stride_chunk = batch_heads * head_dim * state_size
    own = bh * head_dim * state_size
    if HAS_H0:
        h = tl.load(h0_ptr + own + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for c in range(num_chunks):
        tl.store(starts_ptr + c * stride_chunk + own + offs, h, mask=mask)
        decay = tl.load(decay_ptr + c * batch_heads + bh)
        h = decay * h + tl.load(chunk_states_ptr + c * stride_chunk + own + offs, mask=mask, other=0.0)
    tl.store(starts_ptr + num_chunks * stride_chunk + own + offs, h, mask=mask)


@triton.jit
def _chunk_output_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, starts_ptr, y_ptr,
    seq_len, chunk_len, num_heads, head_dim, state_size, heads_per_group,
    stride_x_b, stride_x_t, stride_x_h, stride_x_p,
    stride_dt_b, stride_dt_t, stride_dt_h,
    stride_B_b, stride_B_t, stride_B_g, stride_B_n,
    stride_C_b, stride_C_t, stride_C_g, stride_C_n,
    HAS_D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    c, bh, pid_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // num_heads, bh % num_heads
    g = h // heads_per_group
    offs_l = tl.arange(0, BLOCK_L)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    t = c * chunk_len + offs_l
    mask_l, mask_p, mask_n = (offs_l < chunk_len) & (t < seq_len), offs_p < head_dim, offs_n < state_size
    mask_lp, mask_ln = mask_l[:, None] & mask_p[None, :], mask_l[:, None] & mask_n[None, :]

    dt = tl.load(dt_ptr + b * stride_dt_b + t * stride_dt_t + h * stride_dt_h, mask=mask_l, other=0.0)
    cum = tl.cumsum(dt * tl.load(A_ptr + h), axis=0)
    x = tl.load(
        x_ptr + b * stride_x_b + t[:, None] * stride_x_t + h * stride_x_h + offs_p[None, :] * stride_x_p,
        mask=mask_lp,
        other=0.0,
    ).to(tl.float32)
    B = tl.load(
        B_ptr + b * stride_B_b + t[:, None] * stride_B_t + g * stride_B_g + offs_n[None, :] * stride_B_n,
        mask=mask_ln,
        other=0.0,
    ).to(tl.float32)
    C = tl.load(
        C_ptr + b * stride_C_b + t[:, None] * stride_C_t + g * stride_C_g + offs_n[None, :] * stride_C_n,
        mask=mask_ln,
        other=0.0,
    ).to(tl.float32)

    # Within the chunk: y_l = sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s.
    causal = offs_l[:, None] >= offs_l[None, :]
    decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0))  # masked before exp: no overflow above
    mixing = tl.where(causal, tl.dot(C, tl.trans(B), input_precision="ieee") * decay, 0.0) * dt[None, :]
    y = tl.dot(mixing, x, input_precision="ieee")
    # From the chunk's start state: y_l += exp(cum_l) C_l . h_start.
    batch_heads = tl.num_programs(1)
    start = tl.load(
        starts_ptr + (c * batch_heads + bh) * head_dim * state_size + offs_p[:, None] * state_size + offs_n[None, :],
        mask=mask_p[:, None] & mask_n[None, :],
        other=0.0,
    )
    y += tl.exp(cum)[:, None] * tl.dot(C, tl.trans(start), input_precision="ieee")
    if HAS_D:
        y += tl.load(D_ptr + h).to(tl.float32) * x
    y_offs = ((b * seq_len + t[:, None]) * num_heads + h) * head_dim + offs_p[None, :]
    tl.store(y_ptr + y_offs, y, mask=mask_lp)


def _block(size: int, cap: int | None = None) -> int:
    """Power-of-two tile covering ``size`` (at least 16, what ``tl.dot`` needs), at most ``cap``."""
    block = max(16, triton.next_power_of_2(size))
    return min(block, cap) if cap else block


def mamba2_chunk_scan_triton(
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
    *,
    kernel_chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Same arguments and results as :func:`~hf_hybridcache.kernels.mamba2_scan.mamba2_chunk_scan_ref`; CUDA tensors
    (or CPU tensors under ``TRITON_INTERPRET=1``). ``kernel_chunk`` (a power of two >= 16) is the kernel's tokens per
    chunk; ``chunk_size`` is accepted for the model's signature and changes nothing but round-off.

    Raises:
        ValueError: ``emit_positions`` out of range or not strictly increasing; a bad ``kernel_chunk``.
    """
    batch, seq_len, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[2], B.shape[3]
    positions = check_emit_positions(emit_positions, seq_len)
    if kernel_chunk < 16 or kernel_chunk & (kernel_chunk - 1):
        raise ValueError(f"kernel_chunk must be a power of two >= 16 (a tl.dot tile); got {kernel_chunk}.")
    device = x.device
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit).float()
    A = A.float().contiguous()
    length = kernel_chunk
    num_chunks = triton.cdiv(seq_len, length)
    # Segments: every chunk, then the head of the chunk of each emit position off a chunk boundary.
    segments = [(c * length, min(length, seq_len - c * length)) for c in range(num_chunks)]
    partial = {t: num_chunks + k for k, t in enumerate(t for t in positions if t % length)}
    segments += [((t // length) * length, t % length) for t in partial]
    seg_start = torch.tensor([s for s, _ in segments], dtype=torch.int32).to(device)
    seg_len = torch.tensor([n for _, n in segments], dtype=torch.int32).to(device)

    work = {"dtype": torch.float32, "device": device}
    seg_states = torch.empty(len(segments), batch, num_heads, head_dim, state_size, **work)
    seg_decay = torch.empty(len(segments), batch, num_heads, **work)
    starts = torch.empty(num_chunks + 1, batch, num_heads, head_dim, state_size, **work)
    y = torch.empty(batch, seq_len, num_heads, head_dim, **work)
    h0 = initial_state.float().contiguous() if initial_state is not None else starts
    tiles = {"BLOCK_P": _block(head_dim, 64), "BLOCK_N": _block(state_size)}
    num_p = triton.cdiv(head_dim, tiles["BLOCK_P"])
    sizes = (num_heads, head_dim, state_size, num_heads // num_groups)

    _segment_states_kernel[(len(segments), batch * num_heads, num_p)](
        x, dt, A, B, seg_start, seg_len, seg_states, seg_decay, *sizes,
        *x.stride(), *dt.stride(), *B.stride(), BLOCK_L=length, **tiles,
    )  # fmt: skip
    _pass_states_kernel[(batch * num_heads, num_p)](
        seg_states, seg_decay, h0, starts, num_chunks, batch * num_heads, head_dim, state_size,
        HAS_H0=initial_state is not None, **tiles,
    )  # fmt: skip
    _chunk_output_kernel[(num_chunks, batch * num_heads, num_p)](
        x, dt, A, B, C, D if D is not None else A, starts, y, seq_len, length, *sizes,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), HAS_D=D is not None, BLOCK_L=length, **tiles,
    )  # fmt: skip

    emitted = []
    for t in positions:
        chunk = t // length
        if t in partial:
            k = partial[t]
            emitted.append(seg_decay[k][..., None, None] * starts[chunk] + seg_states[k])
        else:
            emitted.append(starts[chunk].clone())
    return y, starts[num_chunks].clone(), emitted
