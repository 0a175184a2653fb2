"""Kimi delta attention (KDA) with one arithmetic for a token, however it arrives (issue 46, an ingredient of
deterministic mode; wired in :mod:`hf_hybridcache.models.kda_deterministic`).

KDA is the gated delta rule with a decay per key channel (:mod:`.kda`). Its chunked form
(:func:`~hf_hybridcache.kernels.chunk_kimi_delta_attention`: matrix products over a 64-token grid that starts where
the call starts) and its recurrence (:func:`~hf_hybridcache.kernels.recurrent_kimi_delta_attention`, whose sums run
over the key dim of a ``[Dk, Dv]`` state, not its last dim) give the same token other float32 bits in a prefill, a
prefill starting elsewhere and a decode step; :func:`~hf_hybridcache.kernels.kimi_delta_steps` sums with ``matmul``,
whose float32 result for a row follows the row count.

As for the gated delta rule, a prefill here *is* a sequence of decode steps: :func:`kda_scan_invariant` runs the
step of :func:`kda_step_invariant` once per token on contiguous token-major slices (step and loop are
:func:`~.gated_delta_invariant.delta_rule_step` and :func:`~.gated_delta_invariant.delta_rule_scan`, in the
:data:`KDA` form), the state held value-major (``[Dv, Dk]`` per head) while it runs, so ``k S``, ``q S`` and the
l2-norms of ``q`` and ``k`` are sums over the contiguous key dim of one row (no ``bmm`` / ``matmul``), and the decay
``exp(g)`` ``[Dk]`` scales the state's last dim elementwise. A token's output and state are then the same bits in a
prefill at any offset, a split prompt or a decode step, whatever rows share the call. The states taken and returned
keep the package's layout ``[B, H, Dk, Dv]`` (the cache's); transposing is a copy, exact.

The l2-norm is KDA's own, ``x / sqrt(sum x^2 + eps)`` (``l2norm`` of ``modeling_kimi_linear.py``, a division where
the gated delta net multiplies by ``rsqrt``), and so is the query scaling, a product with ``1 / sqrt(Dk)`` where the
gated delta net divides.

Shapes: B rows, T tokens, H heads (query, key and value alike: KDA has no grouped heads), Dk key head dim, Dv value
head dim. Source: Kimi Team, "Kimi Linear: An Expressive, Efficient Attention Architecture" (2025); the recurrence of
``recurrent_kimi_delta_attention`` in ``transformers/models/kimi_linear/modeling_kimi_linear.py`` (5.23.0 - 5.25.0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .gated_delta_invariant import DeltaRuleForm, delta_rule_scan, delta_rule_step

#: The epsilon of upstream's ``l2norm`` of ``q`` and ``k``.
L2NORM_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _scale_query(q: torch.Tensor) -> torch.Tensor:
    return q * (1 / (q.shape[-1] ** 0.5))


#: KDA's form of the shared step (``l2norm`` and the query scaling of ``recurrent_kimi_delta_attention``).
KDA = DeltaRuleForm("KDA rule", _l2norm, _scale_query)


def kda_step_invariant(
    state: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One token of KDA, in place on ``state``: ``S <- diag(exp(g)) S``, ``S <- S + k^T (beta (v - k S))``,
    ``o = q S / sqrt(Dk)`` (``q``, ``k`` l2-normalized first), in an order that makes a row's result independent of
    the other rows and of how the token arrived.

    Args:
        state: ``[B, H, Dk, Dv]`` float32 (the cache's layout), updated in place.
        query, key: ``[B, H, Dk]``; value: ``[B, H, Dv]``; any float dtype (float32 inside).
        g: log decay per key channel ``[B, H, Dk]`` (<= 0); beta: write strength ``[B, H]``; any float dtype.
        use_qk_l2norm: l2-normalize ``q`` and ``k`` (as upstream's ``use_qk_l2norm_in_kernel``).

    Returns:
        ``o`` ``[B, H, Dv]`` in ``query``'s dtype.

    Raises:
        ValueError: ``state`` is not float32.
    """
    return delta_rule_step(KDA, state, query, key, value, g, beta, use_qk_l2norm).to(query.dtype)


def kda_scan_invariant(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    emit_positions: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """KDA as one step of :func:`kda_step_invariant` per token: equal to
    :func:`~hf_hybridcache.kernels.chunk_kimi_delta_attention` within float32 round-off (and the rounding of the
    output to the input dtype), and bit for bit to running the tokens as steps, one call per token or in any split.

    Args:
        query, key, g: ``[B, T, H, Dk]``; value: ``[B, T, H, Dv]``; beta: ``[B, T, H]``; any float dtype.
        initial_state: ``[B, H, Dk, Dv]`` (float32 is exact) or None for a zero state.
        use_qk_l2norm: as :func:`kda_step_invariant`.
        emit_positions: strictly increasing token counts in ``[1, T]``; the state after each is returned.

    Returns:
        ``(out [B, T, H, Dv] in query's dtype, final state [B, H, Dk, Dv] float32, [state [B, H, Dk, Dv] float32
        per emit position])``; the states are new tensors.

    Raises:
        ValueError: ``emit_positions`` out of range or not strictly increasing; query, key and value heads differ.
    """
    num_heads = value.shape[-2]
    if query.shape[-2] != num_heads or key.shape[-2] != num_heads:
        raise ValueError(f"KDA takes as many query and key heads as value heads; got {query.shape[-2]}, "
                         f"{key.shape[-2]} and {num_heads}.")
    out, state, emitted = delta_rule_scan(KDA, query, key, value, g, beta, initial_state, use_qk_l2norm,
                                          emit_positions)
    return out.to(query.dtype), state, emitted


def sigmoid_gated_rms_norm_invariant(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                                     eps: float) -> torch.Tensor:
    """KDA's output norm, ``weight * rmsnorm(y) * sigmoid(gate)`` all in float32 and rounded once to ``y``'s dtype,
    as ``KimiLinearRMSNormGated.forward`` / ``BailingHybridRMSNormGated.forward`` (transformers 5.23.0 - 5.25.0)
    compute it, with the sigmoid as ``1 / (1 + exp(-x))`` (``torch.sigmoid`` gives a float32 element other bits by
    its offset in the tensor).

    Args:
        y: ``[..., Dv]`` (the rule's output; any float dtype); gate: ``[..., Dv]``, any float dtype.
        weight: ``[Dv]``; eps: the variance epsilon.

    Returns:
        ``[..., Dv]`` in ``y``'s dtype.
    """
    hidden = y.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    hidden = weight.float() * hidden
    return (hidden * (1 / (1 + torch.exp(-gate.float())))).to(y.dtype)
