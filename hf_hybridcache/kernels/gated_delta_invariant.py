"""The gated delta rule with one arithmetic for a token, however it arrives, and its gated RMSNorm with one arithmetic
for a row, whatever shares its call (issue 46, ingredients of deterministic mode; wired in
:mod:`hf_hybridcache.models.gated_delta_deterministic`).

A gated delta net prefill runs the chunked rule (:func:`~hf_hybridcache.kernels.chunk_gated_delta_rule`: the UT
transform's matrix products and triangular solves over a 64-token chunk grid that starts where the call starts) and a
decode step the recurrence (:func:`~hf_hybridcache.kernels.recurrent_gated_delta_rule`, whose sums run over the key
dim of a ``[Dk, Dv]`` state, not its last dim), so the same token's output and state differ between a prefill and a
decode step and with the offset a prefill starts at (tests/test_gated_delta_invariant.py shows both).

As for Mamba-1 / Mamba-2 (:mod:`.mamba1_invariant`, :mod:`.mamba2_invariant`), a prefill here *is* a sequence of
decode steps: :func:`gated_delta_rule_scan_invariant` runs the step of :func:`gated_delta_rule_step_invariant` once
per token on contiguous token-major slices. A step is elementwise float32 arithmetic plus sums over the last dim of
one row: the state is held value-major (``[Dv, Dk]`` per head) while it runs, so ``k S`` and ``q S`` are sums over the
contiguous key dim, as are the l2-norms of ``q`` and ``k`` (no ``bmm`` / ``matmul``, whose float32 result for a row
depends on the row count on this CPU). A token's output and state are then the same bits in a prefill at any offset,
a split prompt or a decode step, whatever rows share the call. The states the functions take and return keep the
package's layout ``[B, Hv, Dk, Dv]`` (the cache's); transposing is a copy, exact. KDA's invariant rule
(:mod:`.kda_invariant`) runs the same step and loop (:func:`delta_rule_step`, :func:`delta_rule_scan`) with a decay
per key channel and its own :class:`DeltaRuleForm` (its l2-norm and query scaling as its upstream writes them).

Cost: a step per token instead of chunk-sized matrix products (docs/deterministic.md has the measured cost).

The gated RMSNorm after the rule (``Qwen3_5RMSNormGated`` / ``Qwen3NextRMSNormGated``, norm first, then the gate)
reduces each head of a row alone but gates with ``F.silu``, whose float32 bits for an element depend on its offset in
a vectorized loop; :func:`gated_rms_norm_after_invariant` is upstream's arithmetic with
:func:`~hf_hybridcache.kernels.mamba1_invariant.silu_invariant` for the gate. ``torch.sigmoid`` (the write strength
``beta``) moves the same way in float32 (measured: 23 of 441 rows at two threads); :func:`sigmoid_invariant` is
``1 / (1 + exp(-x))``.

Shapes: B rows, T tokens, Hk query/key heads, Hv value heads (a multiple of Hk), Dk key head dim, Dv value head dim.
Source: Yang, Kautz & Hatamizadeh, "Gated Delta Networks" (ICLR 2025); the recurrence of
``torch_recurrent_gated_delta_rule`` in ``transformers/models/qwen3_next/modeling_qwen3_next.py`` (5.23.0 - 5.25.0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .mamba1_invariant import silu_invariant
from .scan_steps import check_emit_positions

#: The epsilon of upstream's ``l2norm`` of ``q`` and ``k``.
L2NORM_EPS = 1e-6


def sigmoid_invariant(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid(x)`` as ``1 / (1 + exp(-x))``, whose bits do not depend on the element's offset in the tensor.
    ``x`` any float dtype and shape; returns the same."""
    return 1 / (1 + torch.exp(-x))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _scale_query(q: torch.Tensor) -> torch.Tensor:
    return q / (q.shape[-1] ** 0.5)


@dataclass(frozen=True)
class DeltaRuleForm:
    """What two invariant delta rules differ in besides the decay's shape (:func:`delta_rule_step` takes a decay per
    head or per key channel): the l2-norm of ``q`` and ``k`` and the query's ``1 / sqrt(Dk)`` scaling, each written as
    its upstream writes it (``rsqrt`` then a product, or a division; a division by ``sqrt(Dk)`` or a product with its
    reciprocal: other float32 bits), and the rule's name for the float32-state error."""

    name: str
    l2norm: Callable[[torch.Tensor], torch.Tensor]
    scale_query: Callable[[torch.Tensor], torch.Tensor]


#: The gated delta net's form (``l2norm`` and the query scaling of ``torch_recurrent_gated_delta_rule``).
GATED_DELTA = DeltaRuleForm("gated delta rule", _l2norm, _scale_query)


def _heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """``[..., Hk, D]`` -> float32 ``[..., Hv, D]``, each query/key head serving ``Hv // Hk`` consecutive value
    heads."""
    x = x.float()
    return x if x.shape[-2] == num_v_heads else x.repeat_interleave(num_v_heads // x.shape[-2], dim=-2)


def _step(form: DeltaRuleForm, state_vk, q, k, v, g, beta, l2norm: bool) -> torch.Tensor:
    """One token in place on the value-major float32 state ``[B, H, Dv, Dk]``: ``q`` / ``k`` ``[B, H, Dk]``,
    ``v`` ``[B, H, Dv]``, ``g`` ``[B, H, 1]`` or ``[B, H, Dk]``, ``beta`` ``[B, H]``, all float32; returns ``o``
    ``[B, H, Dv]`` float32."""
    if l2norm:
        q, k = form.l2norm(q), form.l2norm(k)
    q = form.scale_query(q)
    state_vk.mul_(torch.exp(g)[..., None, :])
    kv_mem = (state_vk * k[..., None, :]).sum(-1)
    delta = (v - kv_mem) * beta[..., None]
    state_vk.add_(delta[..., :, None] * k[..., None, :])
    return (state_vk * q[..., None, :]).sum(-1)


def delta_rule_step(form: DeltaRuleForm, state: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, use_qk_l2norm: bool) -> torch.Tensor:
    """The token step :func:`gated_delta_rule_step_invariant` and
    :func:`~hf_hybridcache.kernels.kda_invariant.kda_step_invariant` share, in place on ``state``
    ``[B, H, Dk, Dv]`` float32: ``query`` / ``key`` ``[B, H, Dk]`` (heads already repeated up to ``H``), ``value``
    ``[B, H, Dv]``, the log decay ``g`` ``[B, H, 1]`` (one per head) or ``[B, H, Dk]`` (one per key channel), ``beta``
    ``[B, H]``, any float dtype; returns ``o`` ``[B, H, Dv]`` float32.

    Raises:
        ValueError: ``state`` is not float32.
    """
    if state.dtype != torch.float32:
        raise ValueError(f"The recurrent state must be float32 for the invariant {form.name}; got {state.dtype}.")
    work = state.transpose(-1, -2).contiguous()
    out = _step(form, work, query.float(), key.float(), value.float(), g.float(), beta.float(), use_qk_l2norm)
    state.copy_(work.transpose(-1, -2))
    return out


def delta_rule_scan(form: DeltaRuleForm, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None, use_qk_l2norm: bool,
                    emit_positions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The token loop :func:`gated_delta_rule_scan_invariant` and
    :func:`~hf_hybridcache.kernels.kda_invariant.kda_scan_invariant` share: the step of :func:`delta_rule_step` once
    per token on contiguous token-major slices (as a decode step reads them), the state value-major while it runs.
    ``query`` / ``key`` ``[B, T, H, Dk]`` (heads already repeated up to ``H``), ``value`` ``[B, T, H, Dv]``, ``g``
    ``[B, T, H, 1]`` or ``[B, T, H, Dk]``, ``beta`` ``[B, T, H]``, any float dtype; ``initial_state``
    ``[B, H, Dk, Dv]`` or None for zeros. Returns ``(out [B, T, H, Dv] float32, final state, [state per emit
    position])``, the states ``[B, H, Dk, Dv]`` float32 and new tensors.

    Raises:
        ValueError: ``emit_positions`` out of range or not strictly increasing.
    """
    batch, seq_len, num_heads, v_dim = value.shape
    emit = set(check_emit_positions(emit_positions, seq_len))
    if initial_state is None:
        work = torch.zeros(batch, num_heads, v_dim, key.shape[-1], dtype=torch.float32, device=value.device)
    else:
        work = initial_state.float().transpose(-1, -2).contiguous()
    q_t, k_t, v_t, g_t, b_t = (x.float().transpose(0, 1).contiguous() for x in (query, key, value, g, beta))
    outputs, emitted = [], []
    for t in range(seq_len):
        outputs.append(_step(form, work, q_t[t], k_t[t], v_t[t], g_t[t], b_t[t], use_qk_l2norm))
        if t + 1 in emit:
            emitted.append(work.transpose(-1, -2).contiguous())
    return torch.stack(outputs, dim=1), work.transpose(-1, -2).contiguous(), emitted


def gated_delta_rule_step_invariant(
    state: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One token of the gated delta rule, in place on ``state``: ``S <- exp(g) S``,
    ``S <- S + k^T (beta (v - k S))``, ``o = q S / sqrt(Dk)`` (``q``, ``k`` l2-normalized first), in an order that
    makes a row's result independent of the other rows and of how the token arrived.

    Args:
        state: ``[B, Hv, Dk, Dv]`` float32 (the cache's layout), updated in place.
        query, key: ``[B, Hk, Dk]``; value: ``[B, Hv, Dv]``; any float dtype (float32 inside).
        g: log decay ``[B, Hv]`` (<= 0); beta: write strength ``[B, Hv]``; any float dtype.
        use_qk_l2norm: l2-normalize ``q`` and ``k`` (as upstream's ``use_qk_l2norm_in_kernel``).

    Returns:
        ``o`` ``[B, Hv, Dv]`` in ``query``'s dtype.

    Raises:
        ValueError: ``state`` is not float32.
    """
    num_v_heads = value.shape[-2]
    out = delta_rule_step(GATED_DELTA, state, _heads(query, num_v_heads), _heads(key, num_v_heads), value,
                          g.unsqueeze(-1), beta, use_qk_l2norm)
    return out.to(query.dtype)


def gated_delta_rule_scan_invariant(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    emit_positions: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The gated delta rule as one step of :func:`gated_delta_rule_step_invariant` per token: equal to
    :func:`~hf_hybridcache.kernels.chunk_gated_delta_rule` within float32 round-off (and the rounding of the output to
    the input dtype), and bit for bit to running the tokens as steps, one call per token or in any split.

    Args:
        query, key: ``[B, T, Hk, Dk]``; value: ``[B, T, Hv, Dv]``; g, beta: ``[B, T, Hv]``; any float dtype.
        initial_state: ``[B, Hv, Dk, Dv]`` (float32 is exact) or None for a zero state.
        use_qk_l2norm: as :func:`gated_delta_rule_step_invariant`.
        emit_positions: strictly increasing token counts in ``[1, T]``; the state after each is returned.

    Returns:
        ``(out [B, T, Hv, Dv] in query's dtype, final state [B, Hv, Dk, Dv] float32, [state [B, Hv, Dk, Dv] float32
        per emit position])``; the states are new tensors.

    Raises:
        ValueError: ``emit_positions`` out of range or not strictly increasing; ``Hv`` not a multiple of ``Hk``.
    """
    num_v_heads, num_k_heads = value.shape[-2], key.shape[-2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value has {num_v_heads} heads, which is not a multiple of the {num_k_heads} query/key "
                         "heads; each query/key head must serve the same number of value heads.")
    out, state, emitted = delta_rule_scan(GATED_DELTA, _heads(query, num_v_heads), _heads(key, num_v_heads), value,
                                          g.unsqueeze(-1), beta, initial_state, use_qk_l2norm, emit_positions)
    return out.to(query.dtype), state, emitted


def gated_rms_norm_after_invariant(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                                   eps: float, float32_weight: bool = False) -> torch.Tensor:
    """The gated delta net's gated RMSNorm, ``(weight * rmsnorm(y)) * silu(gate)``: normed in float32, rounded to
    ``y``'s dtype before the weight, gated in float32 and rounded once more, as ``Qwen3_5RMSNormGated.forward``
    (transformers 5.23.0 - 5.25.0; ``Qwen3NextRMSNormGated`` and ``OlmoHybridRMSNormGated`` alike) computes it, with
    the gate's silu taken from ``exp`` (bitwise the same at any offset in the tensor). ``float32_weight``: the weight
    taken in float32 on the unrounded float32 row, rounded once at the end (``LaraMiniRMSNormGated``, 5.24.0 - 5.25.0).

    Args:
        y: ``[..., Dv]`` (the rule's output; any float dtype); gate: ``[..., Dv]``, any float dtype.
        weight: ``[Dv]``; eps: the variance epsilon.

    Returns:
        ``[..., Dv]`` in ``y``'s dtype.
    """
    input_dtype = y.dtype
    hidden = y.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    hidden = weight.float() * hidden if float32_weight else weight * hidden.to(input_dtype)
    return (hidden * silu_invariant(gate.float())).to(input_dtype)
