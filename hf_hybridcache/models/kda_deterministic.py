"""The Kimi delta attention (KDA) mixer forward of deterministic mode (issue 46): one function for a prefill, a chunk of
one, a decode step and a speculative verify group, whose every op gives a token's row the same bits whatever shares
its call and however the token arrived.

It is ``KimiLinearDeltaAttention.forward`` (``transformers/models/kimi_linear/modeling_kimi_linear.py``, 5.23.0 -
5.25.0) and ``BailingHybridDeltaAttention.forward`` (``models/bailing_hybrid/modeling_bailing_hybrid.py``, the same
forward with its own forget gate and output-gate projection) with each op replaced by its row-invariant ingredient:

- ``q_proj``, ``k_proj``, ``v_proj``, ``b_proj``, the forget gate's projections (Kimi: ``f_a_proj`` then
  ``f_b_proj``; Ling: ``f_proj``), the output gate's (Kimi: ``g_a_proj`` then ``g_b_proj``; Ling: ``g_proj``) and
  ``o_proj`` through :func:`~hf_hybridcache.kernels.batch_invariant.invariant_linear`;
- the causal conv over ``q|k|v`` through :func:`~hf_hybridcache.kernels.conv_invariant.causal_conv_invariant`, for a
  prefill over the cached window and for a decode step alike;
- ``beta = sigmoid(b)`` through :func:`~hf_hybridcache.kernels.gated_delta_invariant.sigmoid_invariant` in float32,
  rounded to ``b``'s dtype as upstream's ``torch.sigmoid(b)`` is; the forget gate in float32: Kimi's
  ``-exp(A_log) softplus(f + dt_bias)`` with :func:`~hf_hybridcache.kernels.mamba1_invariant.softplus_invariant`,
  Ling's bounded ("safe") ``lower_bound * sigmoid(exp(A_log) (f + dt_bias))`` with ``sigmoid_invariant`` (or its
  softplus form where ``kda_safe_gate`` is off), rounded to the model's dtype as its module does;
- the rule through :func:`~hf_hybridcache.kernels.kda_invariant.kda_scan_invariant`, whose prefill is the decode
  step's own arithmetic per token (l2-norms of ``q`` and ``k`` inside the step);
- the sigmoid-gated RMSNorm through :func:`~hf_hybridcache.kernels.kda_invariant.sigmoid_gated_rms_norm_invariant`.

The padding mask (on the input only, as upstream), the states' dtypes and what reaches the cache (the conv window of
the ``q|k|v`` inputs, the float32 state ``[B, H, Dk, Dv]``, the checkpoints after ``positions`` tokens) are those of
:mod:`.linear_attention` / :mod:`.kimi_delta`.

:data:`_OFF` is the private switch of the power tests: an ingredient named there runs the package's default op instead
(``"linear"``: ``F.linear``; ``"conv"``: :func:`~hf_hybridcache.models.mamba1.causal_conv` / the fused conv update;
``"rule"``: the chunked rule / the recurrent step; ``"norm"``: the mixer's own ``o_norm``; ``"gates"``:
``torch.sigmoid`` / ``F.softplus``; ``"attention_gate"``: Ling's attention output gate as ``torch.sigmoid``).

Ling's MLA attention (``BailingHybridAttention``) gates its heads' outputs with ``sigmoid(g_proj(x))``:
:func:`gated_mla_forward` is its forward with that sigmoid from ``exp``. Kimi Linear's MLA attention has no gate and
runs as upstream; both reach the invariant attention through their attention function (the expanded form: the
cached latent through ``kv_b_proj``, the row-invariant linear, then ``q k^T`` over the whole ``[nope | rope]`` head,
summed in :mod:`~hf_hybridcache.kernels.attention_invariant`'s fixed order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _compat
from .._compat.invariant_attention import gated_attention_parts
from ..kernels import chunk_kimi_delta_attention
from ..kernels.gated_delta_invariant import sigmoid_invariant
from ..kernels.kda import recurrent_kimi_delta_attention
from ..kernels.kda_invariant import kda_scan_invariant, kda_step_invariant, sigmoid_gated_rms_norm_invariant
from ..kernels.mamba1_invariant import softplus_invariant
from . import mamba1_deterministic
from .deterministic_linear import DeltaRule, cached_states, conv_over_cache, delta_rule_over_cache, routed_linear
from .mamba1 import apply_padding_mask, conv_states_at
from .mamba1_deterministic import lm_head_forward  # noqa: F401 (deterministic.install reads it from here)

#: Ingredients switched off (private: the power tests name them here; empty in use).
_OFF: set[str] = set()
#: The rule's invariant kernels and the defaults its ``"rule"`` switch runs.
_RULE = DeltaRule(kda_step_invariant, kda_scan_invariant, recurrent_kimi_delta_attention, chunk_kimi_delta_attention)


def _linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    # mamba1_deterministic's switch also holds these products (its "linear" switches every mixer built on it)
    return routed_linear(x, layer.weight, off=_OFF | mamba1_deterministic._OFF)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) if "gates" in _OFF else sigmoid_invariant(x)


def _softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x) if "gates" in _OFF else softplus_invariant(x)


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
    heads = (batch, seq_len, -1, mixer.head_dim)
    mixed_qkv = torch.cat([_linear(hidden_states, p) for p in (mixer.q_proj, mixer.k_proj, mixer.v_proj)], dim=-1)
    mixed_qkv = mixed_qkv.transpose(1, 2)
    conv_checkpoints = conv_states_at(mixed_qkv, conv_state, mixer.conv_kernel_size, positions)
    mixed_qkv = conv_over_cache(mixed_qkv, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.activation,
                                conv_state, cache, layer_idx, mixer.conv_kernel_size, decode, off=_OFF).transpose(1, 2)
    query, key, value = (x.reshape(heads) for x in torch.split(mixed_qkv, [mixer.qkv_dim] * 3, dim=-1))
    g = _forget_gate(mixer.forget_gate, hidden_states)
    b = _linear(hidden_states, mixer.b_proj)
    beta = _sigmoid(b.float()).to(b.dtype)
    out = delta_rule_over_cache(_RULE, query, key, value, g, beta, recurrent_state, cache, layer_idx, decode, positions,
                                conv_checkpoints, off=_OFF)
    gate = _output_gate(mixer, hidden_states).reshape(heads)
    return _linear(_norm(mixer, out, gate).reshape(batch, seq_len, -1), mixer.o_proj)


def _forget_gate(module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The log decay per key channel ``[B, T, H, Dk]`` of ``hidden_states`` ``[B, T, hidden]``: Kimi's
    ``KimiLinearForgetGate.forward`` (float32) or Ling's ``BailingHybridForgetGate.forward`` (rounded to the model's
    dtype), transformers 5.23.0 - 5.25.0."""
    shape = (*hidden_states.shape[:2], module.num_heads, module.head_dim)
    decay_rate = module.A_log.float().exp().reshape(1, 1, module.num_heads, 1)
    if hasattr(module, "f_a_proj"):  # Kimi Linear
        f = _linear(_linear(hidden_states, module.f_a_proj), module.f_b_proj)
        return -decay_rate * _softplus((f.float() + module.dt_bias.float().view(1, 1, -1)).view(shape))
    f = _linear(hidden_states, module.f_proj).float().view(shape) + module.dt_bias.view(1, 1, *shape[2:])
    if module.safe_gate:
        gate = module.lower_bound * _sigmoid(decay_rate * f)
    else:
        gate = -decay_rate * _softplus(f)
    return gate.to(hidden_states.dtype)


def _output_gate(mixer, hidden_states: torch.Tensor) -> torch.Tensor:
    """The output norm's gate ``[B, T, H * Dv]``: Kimi's ``g_b_proj(g_a_proj(x))`` or Ling's ``g_proj(x)``."""
    if hasattr(mixer, "g_a_proj"):
        return _linear(_linear(hidden_states, mixer.g_a_proj), mixer.g_b_proj)
    return _linear(hidden_states, mixer.g_proj)


def _norm(mixer, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``y`` ``[B, T, H, Dv]`` normed per head, weighted and gated by ``sigmoid(gate)`` ``[B, T, H, Dv]``."""
    if "norm" in _OFF:
        return mixer.o_norm(y, gate)
    return sigmoid_gated_rms_norm_invariant(y, gate, mixer.o_norm.weight, mixer.o_norm.variance_epsilon)


def gated_mla_forward(module: torch.nn.Module, original, hidden_states: torch.Tensor,
                      position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask=None, **kwargs):
    """Ling's MLA attention ``(output [B, T, hidden], None)`` for ``hidden_states`` ``[B, T, hidden]`` and the rotary
    ``(cos, sin)``: ``BailingHybridAttention.forward`` (transformers 5.23 - 5.25) with its head gate
    ``sigmoid(g_proj(x))`` from ``exp`` in float32, rounded to the model's dtype as upstream rounds it. The cache holds
    the normed latent (keys) and the rotated rope key (values) as upstream's; ``kv_b_proj`` expands them on every call
    through the row-invariant linear, and the attention call goes through the model's attention function, which
    deterministic mode routes to the invariant attention."""
    cache, kwargs, apply_rotary, attention, update = gated_attention_parts(
        module, kwargs, rotary="apply_rotary_pos_emb_interleave")
    batch, seq_len = hidden_states.shape[:-1]
    if getattr(module, "q_lora_rank", None) is None:
        q_states = module.q_proj(hidden_states)
    else:
        q_states = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q_states = q_states.view(batch, seq_len, -1, module.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    kv_nope, k_rot = torch.split(module.kv_a_proj_with_mqa(hidden_states),
                                 [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    kv_nope = module.kv_a_layernorm(kv_nope).view(batch, 1, seq_len, module.kv_lora_rank)
    k_rot = k_rot.view(batch, 1, seq_len, module.qk_rope_head_dim)
    q_rot, k_rot = apply_rotary(q_rot, k_rot, *position_embeddings)
    if cache is not None:
        kv_nope, k_rot = update(kv_nope, k_rot)
    key, value = module.expand_kv(kv_nope, k_rot)
    dropout = module.attention_dropout if module.training else 0.0
    out, _ = attention(module, torch.cat((q_pass, q_rot), dim=-1), key, value, attention_mask, dropout=dropout,
                       scaling=module.scaling, **kwargs)
    gate_logit = module.g_proj(hidden_states).float()
    gate = torch.sigmoid(gate_logit) if "attention_gate" in _OFF else sigmoid_invariant(gate_logit)
    out = out * gate.to(hidden_states.dtype).unsqueeze(-1)
    return module.o_proj(out.reshape(batch, seq_len, -1).contiguous()), None
