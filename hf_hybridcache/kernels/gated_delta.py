"""Gated delta rule (Gated DeltaNet) that emits the recurrent state at arbitrary token positions.

Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule") keeps one
state ``S [Dk, Dv]`` per value head, updated per token as ``S <- exp(g_t) S + k_t^T (beta_t (v_t - k_t exp(g_t) S))``
and read as ``o_t = q_t S / sqrt(Dk)``. The chunked form (the UT/WY transform of DeltaNet, Yang et al. 2024) computes
the state only at chunk boundaries; a prefix cache wants it at block boundaries, which need not be chunk boundaries.
Inside chunk ``i``, which starts from ``S_i``, the chunk loop already holds the corrected values
``v_new_j = u_j - w_j S_i`` of its tokens, and the state after the chunk's first ``n`` tokens is

    ``S_i * exp(c_{n-1}) + sum_{j < n} exp(c_{n-1} - c_j) k_j^T v_new_j``    (``c`` the within-chunk cumsum of ``g``),

the chunk-end update truncated after ``n`` tokens (the UT system is lower triangular, so its first ``n`` rows depend
on the first ``n`` tokens only). :func:`chunk_gated_delta_rule` reads the emitted states off that way, from tensors
the loop has anyway; the scan itself is untouched, so its outputs stay those of one unsplit scan.

:func:`chunk_gated_delta_rule` mirrors ``torch_chunk_gated_delta_rule`` of
``transformers/models/qwen3_next/modeling_qwen3_next.py`` (transformers 5.23.0) operation for operation, so its
outputs and final state are bit-identical to it on CPU (tests/test_gated_delta.py); :func:`recurrent_gated_delta_rule`
mirrors ``torch_recurrent_gated_delta_rule`` of the same file, the token-by-token recurrence that is the ground truth
for the emitted states and the decode path; :func:`gated_delta_steps` is that recurrence in fewer ops (two batched
products per token), for the few tokens of a verify step. ``modeling_qwen3_5.py``, ``modeling_qwen3_5_moe.py``,
``modeling_olmo_hybrid.py`` and ``modeling_qwen4_exp.py`` hold character-for-character the same two functions (and
``l2norm``); OLMo-Hybrid's ``allow_neg_eigval`` only doubles ``beta`` before the call.

Shapes: B batch, T tokens, Hk query/key heads, Hv value heads (a multiple of Hk; each query/key head serves
``Hv // Hk`` consecutive value heads), Dk key head dim, Dv value head dim.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
import torch.nn.functional as F

from .scan_steps import check_emit_positions


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` as ``x * rsqrt(...)``: ``l2norm`` of ``modeling_qwen3_next.py`` (transformers
    5.23.0), copied (Kimi's KDA divides by a square root instead, see :mod:`.kda`)."""
    inv_norm = torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)
    return x * inv_norm


def _to_float_heads_first(query, key, value, g, beta):
    """Repeat query/key heads up to ``Hv`` and move to ``[B, Hv, T, ...]`` float32 (contiguous), as upstream does."""
    num_k_heads, num_v_heads = key.shape[2], value.shape[2]
    if num_v_heads % num_k_heads != 0:
        raise ValueError(
            f"value has {num_v_heads} heads, which is not a multiple of the {num_k_heads} query/key heads; each "
            "query/key head must serve the same number of value heads."
        )
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    return [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (query, key, value, beta, g)
    ]


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    emit_positions: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """Chunked gated delta rule from ``initial_state``, emitting the states after the requested numbers of tokens.

    ``torch_chunk_gated_delta_rule`` of ``transformers/models/qwen3_next/modeling_qwen3_next.py`` (transformers
    5.23.0), copied (its ``torch.export`` branch, a forward substitution in place of ``solve_triangular``, is left
    out). Added: ``emit_positions``.

    Args:
        query, key: ``[B, T, Hk, Dk]``, any float dtype (cast to float32 inside).
        value: ``[B, T, Hv, Dv]``, any float dtype.
        g: log decay per token ``[B, T, Hv]`` (entries <= 0; the state is multiplied by ``exp(g)``).
        beta: write strength per token ``[B, T, Hv]``, usually in ``(0, 1)`` (``(0, 2)`` with negative eigenvalues).
        chunk_size: tokens per chunk (int >= 1); the result depends on it only through round-off.
        initial_state: state ``[B, Hv, Dk, Dv]`` after the tokens before this call (any float dtype), or None for a
            zero state.
        output_final_state: return the state after all ``T`` tokens (else None in its place).
        use_qk_l2norm_in_kernel: L2-normalize query and key vectors (in float32) first.
        emit_positions: strictly increasing token counts ``t`` in ``[1, T]``; the state after the first ``t`` tokens
            is returned for each. Need not be multiples of ``chunk_size``.

    Returns:
        ``(out [B, T, Hv, Dv] in query's dtype, final state [B, Hv, Dk, Dv] float32 or None, [state [B, Hv, Dk, Dv]
        float32 per emit position])``, on query's device; the emitted states are new tensors.

    Raises:
        ValueError: ``emit_positions`` out of range or not increasing, or ``Hv`` not a multiple of ``Hk``.
    """
    initial_dtype = query.dtype
    batch_size, sequence_length, _num_k_heads, k_head_dim = key.shape
    num_v_heads, v_head_dim = value.shape[-2:]
    positions = check_emit_positions(emit_positions, sequence_length)
    recurrent_state_shape = (batch_size, num_v_heads, k_head_dim, v_head_dim)
    padded_output_shape = (batch_size, num_v_heads, -1, v_head_dim)

    query, key, value, beta, decay = _to_float_heads_first(query, key, value, g, beta)
    if use_qk_l2norm_in_kernel:
        query = l2norm(query, dim=-1, eps=1e-6)
        key = l2norm(key, dim=-1, eps=1e-6)
    scaling = query.shape[-1] ** -0.5
    query = query * scaling

    pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad_size)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad_size)) for x in (beta, decay))
    num_chunks = (sequence_length + pad_size) // chunk_size

    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    ]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    strictly_upper_mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)  # [b, h, chunk, l]: log decay from the chunk's start through position l

    # pairwise_decay[..., l, s] = exp(cum_decay_l - cum_decay_s) for s <= l, else 0
    pairwise_decay = cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)
    pairwise_decay = pairwise_decay.masked_fill(strictly_upper_mask, float("-inf"))
    pairwise_decay = pairwise_decay.exp()

    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise_decay
    intra_chunk_attn = (query @ key.transpose(-1, -2)) * pairwise_decay
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)

    if initial_state is None:
        last_recurrent_state = torch.zeros(recurrent_state_shape, dtype=new_values.dtype, device=new_values.device)
    else:
        last_recurrent_state = initial_state.to(new_values)
    core_attn_out = torch.zeros_like(new_values)

    query = query * cum_decay.exp().unsqueeze(-1)
    # Upstream overwrites `key` here; the undecayed keys are kept for the emitted states.
    key_to_chunk_end = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]

    emitted = []
    pending = iter(positions)
    position = next(pending, None)
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ last_recurrent_state
        inter_chunk_attn = query[:, :, i] @ last_recurrent_state
        core_attn_out[:, :, i] = inter_chunk_attn + intra_chunk_attn[:, :, i] @ v_new
        # Positions strictly inside this chunk read the chunk-start state; one at its end reads the updated state.
        while position is not None and position < (i + 1) * chunk_size:
            num_tokens = position - i * chunk_size
            emitted.append(
                _state_inside_chunk(
                    last_recurrent_state, cum_decay[:, :, i], pairwise_decay[:, :, i], key[:, :, i], v_new, num_tokens
                )
            )
            position = next(pending, None)
        last_recurrent_state = (
            last_recurrent_state * chunk_decay[:, :, i] + key_to_chunk_end[:, :, i].transpose(-1, -2) @ v_new
        )
        if position == (i + 1) * chunk_size:
            emitted.append(last_recurrent_state.clone())
            position = next(pending, None)

    last_recurrent_state = None if not output_final_state else last_recurrent_state
    core_attn_out = core_attn_out.reshape(padded_output_shape)
    core_attn_out = core_attn_out[:, :, :sequence_length]
    core_attn_out = core_attn_out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format)
    return core_attn_out, last_recurrent_state, emitted


def _state_inside_chunk(
    start_state: torch.Tensor,
    cum_decay: torch.Tensor,
    pairwise_decay: torch.Tensor,
    key: torch.Tensor,
    v_new: torch.Tensor,
    num_tokens: int,
) -> torch.Tensor:
    """State after the first ``num_tokens`` (``n``, ``1 <= n < chunk_size``) tokens of a chunk:
    ``S * exp(c_{n-1}) + sum_{j < n} exp(c_{n-1} - c_j) k_j^T v_new_j``.

    Args: ``start_state [B, H, Dk, Dv]`` (the chunk's start), ``cum_decay [B, H, C]``, ``pairwise_decay [B, H, C, C]``,
    ``key [B, H, C, Dk]`` (undecayed), ``v_new [B, H, C, Dv]`` (the delta-corrected values), all float32 and of this
    chunk. Returns a new float32 ``[B, H, Dk, Dv]``.
    """
    last = num_tokens - 1
    decay_from_start = cum_decay[..., last].exp()[..., None, None]
    decayed_key = key[:, :, :num_tokens] * pairwise_decay[:, :, last, :num_tokens, None]
    return start_state * decay_from_start + decayed_key.transpose(-1, -2) @ v_new[:, :, :num_tokens]


def recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    emit_positions: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """Token-by-token gated delta rule, emitting the states after the requested numbers of tokens: the ground truth
    for :func:`chunk_gated_delta_rule`, and the decode step.

    ``torch_recurrent_gated_delta_rule`` of ``transformers/models/qwen3_next/modeling_qwen3_next.py`` (transformers
    5.23.0), copied, so outputs and final state are bit-identical to it. Added: ``emit_positions``. Same arguments,
    returns and errors as :func:`chunk_gated_delta_rule`, without ``chunk_size``.
    """
    initial_dtype = query.dtype
    batch_size, sequence_length, _num_k_heads, k_head_dim = key.shape
    num_v_heads, v_head_dim = value.shape[-2:]
    positions = set(check_emit_positions(emit_positions, sequence_length))

    query, key, value, beta, decay = _to_float_heads_first(query, key, value, g, beta)
    if use_qk_l2norm_in_kernel:
        query = l2norm(query, dim=-1, eps=1e-6)
        key = l2norm(key, dim=-1, eps=1e-6)
    query = query / (query.shape[-1] ** 0.5)

    if initial_state is None:
        recurrent_state_shape = (batch_size, num_v_heads, k_head_dim, v_head_dim)
        last_recurrent_state = torch.zeros(recurrent_state_shape, dtype=value.dtype, device=value.device)
    else:
        last_recurrent_state = initial_state.to(value)
    core_attn_out = torch.zeros_like(value)

    emitted = []
    for i in range(sequence_length):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        decay_t = decay[:, :, i].exp()[..., None, None]
        last_recurrent_state = last_recurrent_state * decay_t
        beta_t = beta[:, :, i].unsqueeze(-1)
        kv_mem = (last_recurrent_state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta_t
        last_recurrent_state = last_recurrent_state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        core_attn_out[:, :, i] = (last_recurrent_state * q_t.unsqueeze(-1)).sum(dim=-2)
        if i + 1 in positions:
            emitted.append(last_recurrent_state.clone())

    last_recurrent_state = None if not output_final_state else last_recurrent_state
    core_attn_out = core_attn_out.transpose(1, 2).contiguous().to(initial_dtype)
    return core_attn_out, last_recurrent_state, emitted


def gated_delta_steps(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    emit_positions: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """:func:`recurrent_gated_delta_rule` with each token's read and write as two batched products per head (the
    decode step's form, :func:`~hf_hybridcache.kernels.state_update.gated_delta_step_fast`) and the per-token inputs
    prepared once: for a few tokens (a verify step's last token and drafts) it is several times cheaper than the
    chunked form, which pads every call to a whole chunk (64 tokens). Equal to the recurrence within float32
    round-off (the products sum in another order). Same arguments, returns and errors as
    :func:`recurrent_gated_delta_rule`; the emitted states are new tensors.
    """
    initial_dtype = query.dtype
    sequence_length, num_k_heads = key.shape[1:3]
    num_v_heads = value.shape[-2]
    positions = set(check_emit_positions(emit_positions, sequence_length))
    if num_v_heads % num_k_heads != 0:
        raise ValueError(
            f"value has {num_v_heads} heads, which is not a multiple of the {num_k_heads} query/key heads; each "
            "query/key head must serve the same number of value heads."
        )
    query, key, value = (x.float() for x in (query, key, value))  # [B, T, H, D]
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query, dim=-1, eps=1e-6), l2norm(key, dim=-1, eps=1e-6)
    query = query / (query.shape[-1] ** 0.5)
    decay = g.float().exp()[..., None, None]  # [B, T, Hv, 1, 1]
    out, state, emitted = delta_rule_steps(query, key, value, decay, beta.float().unsqueeze(-1), initial_state,
                                           positions)
    return out.to(initial_dtype), state if output_final_state else None, emitted


def delta_rule_steps(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    positions: Collection[int],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The token loop :func:`gated_delta_steps` and :func:`~hf_hybridcache.kernels.kda.kimi_delta_steps` share: per
    token ``S <- decay_t * S``, then the delta update ``S <- S + k_t^T (beta_t (v_t - k_t S))`` and the read
    ``o_t = q_t S`` as two batched products per head. The two rules differ only in ``decay``'s shape.

    Args:
        query, key: ``[B, T, H, Dk]`` float32, heads already repeated up to ``H``; ``query`` already normed and scaled.
        value: ``[B, T, H, Dv]`` float32.
        decay: the factor ``exp(g_t)`` float32 that multiplies the state ``[B, H, Dk, Dv]``: ``[B, T, H, 1, 1]``, one
            per head (GDN), or ``[B, T, H, Dk, 1]``, one per key channel (KDA).
        beta: ``[B, T, H, 1]`` float32.
        initial_state: ``[B, H, Dk, Dv]`` (any float dtype; read, never written), or None for zeros.
        positions: the checked token counts after which to emit the state.

    Returns:
        ``(out [B, T, H, Dv] float32, final state [B, H, Dk, Dv] float32, emitted states)``, all new tensors.
    """
    batch_size, sequence_length, num_heads, k_head_dim = key.shape
    if initial_state is None:
        state = value.new_zeros((batch_size, num_heads, k_head_dim, value.shape[-1]))
    else:
        state = initial_state.float()

    outputs, emitted = [], []
    for i in range(sequence_length):
        state = state * decay[:, i]  # a new tensor: the state before this token (or an emitted one) stays as it was
        k_t = key[:, i]
        kv_mem = torch.matmul(k_t.unsqueeze(-2), state).squeeze(-2)  # [B, H, Dv]
        state.addcmul_(k_t.unsqueeze(-1), ((value[:, i] - kv_mem) * beta[:, i]).unsqueeze(-2))
        outputs.append(torch.matmul(query[:, i].unsqueeze(-2), state))  # [B, H, 1, Dv]
        if i + 1 in positions:  # the last one is also the final state, which the caller may write in place
            emitted.append(state if i + 1 < sequence_length else state.clone())
    return torch.cat(outputs, dim=2).transpose(1, 2), state, emitted
