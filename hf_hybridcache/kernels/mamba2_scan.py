"""Mamba-2 chunked scan (SSD) that starts from a given SSM state and emits the states at arbitrary token positions.

The chunked scan of Mamba-2 (Dao & Gu 2024, "Transformers are SSMs", the SSD algorithm; ``mamba_chunk_scan_combined``
in state-spaces/mamba) computes the SSM state only at chunk boundaries, and those are counted from where the call
started. A prefix cache wants states at block boundaries, which need not be chunk boundaries: a forward that replays
from a restored state starts at any block boundary, and ``block_size`` need not divide ``chunk_size``. The state after
``t`` tokens is the state at the start of ``t``'s chunk, decayed over the chunk's first tokens, plus those tokens'
contributions; that is exactly the state a scan split at ``t`` would hand to its second half, computed here without
splitting, so the outputs stay those of one unsplit scan. A position on a chunk boundary is read from the inter-chunk
states directly.

:func:`mamba2_chunk_scan_ref` mirrors transformers' torch path (``mamba2_chunk_scan`` in
``transformers/models/zamba2/modeling_zamba2.py``, transformers 5.23.0; ``modeling_falcon_h1.py``,
``modeling_bamba.py``, ``modeling_granitemoehybrid.py`` and ``modeling_nemotron_h.py`` hold the same function)
operation for operation, so its outputs and final state are bit-identical to it (tests/test_mamba2.py,
tests/test_upstream_mixers.py);
:func:`mamba2_recurrent_ref` is the token-by-token recurrence the tests hold both against.

Shapes: B batch, T tokens, H heads, D head dim (``mamba_headdim``), G groups (``n_groups``, divides H), N state size.
Mamba's own names for the parameters are kept: ``B``/``C`` are the input/output projections (not the batch size) and
``D`` is the skip weight per head (not the head dim).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import backend
from .scan_steps import discretize_dt


def _check_positions(emit_positions: Sequence[int], seq_len: int) -> list[int]:
    positions = list(emit_positions)
    assert positions == sorted(positions) and all(1 <= t <= seq_len for t in positions), (
        f"emit_positions must be sorted token counts in [1, {seq_len}], got {positions}"
    )
    return positions


def _pad_time(tensor: torch.Tensor, pad_size: int) -> torch.Tensor:
    """Zero-pad dim 1 (tokens) of a ``[B, T, ...]`` tensor at the end."""
    return F.pad(tensor, (0, 0) * (tensor.dim() - 2) + (0, pad_size))


def _chunks(tensor: torch.Tensor, pad_size: int, chunk_size: int) -> torch.Tensor:
    """``[B, T, ...]`` -> ``[B, T' / chunk_size, chunk_size, ...]`` after zero-padding T to ``T'``
    (``pad_tensor_by_size`` + ``reshape_into_chunks`` of ``modeling_zamba2.py``, transformers 5.23.0, for any rank)."""
    tensor = _pad_time(tensor, pad_size)
    return tensor.reshape(tensor.shape[0], -1, chunk_size, *tensor.shape[2:])


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``[..., L]`` -> ``[..., L, L]`` with ``out[..., i, j] = sum(x[..., j+1 : i+1])`` for ``j <= i``, else -inf
    (cumsum of a masked copy, for stability): ``segment_sum`` of ``modeling_zamba2.py`` (transformers 5.23.0),
    copied."""
    size = x.size(-1)
    x = x[..., None].expand(*x.size(), size)
    x = x.masked_fill(~torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=-1), 0)
    x = torch.cumsum(x, dim=-2)
    return x.masked_fill(~torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=0), -torch.inf)


def mamba2_chunk_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_state: torch.Tensor | None = None,
    emit_positions: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Chunked Mamba-2 scan from ``initial_state``, emitting the states after the requested numbers of tokens.

    ``mamba2_chunk_scan`` of ``transformers/models/zamba2/modeling_zamba2.py`` (transformers 5.23.0), copied; it
    already takes ``initial_states``. Changed: ``emit_positions`` (the states after those token counts, from
    :func:`_state_after`), and the final state is always returned.

    Args:
        x: inputs ``[B, T, H, D]``, model dtype.
        dt: time steps before bias/softplus ``[B, T, H]``, model dtype.
        A: ``[H]`` float32, negative (``-exp(A_log)``).
        B, C: ``[B, T, G, N]``, model dtype.
        chunk_size: tokens per chunk (int >= 1); any value gives the same result up to round-off.
        D: skip weights ``[H]``; dt_bias: ``[H]``, added to ``dt`` before the softplus.
        dt_softplus: apply softplus to ``dt`` (after the bias); dt_limit: clamp range of the discretized ``dt``.
        initial_state: SSM state ``[B, H, D, N]`` after the tokens before this call (any float dtype), or None for
            a zero state.
        emit_positions: sorted token counts ``t`` in ``[1, T]``; the state after the first ``t`` tokens is returned.
            Need not be multiples of ``chunk_size``.

    Returns:
        ``(y [B, T, H, D] float32, final state [B, H, D, N] float32, [state [B, H, D, N] float32 per emit
        position])``; the emitted states are new tensors.
    """
    batch_size, seq_len, num_heads, head_dim = x.shape
    positions = _check_positions(emit_positions, seq_len)
    num_groups = B.shape[2]
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)

    x = x.float()
    B = B.float().repeat_interleave(num_heads // num_groups, dim=2, output_size=num_heads)
    C = C.float().repeat_interleave(num_heads // num_groups, dim=2, output_size=num_heads)
    pad_size = (chunk_size - seq_len % chunk_size) % chunk_size
    D_residual = D[..., None] * _pad_time(x, pad_size) if D is not None else None

    x = x * dt[..., None].float()
    A = A.to(x.dtype) * dt.float()
    # b batch, c chunk, l/s positions in a chunk, h head, p head dim, n state
    x, A, B, C = (_chunks(t, pad_size, chunk_size) for t in (x, A, B, C))
    A = A.permute(0, 3, 1, 2)  # [b, h, c, l]
    A_cumsum = torch.cumsum(A, dim=-1)

    # Intra-chunk (diagonal blocks): attention-like mixing inside each chunk.
    L = torch.exp(_segment_sum(A))
    G = torch.einsum("bclhn,bcshn->bclsh", C, B)
    M = G * L.permute(0, 2, 3, 4, 1)
    Y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)

    # State contributed by each chunk alone, then the inter-chunk recurrence from the initial state.
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    chunk_states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)
    previous = (
        initial_state[:, None].to(dtype=chunk_states.dtype, device=chunk_states.device)
        if initial_state is not None
        else torch.zeros_like(chunk_states[:, :1])
    )
    chunk_states = torch.cat([previous, chunk_states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    boundary_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, chunk_states)  # [b, c+1, h, p, n]: chunk starts
    start_states, final_state = boundary_states[:, :-1], boundary_states[:, -1]

    # Inter-chunk (off-diagonal blocks): each chunk's start state read out through C.
    state_decay_out = torch.exp(A_cumsum)
    C_times_states = torch.einsum("bclhn,bchpn->bclhp", C, start_states)
    Y_off = C_times_states * state_decay_out.permute(0, 2, 3, 1)[..., None]

    y = (Y_diag + Y_off).contiguous().reshape(batch_size, -1, num_heads, head_dim)
    if D_residual is not None:
        y = y + D_residual
    if pad_size > 0:
        y = y[:, :seq_len]

    emitted = [_state_after(t, chunk_size, boundary_states, A_cumsum, B, x) for t in positions]
    return y, final_state, emitted


def _state_after(
    t: int,
    chunk_size: int,
    boundary_states: torch.Tensor,
    A_cumsum: torch.Tensor,
    B: torch.Tensor,
    x: torch.Tensor,
) -> torch.Tensor:
    """State after ``t`` tokens: the start state of ``t``'s chunk decayed over its first ``j`` tokens, plus their
    inputs, each decayed from its own position (``h_t = exp(sum A) h_start + sum_s exp(sum_{s<k<=t} A_k) B_s x_s``)."""
    chunk, j = divmod(t, chunk_size)
    if j == 0:
        return boundary_states[:, chunk].clone()
    cumsum = A_cumsum[:, :, chunk, :j]  # [b, h, j]
    decay_from_start = torch.exp(cumsum[:, :, -1])  # [b, h]
    decay_inputs = torch.exp(cumsum[:, :, -1:] - cumsum)  # [b, h, j]
    inputs = torch.einsum("bhl,blhn,blhp->bhpn", decay_inputs, B[:, chunk, :j], x[:, chunk, :j])
    return decay_from_start[..., None, None] * boundary_states[:, chunk] + inputs


def mamba2_recurrent_ref(
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
    """Token-by-token Mamba-2 recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t h_t + D x_t``, in
    float32: the ground truth for :func:`mamba2_chunk_scan_ref`. Same arguments and returns (without
    ``chunk_size``)."""
    batch_size, seq_len, num_heads, head_dim = x.shape
    positions = set(_check_positions(emit_positions, seq_len))
    repeat = num_heads // B.shape[2]
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit).float()
    B = B.float().repeat_interleave(repeat, dim=2)
    C = C.float().repeat_interleave(repeat, dim=2)
    x = x.float()
    if initial_state is None:
        state = x.new_zeros(batch_size, num_heads, head_dim, B.shape[-1])
    else:
        state = initial_state.float().clone()
    outputs, emitted = [], []
    for index in range(seq_len):
        decay = torch.exp(dt[:, index] * A.float())[..., None, None]  # [b, h, 1, 1]
        inputs = (dt[:, index, :, None] * x[:, index])[..., None] * B[:, index, :, None, :]  # [b, h, p, n]
        state = decay * state + inputs
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, C[:, index]))
        if index + 1 in positions:
            emitted.append(state.clone())
    y = torch.stack(outputs, dim=1)
    if D is not None:
        y = y + D.float()[:, None] * x
    return y, state, emitted


def mamba2_chunk_scan(x: torch.Tensor, *args, **kwargs):
    """Dispatch point for the Mamba-2 chunked scan with initial state and state emission (same signature and
    returns as :func:`mamba2_chunk_scan_ref`): the Triton kernel (``mamba2_scan_triton``) on CUDA, this reference
    elsewhere or when the ``"reference"`` backend is forced (:func:`hf_hybridcache.kernels.set_backend`)."""
    if backend.resolve(x.device, fast="reference") == "triton":
        from .mamba2_scan_triton import mamba2_chunk_scan_triton

        return mamba2_chunk_scan_triton(x, *args, **kwargs)
    return mamba2_chunk_scan_ref(x, *args, **kwargs)
