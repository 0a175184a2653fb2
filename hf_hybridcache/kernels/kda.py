"""Kimi Delta Attention (KDA) that emits the recurrent state at arbitrary token positions.

KDA (Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention Architecture") is the gated delta rule of
:mod:`.gated_delta` with a decay per key channel instead of per head: ``S <- diag(exp(g_t)) S`` with ``g_t [Dk]``,
then the delta update ``S <- S + k_t^T (beta_t (v_t - k_t S))``, read as ``o_t = q_t S / sqrt(Dk)``. The state after
the first ``n`` tokens of a chunk that starts from ``S_i`` is, as for GDN, the chunk-end update truncated after
``n`` tokens, with the decays applied per key channel (``c`` the within-chunk cumsum of ``g``, ``[C, Dk]``):

    ``diag(exp(c_{n-1})) S_i + sum_{j < n} (k_j * exp(c_{n-1} - c_j))^T v_new_j``;

:func:`chunk_kimi_delta_attention` reads the emitted states off that way inside its chunk loop, from tensors the loop
has anyway, without touching the scan.

:func:`chunk_kimi_delta_attention` and :func:`recurrent_kimi_delta_attention` mirror the functions of the same names
in ``transformers/models/kimi_linear/modeling_kimi_linear.py`` (transformers 5.23.0) operation for operation, so
outputs and final states are bit-identical to them on CPU (tests/test_kda.py); the recurrence is the ground truth for
the emitted states and the decode path. :func:`kimi_delta_steps` is that recurrence in fewer ops (two batched
products per token), for the few tokens of a verify step. ``modeling_bailing_hybrid.py`` and ``modeling_glm5_next.py`` hold
character-for-character the same two functions (and ``l2norm``): their bounded ("safe") gate,
``lower_bound * sigmoid(exp(A_log) * (x + dt_bias))`` in place of ``-exp(A_log) * softplus(x + dt_bias)``, is
computed by the layer's forget-gate module before the call, so it only changes the range of ``g`` here. Unlike GDN,
KDA has no grouped heads: query, key and value have the same number of heads.

Shapes: B batch, T tokens, H heads, Dk key head dim, Dv value head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .gated_delta import delta_rule_steps
from .scan_steps import check_emit_positions


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)``: ``l2norm`` of ``modeling_kimi_linear.py`` (transformers 5.23.0), copied. It
    divides by a square root where GDN's multiplies by ``rsqrt``, so the two differ in the last bit."""
    inv_norm = torch.sqrt((x * x).sum(dim=dim, keepdim=True) + eps)
    return x / inv_norm


def chunk_kimi_delta_attention(
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
    """Chunked KDA from ``initial_state``, emitting the states after the requested numbers of tokens.

    ``chunk_kimi_delta_attention`` of ``transformers/models/kimi_linear/modeling_kimi_linear.py`` (transformers
    5.23.0), copied. Added: ``emit_positions``.

    Args:
        query, key: ``[B, T, H, Dk]``, any float dtype (cast to float32 inside).
        value: ``[B, T, H, Dv]``, any float dtype.
        g: log decay per token and key channel ``[B, T, H, Dk]`` (entries <= 0; row ``d`` of the state is multiplied
            by ``exp(g[..., d])``).
        beta: write strength per token ``[B, T, H]``, in ``(0, 1)``.
        chunk_size: tokens per chunk (int >= 1); the result depends on it only through round-off.
        initial_state: state ``[B, H, Dk, Dv]`` after the tokens before this call (any float dtype), or None for a
            zero state.
        output_final_state: return the state after all ``T`` tokens (else None in its place).
        use_qk_l2norm_in_kernel: L2-normalize query and key vectors (in float32) first.
        emit_positions: strictly increasing token counts ``t`` in ``[1, T]``; the state after the first ``t`` tokens
            is returned for each. Need not be multiples of ``chunk_size``.

    Returns:
        ``(out [B, T, H, Dv] in query's dtype, final state [B, H, Dk, Dv] float32 or None, [state [B, H, Dk, Dv]
        float32 per emit position])``, on query's device; the emitted states are new tensors.

    Raises:
        ValueError: ``emit_positions`` out of range or not increasing.
    """
    initial_dtype = query.dtype
    positions = check_emit_positions(emit_positions, query.shape[1])

    query, key, value, beta, g = [
        x.transpose(1, 2).contiguous().to(torch.float32) for x in (query, key, value, beta, g)
    ]
    if use_qk_l2norm_in_kernel:
        query = l2norm(query, dim=-1, eps=1e-6)
        key = l2norm(key, dim=-1, eps=1e-6)

    batch_size, num_heads, sequence_length, k_head_dim = key.shape
    v_head_dim = value.shape[-1]
    scale = 1 / (query.shape[-1] ** 0.5)
    pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size
    total_sequence_length = sequence_length + pad_size

    query = F.pad(query, (0, 0, 0, pad_size)) * scale
    key = F.pad(key, (0, 0, 0, pad_size))
    value = F.pad(value, (0, 0, 0, pad_size))
    g = F.pad(g, (0, 0, 0, pad_size))
    beta = F.pad(beta, (0, pad_size))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)

    query, key, value, g, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1]) for x in (query, key, value, g, k_beta, v_beta)
    ]

    g = g.cumsum(dim=-2)  # [b, h, chunk, l, dk]: log decay per key channel from the chunk's start through l
    mask = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device), diagonal=0)
    strict_mask = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device), diagonal=1)
    # decay_mask[..., l, s, :] = exp(g_l - g_s) for s <= l, else 0
    decay_mask = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict_mask[..., None], float("-inf")).exp().float()
    attn = -(k_beta.unsqueeze(-2) * key.unsqueeze(-3) * decay_mask).sum(dim=-1).masked_fill(mask, 0)
    for i in range(1, chunk_size):
        row = attn[..., i, :i].clone()
        sub = attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)

    attn = attn + torch.eye(chunk_size, dtype=attn.dtype, device=attn.device)
    value = attn @ v_beta
    k_cumdecay = attn @ (k_beta * g.exp())

    last_recurrent_state = (
        torch.zeros(batch_size, num_heads, k_head_dim, v_head_dim, dtype=value.dtype, device=value.device)
        if initial_state is None
        else initial_state.to(value)
    )
    core_attn_out = torch.zeros_like(value)

    emitted = []
    pending = iter(positions)
    position = next(pending, None)
    mask = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device), diagonal=1)
    for i in range(total_sequence_length // chunk_size):
        q_i = query[:, :, i]
        k_i = key[:, :, i]
        v_i = value[:, :, i]
        g_i = g[:, :, i]

        attn_inter = (q_i * g_i.exp()) @ last_recurrent_state
        attn_intra = (q_i.unsqueeze(-2) * k_i.unsqueeze(-3) * decay_mask[:, :, i]).sum(dim=-1).masked_fill(mask, 0)
        v_prime = k_cumdecay[:, :, i] @ last_recurrent_state
        v_new = v_i - v_prime

        core_attn_out[:, :, i] = attn_inter + attn_intra @ v_new
        # Positions strictly inside this chunk read the chunk-start state; one at its end reads the updated state.
        while position is not None and position < (i + 1) * chunk_size:
            num_tokens = position - i * chunk_size
            emitted.append(_state_inside_chunk(last_recurrent_state, g_i, decay_mask[:, :, i], k_i, v_new, num_tokens))
            position = next(pending, None)
        last_recurrent_state = (
            last_recurrent_state * g_i[:, :, -1].exp().unsqueeze(-1)
            + (k_i * (g_i[:, :, -1:] - g_i).exp()).transpose(-1, -2) @ v_new
        )
        if position == (i + 1) * chunk_size:
            emitted.append(last_recurrent_state.clone())
            position = next(pending, None)

    if not output_final_state:
        last_recurrent_state = None

    core_attn_out = core_attn_out.reshape(core_attn_out.shape[0], core_attn_out.shape[1], -1, core_attn_out.shape[-1])
    core_attn_out = core_attn_out[:, :, :sequence_length]
    core_attn_out = core_attn_out.transpose(1, 2).contiguous().to(initial_dtype)
    return core_attn_out, last_recurrent_state, emitted


def _state_inside_chunk(
    start_state: torch.Tensor,
    cum_decay: torch.Tensor,
    decay_mask: torch.Tensor,
    key: torch.Tensor,
    v_new: torch.Tensor,
    num_tokens: int,
) -> torch.Tensor:
    """State after the first ``num_tokens`` (``n``, ``1 <= n < chunk_size``) tokens of a chunk:
    ``diag(exp(c_{n-1})) S + sum_{j < n} (k_j * exp(c_{n-1} - c_j))^T v_new_j``.

    Args: ``start_state [B, H, Dk, Dv]`` (the chunk's start), ``cum_decay [B, H, C, Dk]``, ``decay_mask
    [B, H, C, C, Dk]``, ``key [B, H, C, Dk]``, ``v_new [B, H, C, Dv]`` (the delta-corrected values), all float32 and
    of this chunk. Returns a new float32 ``[B, H, Dk, Dv]``.
    """
    last = num_tokens - 1
    decay_from_start = cum_decay[:, :, last].exp().unsqueeze(-1)
    decayed_key = key[:, :, :num_tokens] * decay_mask[:, :, last, :num_tokens]
    return start_state * decay_from_start + decayed_key.transpose(-1, -2) @ v_new[:, :, :num_tokens]


def recurrent_kimi_delta_attention(
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
    """Token-by-token KDA, emitting the states after the requested numbers of tokens: the ground truth for
    :func:`chunk_kimi_delta_attention`, and the decode step.

    ``recurrent_kimi_delta_attention`` of ``transformers/models/kimi_linear/modeling_kimi_linear.py`` (transformers
    5.23.0), copied, so outputs and final state are bit-identical to it (upstream has no defaults for
    ``initial_state`` / ``output_final_state``). Added: ``emit_positions``. Same arguments, returns and errors as
    :func:`chunk_kimi_delta_attention`, without ``chunk_size``.
    """
    initial_dtype = query.dtype
    positions = set(check_emit_positions(emit_positions, query.shape[1]))
    query, key, value, g, beta = [x.to(torch.float32) for x in (query, key, value, g, beta)]
    if use_qk_l2norm_in_kernel:
        query = l2norm(query, dim=-1, eps=1e-6)
        key = l2norm(key, dim=-1, eps=1e-6)

    batch_size, sequence_length, num_heads, k_head_dim = key.shape
    v_head_dim = value.shape[-1]
    scale = 1 / (query.shape[-1] ** 0.5)
    query = query * scale

    core_attn_out = torch.zeros(
        batch_size, sequence_length, num_heads, v_head_dim, dtype=value.dtype, device=value.device
    )
    last_recurrent_state = (
        torch.zeros(batch_size, num_heads, k_head_dim, v_head_dim, dtype=value.dtype, device=value.device)
        if initial_state is None
        else initial_state.to(value)
    )

    emitted = []
    for i in range(sequence_length):
        q_i = query[:, i]
        k_i = key[:, i]
        v_i = value[:, i]
        g_i = g[:, i][..., None].exp()
        b_i = beta[:, i][..., None]

        last_recurrent_state = last_recurrent_state * g_i
        kv_mem = (last_recurrent_state * k_i[..., None]).sum(dim=-2)
        delta = (v_i - kv_mem) * b_i

        last_recurrent_state = last_recurrent_state + k_i.unsqueeze(-1) * delta.unsqueeze(-2)
        core_attn_out[:, i] = (last_recurrent_state * q_i.unsqueeze(-1)).sum(dim=-2)
        if i + 1 in positions:
            emitted.append(last_recurrent_state.clone())

    return core_attn_out.to(initial_dtype), last_recurrent_state if output_final_state else None, emitted


def kimi_delta_steps(
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
    """:func:`recurrent_kimi_delta_attention` with each token's read and write as two batched products per head and
    the per-token inputs prepared once: for a few tokens (a verify step's last token and drafts) several times
    cheaper than the chunked form, which pads every call to a whole chunk (64 tokens). Equal to the recurrence within
    float32 round-off (the products sum in another order). Same arguments, returns and errors as
    :func:`recurrent_kimi_delta_attention`; the emitted states are new tensors.
    """
    initial_dtype = query.dtype
    positions = set(check_emit_positions(emit_positions, key.shape[1]))
    query, key, value = (x.float() for x in (query, key, value))  # [B, T, H, D]
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query, dim=-1, eps=1e-6), l2norm(key, dim=-1, eps=1e-6)
    query = query * (1 / (query.shape[-1] ** 0.5))
    decay = g.float().exp().unsqueeze(-1)  # [B, T, H, Dk, 1]: row d of the state decays by exp(g_d)
    out, state, emitted = delta_rule_steps(query, key, value, decay, beta.float().unsqueeze(-1), initial_state,
                                           positions)
    return out.to(initial_dtype), state if output_final_state else None, emitted
