"""The gated delta net mixer forward of deterministic mode (issue 46): one function for a prefill, a chunk of one, a
decode step and a speculative verify group, whose every op gives a token's row the same bits whatever shares its call
and however the token arrived.

It is ``Qwen3_5GatedDeltaNet.forward`` (``transformers/models/qwen3_5/modeling_qwen3_5.py``, 5.23.0 - 5.25.0;
Qwen3.5-MoE's is the same, Qwen3-Next's differs only in its fused projections; OLMo-Hybrid's
``OlmoHybridGatedDeltaNet`` in its separate projections, its beta and its names; Lara Mini's ``LaraMiniGatedDeltaNet``
in its gated norm's float32 weight) with each op replaced by its row-invariant ingredient:

- ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (Qwen3-Next: ``in_proj_qkvz``, ``in_proj_ba``;
  OLMo-Hybrid: ``q_proj``, ``k_proj``, ``v_proj`` concatenated, ``g_proj`` the norm's gate, ``b_proj``, ``a_proj``)
  and ``out_proj`` (OLMo-Hybrid: ``o_proj``) through
  :func:`~hf_hybridcache.kernels.batch_invariant.invariant_linear` (as :mod:`.mamba1_deterministic` runs them);
- the causal conv over ``q|k|v`` through :func:`~hf_hybridcache.kernels.conv_invariant.causal_conv_invariant`, for a
  prefill over the cached window and for a decode step alike;
- ``beta = sigmoid(b)`` through :func:`~hf_hybridcache.kernels.gated_delta_invariant.sigmoid_invariant` in float32,
  rounded to ``b``'s dtype as upstream's ``b.sigmoid()`` is (doubled, exactly, where OLMo-Hybrid's
  ``allow_neg_eigval`` lets the write strength reach 2), and the decay ``g = -exp(A_log) softplus(a + dt_bias)``
  with :func:`~hf_hybridcache.kernels.mamba1_invariant.softplus_invariant` (``torch.sigmoid`` and ``F.softplus`` give
  an element other float32 bits by its offset in the tensor);
- the rule through :func:`~hf_hybridcache.kernels.gated_delta_invariant.gated_delta_rule_scan_invariant`, whose
  prefill is the decode step's own arithmetic per token (l2-norms of ``q`` and ``k`` inside the step);
- the gated RMSNorm (``norm``; OLMo-Hybrid: ``o_norm``) through
  :func:`~hf_hybridcache.kernels.gated_delta_invariant.gated_rms_norm_after_invariant` (Lara Mini's weight applied in
  float32 before any rounding, as ``LaraMiniRMSNormGated`` does).

The padding mask (on the input only, as upstream), the states' dtypes and what reaches the cache (the conv window of
the ``q|k|v`` inputs, the float32 state ``[B, Hv, Dk, Dv]``, the checkpoints after ``positions`` tokens) are those of
:mod:`.linear_attention`.

:data:`_OFF` is the private switch of the power tests: an ingredient named there runs the package's default op instead
(``"linear"``: ``F.linear``; ``"conv"``: :func:`~hf_hybridcache.models.mamba1.causal_conv` / the fused conv update;
``"rule"``: the chunked rule / the recurrent step; ``"norm"``: the mixer's own gated norm (``Qwen3_5RMSNormGated``,
``OlmoHybridRMSNormGated``, ...); ``"gates"``: ``torch.sigmoid`` / ``F.softplus``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _compat
from ..kernels import chunk_gated_delta_rule, recurrent_gated_delta_rule
from ..kernels.gated_delta_invariant import (
    gated_delta_rule_scan_invariant,
    gated_delta_rule_step_invariant,
    gated_rms_norm_after_invariant,
    sigmoid_invariant,
)
from ..kernels.mamba1_invariant import softplus_invariant
from . import mamba1_deterministic
from .deterministic_linear import DeltaRule, cached_states, conv_over_cache, delta_rule_over_cache, routed_linear
from .mamba1 import apply_padding_mask, conv_states_at
from .mamba1_deterministic import lm_head_forward  # noqa: F401 (deterministic.install reads it from here)

#: The gated norms that apply their weight in float32 before rounding (``LaraMiniRMSNormGated``); the others round the
#: normed row to the input dtype first (``Qwen3_5RMSNormGated``, ``OlmoHybridRMSNormGated``).
FLOAT32_WEIGHT_NORMS = ("LaraMiniRMSNormGated",)
#: Ingredients switched off (private: the power tests name them here; empty in use).
_OFF: set[str] = set()
#: The rule's invariant kernels and the defaults its ``"rule"`` switch runs.
_RULE = DeltaRule(gated_delta_rule_step_invariant, gated_delta_rule_scan_invariant, recurrent_gated_delta_rule,
                  chunk_gated_delta_rule)


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # mamba1_deterministic's switch also holds these products (its "linear" switches every mixer built on it)
    return routed_linear(x, weight, off=_OFF | mamba1_deterministic._OFF)


@_compat.force_accelerate_hooks(["conv1d"])
def deterministic_forward(mixer, hidden_states: torch.Tensor, cache, attention_mask: torch.Tensor | None):
    """The mixer's output ``[B, T, hidden]`` (the dtype of ``hidden_states`` ``[B, T, hidden]``) for ``T >= 1`` tokens
    over ``cache`` (one of this package's caches: it answers ``checkpoint_positions``), continuing from its conv and
    recurrent states (zeros where it holds none) and leaving the states after the last token there: a decode step
    (``T == 1`` over a held state) updates them in place. ``attention_mask``: ``[B, T]`` (1 keeps a token) or None.

    Raises:
        ValueError: the cached recurrent state is not float32 (from the invariant rule).
    """
    batch, seq_len, _ = hidden_states.shape
    layer_idx = mixer.layer_idx
    conv_state, recurrent_state, decode, positions = cached_states(cache, layer_idx, seq_len)
    hidden_states = apply_padding_mask(hidden_states, attention_mask)
    mixed_qkv, z, b, a = _projections(mixer, hidden_states)
    conv_checkpoints = conv_states_at(mixed_qkv, conv_state, mixer.conv_kernel_size, positions)
    mixed_qkv = conv_over_cache(mixed_qkv, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.activation,
                                conv_state, cache, layer_idx, mixer.conv_kernel_size, decode, off=_OFF).transpose(1, 2)
    query, key, value = torch.split(mixed_qkv, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    query = query.reshape(batch, seq_len, -1, mixer.head_k_dim)
    key = key.reshape(batch, seq_len, -1, mixer.head_k_dim)
    value = value.reshape(batch, seq_len, -1, mixer.head_v_dim)
    beta, g = _gates(mixer, b, a)
    out = delta_rule_over_cache(_RULE, query, key, value, g, beta, recurrent_state, cache, layer_idx, decode, positions,
                                conv_checkpoints, off=_OFF)
    out = _gated_norm(mixer, out.reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim))
    out_proj = mixer.o_proj if hasattr(mixer, "o_proj") else mixer.out_proj  # OLMo-Hybrid's name
    return _linear(out.reshape(batch, seq_len, -1), out_proj.weight)


def _projections(mixer, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(q|k|v conv inputs [B, C, T], z [B, T, Hv * Dv] or [B, T, Hv, Dv], b [B, T, Hv], a [B, T, Hv])`` of
    ``hidden_states`` ``[B, T, hidden]``: Qwen3.5's four projections (Lara Mini's alike), Qwen3-Next's fused
    ``in_proj_qkvz`` / ``in_proj_ba`` regrouped by the mixer's own ``fix_query_key_value_ordering`` (views and splits:
    exact), or OLMo-Hybrid's six (``q|k|v`` concatenated as upstream does, ``g_proj`` as the gate ``z``)."""
    if hasattr(mixer, "in_proj_qkvz"):
        query, key, value, z, b, a = mixer.fix_query_key_value_ordering(
            _linear(hidden_states, mixer.in_proj_qkvz.weight), _linear(hidden_states, mixer.in_proj_ba.weight))
        mixed_qkv = torch.cat([x.reshape(*x.shape[:2], -1) for x in (query, key, value)], dim=-1)
        return mixed_qkv.transpose(1, 2), z, b, a
    if hasattr(mixer, "g_proj"):
        mixed_qkv = torch.cat([_linear(hidden_states, proj.weight) for proj in (mixer.q_proj, mixer.k_proj,
                                                                                 mixer.v_proj)], dim=-1)
        return (mixed_qkv.transpose(1, 2), _linear(hidden_states, mixer.g_proj.weight),
                _linear(hidden_states, mixer.b_proj.weight), _linear(hidden_states, mixer.a_proj.weight))
    return (_linear(hidden_states, mixer.in_proj_qkv.weight).transpose(1, 2),
            _linear(hidden_states, mixer.in_proj_z.weight), _linear(hidden_states, mixer.in_proj_b.weight),
            _linear(hidden_states, mixer.in_proj_a.weight))


def _gates(mixer, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(beta [B, T, Hv] in b's dtype, g [B, T, Hv] float32)`` from the projections ``b`` / ``a`` ``[B, T, Hv]``;
    beta doubled where the mixer has OLMo-Hybrid's ``allow_neg_eigval`` (a power of two: exact in any dtype)."""
    if "gates" in _OFF:
        beta, g = b.sigmoid(), -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)
    else:
        beta = sigmoid_invariant(b.float()).to(b.dtype)
        g = -mixer.A_log.float().exp() * softplus_invariant(a.float() + mixer.dt_bias)
    if getattr(mixer, "allow_neg_eigval", False):
        beta = beta * 2.0
    return beta, g


def _gated_norm(mixer, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``y`` ``[N, Dv]`` normed per row, weighted and gated by ``gate`` ``[N, Dv]`` -> ``[N, Dv]``."""
    norm = mixer.o_norm if hasattr(mixer, "o_norm") else mixer.norm  # OLMo-Hybrid's name
    if "norm" in _OFF:
        return norm(y, gate)
    return gated_rms_norm_after_invariant(y, gate, norm.weight, norm.variance_epsilon,
                                          float32_weight=type(norm).__name__ in FLOAT32_WEIGHT_NORMS)
