"""Mamba-1 selective scan that starts from a given SSM state and emits the states at requested positions.

``mamba-ssm``'s fused selective scan (and transformers' torch fallback for it) always starts from a zero state, which
is why a multi-token forward over an existing cache restarts the recurrence in transformers 5.23. Three
implementations share one signature (the ``initial_states`` / final-state hooks of state-spaces/mamba, Gu & Dao 2023):

- :func:`selective_scan_ref` mirrors the sequential loop ("Recurrent iteration") of ``mamba_selective_scan`` in
  ``transformers/models/jamba/modeling_jamba.py`` (transformers 5.23.0; ``modeling_zamba.py`` holds the same function)
  operation for operation, adding the initial state and the state emission that checkpoints need; from a zero state
  its outputs and final state are bit-identical to upstream's (tests/test_upstream_mixers.py);
- :func:`selective_scan_chunked` is the fast exact torch path (CPU, or CUDA without Triton);
- ``selective_scan_triton`` (in ``mamba1_scan_triton``) is the CUDA kernel.

:func:`selective_scan` dispatches between them (see :mod:`hf_hybridcache.kernels.backend`).

Shapes: B batch, I channels (``intermediate_size``), T tokens, N state size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import backend
from .mamba1_few import FEW_SCAN_TOKENS, selective_scan_few
from .scan_steps import check_emit_positions, gate, time_steps

#: Tokens per chunk of :func:`selective_scan_chunked`: the within-chunk pass takes this many sequential steps, the
#: cross-chunk carry one step per chunk, so about sqrt(segment) each is the least Python overhead.
CHUNK_TOKENS = 16
#: Tokens per segment: the work buffers are ``[B, segment, I, N]`` float32 and reused across segments, so a segment
#: stays in the CPU's last-level cache and no large tensor is allocated per token.
SEGMENT_TOKENS = 256
#: Cap on one work buffer, in bytes (segments shrink for wide models).
WORKSPACE_BYTES = 64 * 2**20


#: Rows moved per copy when changing between channel-major and token-major layouts on CPU.
_TRANSPOSE_BLOCK = 16


def _token_major(tensor: torch.Tensor, padded_len: int) -> torch.Tensor:
    """``[B, C, T]`` -> contiguous ``[B, padded_len, C]``, zero past ``T``."""
    batch, channels, seq_len = tensor.shape
    out = tensor.new_empty(batch, padded_len, channels)
    out[:, seq_len:].zero_()
    # A CPU transposing copy in narrow bands keeps its writes within few pages (about 3x faster than in one go); a
    # few tokens (a verified draft) fit in few pages anyway, and one copy saves the bands' per-call cost.
    step = _TRANSPOSE_BLOCK if tensor.device.type == "cpu" and seq_len > _TRANSPOSE_BLOCK else channels
    for c in range(0, channels, step):
        out[:, :seq_len, c : c + step].copy_(tensor[:, c : c + step].transpose(1, 2))
    return out


def _channel_major(tensor: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[B, T', C]`` -> contiguous ``[B, C, seq_len]`` (the first ``seq_len`` tokens)."""
    batch, _, channels = tensor.shape
    out = tensor.new_empty(batch, channels, seq_len)
    step = _TRANSPOSE_BLOCK if tensor.device.type == "cpu" else seq_len
    for t in range(0, seq_len, step):
        end = min(t + step, seq_len)
        out[:, :, t:end].copy_(tensor[:, t:end].transpose(1, 2))
    return out


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
    """Token-by-token selective scan: the sequential branch of ``mamba_selective_scan``
    (``transformers/models/jamba/modeling_jamba.py``, transformers 5.23.0), copied. Changed: the state starts from
    ``initial_state`` (cast to float32) when one is given (upstream: always zeros in the input dtype, as here without
    one), and is cloned after each of ``emit_positions``. Not copied: upstream's ``mambapy`` and ``associative_scan``
    alternatives.

    Args:
        u: inputs ``[B, I, T]``, model dtype.
        delta: time steps before bias/softplus ``[B, I, T]``.
        A: ``[I, N]`` float32 (negative).
        B, C: ``[B, N, T]``.
        D: skip weights ``[I]``; z: gate ``[B, I, T]`` (output is multiplied by ``silu(z)``).
        delta_bias: ``[I]`` float32, added to ``delta`` before the softplus.
        initial_state: SSM state ``[B, I, N]`` after the tokens before this call, or None for a zero state.
        emit_positions: strictly increasing token counts ``t`` in ``[1, T]``; the state after the first ``t`` tokens
            is returned.

    Returns:
        ``(y [B, I, T], final state [B, I, N] float32, [state [B, I, N] float32 per emit position])``; ``y`` has
        the dtype transformers' loop gives (``u``'s, promoted by ``D``'s).

    Raises:
        ValueError: ``emit_positions`` out of range or not strictly increasing.
    """
    input_dtype = u.dtype
    batch_size, channels, seq_len = u.shape
    emit = set(check_emit_positions(emit_positions, seq_len))
    dt = time_steps(delta, delta_bias, delta_softplus)
    B = B.transpose(1, 2)
    C = C.transpose(1, 2)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    deltaB_u = dt[:, :, :, None] * B[:, None, :, :].float() * u[:, :, :, None].float()

    if initial_state is None:
        ssm_state = torch.zeros(batch_size, channels, A.shape[-1], dtype=input_dtype, device=u.device)
    else:
        ssm_state = initial_state.float()
    emitted = []
    outputs = []
    for index in range(seq_len):
        ssm_state = discrete_A[:, :, index] * ssm_state + deltaB_u[:, :, index]
        outputs.append(torch.matmul(ssm_state.to(input_dtype), C[:, index, :].unsqueeze(-1))[:, :, 0])
        if index + 1 in emit:
            emitted.append(ssm_state.clone())
    y = torch.stack(outputs, dim=-1)
    return gate(y, u, D, z), ssm_state.float(), emitted


def selective_scan_chunked(
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
    chunk_tokens: int = CHUNK_TOKENS,
    segment_tokens: int = SEGMENT_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Exact chunked selective scan: same arguments, results and errors as :func:`selective_scan_ref`, equal to it
    within fp32 round-off, several times faster on CPU.

    The states ``h_t = a_t * h_{t-1} + x_t`` (``a_t = exp(A dt_t)``, ``x_t = dt_t u_t B_t``, all ``[B, I, N]``) are
    computed for every token in three passes per segment of ``segment_tokens`` tokens, the segment's state carried
    into the next one:

    1. every chunk of ``chunk_tokens`` tokens runs the recurrence from a zero state, all chunks at once (one
       vectorised step per token of a chunk), and accumulates the decay from the chunk start, ``prod_{k<=t} a_k``;
    2. the true state at each chunk start is carried across chunks (one step per chunk);
    3. each token's state gets its chunk start's state times the decay since that start.

    ``y_t = C_t . h_t`` then contracts all states at once. This is the chunked form of the SSD paper (Dao & Gu 2024,
    "Transformers are SSMs", section 6) with Mamba-1's per-channel, per-state decays, for which the within-chunk part
    cannot be one matmul. Stability: the decays are only ever multiplied, never divided, so no cumulative product
    is inverted (the failure that makes SSD take segment sums in log space); a product that underflows to zero
    weighs a state whose true contribution is below fp32's range, as in the sequential loop itself.

    Keyword Args:
        chunk_tokens: tokens per chunk (>= 1).
        segment_tokens: tokens per segment (rounded up to a multiple of ``chunk_tokens``; shrunk so one work buffer
            stays under ``WORKSPACE_BYTES``).
    """
    input_dtype = u.dtype
    batch, channels, seq_len = u.shape
    state_size = A.shape[-1]
    positions = check_emit_positions(emit_positions, seq_len)
    if chunk_tokens < 1 or segment_tokens < 1:
        raise ValueError(f"chunk_tokens and segment_tokens must be >= 1; got {chunk_tokens} and {segment_tokens}.")

    # Zero padding to whole chunks: dt = 0 gives a = 1 and x = 0, so the padded tokens leave the state unchanged
    # (exactly: times 1 and plus 0), and a call shorter than a chunk is one chunk of its own length, bit for bit the
    # same without the padding's work (a verified draft of a few tokens: half the time).
    # Work layout [B, T, N, I]: channels innermost, so every elementwise op runs over long contiguous rows.
    chunk_tokens = min(chunk_tokens, seq_len)
    padded_len = seq_len + (-seq_len % chunk_tokens)
    dt = time_steps(delta, delta_bias, delta_softplus).float()
    dt, x = _token_major(dt, padded_len), _token_major(dt * u.float(), padded_len)
    B_t, C_t = _token_major(B.float(), padded_len), _token_major(C.float(), padded_len)
    # exp2 of a pre-scaled exponent: the same decays to fp32 round-off, about 3x faster than exp on CPU.
    A_t = (A.float() * math.log2(math.e)).t().contiguous()

    token_bytes = batch * channels * state_size * 4
    segment = min(padded_len, -(-segment_tokens // chunk_tokens) * chunk_tokens)
    segment = max(chunk_tokens, min(segment, WORKSPACE_BYTES // token_bytes // chunk_tokens * chunk_tokens))
    work = {"dtype": torch.float32, "device": u.device}
    decay_buf = torch.empty(batch, segment, state_size, channels, **work)
    states_buf = torch.empty(batch, segment, state_size, channels, **work)
    starts_buf = torch.empty(batch, segment // chunk_tokens, 1, state_size, channels, **work)
    y = torch.empty(batch, padded_len, 1, channels, **work)
    if initial_state is None:
        state = torch.zeros(batch, state_size, channels, **work)
    else:
        state = initial_state.float().transpose(1, 2)

    emitted: list[torch.Tensor] = []
    next_emit = 0
    for start in range(0, padded_len, segment):
        n = min(segment, padded_len - start)
        num_chunks = n // chunk_tokens
        chunked = (batch, num_chunks, chunk_tokens, state_size, channels)
        decay = decay_buf[:, :n]
        states = states_buf[:, :n]
        torch.mul(dt[:, start : start + n, None, :], A_t, out=decay)
        decay.exp2_()
        torch.mul(x[:, start : start + n, None, :], B_t[:, start : start + n, :, None], out=states)

        # Pass 1: local states (zero at each chunk start) and decays since the chunk start, in place.
        decay_c, states_c = decay.view(chunked), states.view(chunked)
        for k in range(1, chunk_tokens):
            states_c[:, :, k].addcmul_(decay_c[:, :, k], states_c[:, :, k - 1])
            decay_c[:, :, k].mul_(decay_c[:, :, k - 1])
        # Pass 2: the state at each chunk start.
        starts = starts_buf[:, :num_chunks]
        for c in range(num_chunks):
            starts[:, c, 0] = state
            state = torch.addcmul(states_c[:, c, -1], decay_c[:, c, -1], state)
        # Pass 3: every token's state.
        states_c.addcmul_(decay_c, starts)

        while next_emit < len(positions) and positions[next_emit] <= start + n:
            emitted.append(states[:, positions[next_emit] - 1 - start].transpose(1, 2).contiguous())
            next_emit += 1
        torch.matmul(C_t[:, start : start + n, None, :], states, out=y[:, start : start + n])

    y = _channel_major(y[:, :, 0], seq_len).to(input_dtype)
    return gate(y, u, D, z), state.transpose(1, 2).contiguous(), emitted


def selective_scan(
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
    """Selective scan from ``initial_state`` with state emission; same arguments, results and errors as
    :func:`selective_scan_ref`. Runs Triton on CUDA, :func:`selective_scan_chunked` on CPU for float32 inputs
    (:func:`~hf_hybridcache.kernels.mamba1_few.selective_scan_few` for at most
    :data:`~hf_hybridcache.kernels.mamba1_few.FEW_SCAN_TOKENS` tokens), the reference for other CPU dtypes or when the
    ``"reference"`` backend is forced (:func:`hf_hybridcache.kernels.set_backend`)."""
    choice = backend.resolve(u.device)
    if choice == "torch" and u.dtype != torch.float32:
        # transformers' own scan rounds each state to the input dtype before the C product; in bf16/fp16 only the
        # token-by-token reference repeats that rounding, so a cached run keeps the cold run's greedy tokens.
        choice = "reference"
    if choice != "reference" and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (u, delta, A, B, C, D, z, delta_bias)
    ):
        choice = "reference"  # the fast paths write into preallocated buffers, which autograd cannot follow
    if choice == "triton":
        from .mamba1_scan_triton import selective_scan_triton as scan
    elif choice == "torch":
        scan = selective_scan_few if u.shape[-1] <= FEW_SCAN_TOKENS else selective_scan_chunked
    else:
        scan = selective_scan_ref
    return scan(
        u,
        delta,
        A,
        B,
        C,
        D=D,
        z=z,
        delta_bias=delta_bias,
        delta_softplus=delta_softplus,
        initial_state=initial_state,
        emit_positions=emit_positions,
    )
