"""Inkling 2's and Inkling 2 Loop's layers in deterministic mode (issue 46): their short convolutions, static and
dynamic, their attention's l2 clips, relative bias, sink logits and output gate, their softcaps, their block attention
residuals and the Loop's message gates and message residuals.

Upstream: ``transformers/models/inkling2/modeling_inkling2.py``, 5.23.0 - 5.25.0, in two layouts. In 5.23 the
attention modules (``Inkling2SlidingAttention``, ``Inkling2FullAttention``) hold their projections, short convs, clips
and gate themselves and gate their output inline; from 5.24 on those sit in ``Inkling2QueryProjection`` /
``Inkling2KeyValueProjection`` / ``Inkling2RelativePositionBias`` / ``Inkling2GatedOutputProjection`` modules and the
attention forwards call them. Each op runs in a form whose bits do not depend on the rows beside it or on the path:

- ``Inkling2ShortConvolution`` (after the attention and the MLP, and on the sliding layers' keys and values) runs
  :func:`deterministic_forward`: upstream's float32 depthwise conv plus residual, scaled by ``1 / sqrt(W + 1)``, the
  conv through :func:`~hf_hybridcache.models.deterministic_linear.conv_over_cache`; ``Inkling2DynamicShortConvolution``
  (the full layers' keys and values) the same with per-token taps projected from the layer input
  (:func:`~hf_hybridcache.kernels.conv_invariant.dynamic_conv_invariant`, scaled by ``1 / sqrt(2 W + 1)``). Both keep
  the window of raw float32 inputs upstream keeps, in a loop pass's own cache layer where the call names one.
- The l2 clips (``Inkling2L2Clip``, ``Inkling2ScaledL2Clip``: keys, queries, relative states) run as
  :func:`~hf_hybridcache.kernels.inkling2_invariant.l2_clip_invariant` (``torch.linalg.vector_norm`` not measured);
  the relative bias's product ``relative_states @ proj`` through the row-invariant linear; the output gate's sigmoid
  as :func:`~hf_hybridcache.kernels.gated_delta_invariant.sigmoid_invariant`; the softcaps (the final logits', the
  experts' SwiGLU) as :mod:`~hf_hybridcache.kernels.inkling2_invariant`'s; a block attention residual as
  :func:`~hf_hybridcache.kernels.inkling2_invariant.block_residual_invariant` over upstream's normed stack.
- The attention call itself (with the relative bias and the sink logits) reaches the invariant attention through
  :mod:`.hybrid_deterministic`'s mark; the experts block runs
  :func:`~hf_hybridcache.models.moe_deterministic.inkling2_moe_forward`. RMSNorms, the logarithmic scaling
  (float32 ``torch.log`` of the positions, measured the same bits at any offset for Inkling) and the residual adds run
  as upstream.
- Inkling 2 Loop (``models/inkling2_loop/modeling_inkling2_loop.py``, 5.24.0 - 5.25.0, the later layout) holds its own
  copies of these modules, which run the same forms; its message gates (``Inkling2LoopMessageGate``) take their two
  ``tanh`` as the softcap of 1, its message residuals (``Inkling2LoopMessageAttentionResidual``) the block residual.

:data:`_OFF` is the private switch of the power tests; each name runs upstream's op in place of this module's:
``"l2_clip"``, ``"relative"``, ``"gate"``, ``"softcap"`` (the final logits', the message gates'), ``"swiglu"``,
``"block_residual"`` (the message residuals too).
"""

from __future__ import annotations

import math

import torch

from .. import _compat
from .._compat.invariant_attention import gated_attention_parts, mark
from ..kernels.conv_invariant import dynamic_conv_invariant
from ..kernels.gated_delta_invariant import sigmoid_invariant
from ..kernels.inkling2_invariant import (
    block_residual_invariant,
    l2_clip_invariant,
    softcap_invariant,
    softcapped_swiglu_invariant,
)
from .deterministic_linear import conv_over_cache
from .inkling_deterministic import short_conv_call
from .mamba1_deterministic import linear as _linear
from .mamba1_deterministic import lm_head_forward  # noqa: F401 (deterministic.install reads it from here)

#: The short convolution classes :func:`deterministic_forward` stands in for (Inkling 2's, Inkling 2 Loop's).
MIXERS = ("Inkling2ShortConvolution", "Inkling2DynamicShortConvolution")
LOOP_MIXERS = ("Inkling2LoopShortConvolution", "Inkling2LoopDynamicShortConvolution")
#: model_type -> (its attention classes, its experts block class): :mod:`.hybrid_deterministic`'s ``FAMILIES``
#: entries (:func:`install` marks both attention classes).
FAMILIES = {"inkling2_text": (("Inkling2SlidingAttention", "Inkling2FullAttention"), "Inkling2SparseMoeBlock"),
            "inkling2_loop_text": (("Inkling2LoopSlidingAttention", "Inkling2LoopFullAttention"),
                                   "Inkling2LoopSparseMoeBlock")}
#: Ingredients switched off (private: the power tests name them here; empty in use).
_OFF: set[str] = set()


def install(model: torch.nn.Module, attention_forward) -> None:
    """Patch ``model``'s Inkling 2 modules (:data:`FORWARDS`) and answer its attention modules' calls with
    ``attention_forward`` (:mod:`.hybrid_deterministic`'s, the invariant attention); idempotent, nothing on a model of
    another family (called for every hybrid, after :func:`refusals` came back empty)."""
    classes = {name for attention, _ in FAMILIES.values() for name in attention}
    for module in model.modules():
        if type(module).__name__ in FORWARDS:
            _compat.patch_instance_forward(module, FORWARDS[type(module).__name__])
    attention = [m for m in model.modules() if type(m).__name__ in classes]
    if attention:
        mark(model, attention, attention_forward)


def refusals(model_type: str, config) -> list[str]:
    """What keeps a model of ``model_type`` (Inkling 2's and its Loop's; no other's) with the text ``config`` from
    deterministic mode beyond its layers' kinds; empty when none."""
    scoring = getattr(config, "scoring_func", "sigmoid")
    if model_type not in ("inkling2_text", "inkling2_loop_text") or scoring == "sigmoid":
        return []
    return [f"scoring_func={scoring!r} (its experts' router has an invariant form for 'sigmoid' only)"]


def deterministic_forward(mixer, hidden_states: torch.Tensor, cache, attention_mask: torch.Tensor | None,
                          dynamic_input: torch.Tensor | None = None, layer_idx: int | None = None) -> torch.Tensor:
    """A short convolution's output ``[B, T, C]`` (the dtype of ``hidden_states`` ``[B, T, C]``) for ``T >= 1``
    tokens over ``cache`` (one of this package's caches), continuing from the window its ``conv_idx`` keeps in cache
    layer ``layer_idx`` (the mixer's own by default; zeros where none) and leaving the window after the last token:
    in place on a decode step. ``attention_mask``: the padding mask ``[B, T]`` or None; ``dynamic_input``
    ``[B, T, hidden]``: a dynamic conv's tap input (the layer input of its projection)."""
    call = short_conv_call(mixer, hidden_states, cache, attention_mask, layer_idx)
    if hasattr(mixer, "static_weight"):  # the dynamic conv
        batch, seq_len = hidden_states.shape[:2]
        taps = mixer.weight_proj(dynamic_input).float().view(batch, seq_len, mixer.num_heads, call.width)
        out, window = dynamic_conv_invariant(call.x, mixer.static_weight, taps, call.conv_state)
        if call.decode:
            call.conv_state.copy_(window)
            _compat.count_decode_token(cache, call.layer_idx, state_idx=call.state_idx)
        else:
            cache.update_conv_state(call.x, call.layer_idx, state_idx=call.state_idx, conv_kernel_size=call.width)
        scale = math.sqrt(2 * call.width + 1)
    else:
        out = conv_over_cache(call.x, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, None, call.conv_state, cache,
                              call.layer_idx, call.width, call.decode, state_idx=call.state_idx)
        scale = math.sqrt(call.width + 1)
    call.capture(cache)
    # Contiguous, as Inkling's: the sum takes the transposed conv output's strides in a prefill.
    return ((out.transpose(1, 2) + call.residual) / scale).to(hidden_states.dtype).contiguous()


deterministic_forward.takes_call_inputs = True  # models/linear_attention.py hands it the tap input and cache layer


def l2_clip_forward(module, original, hidden_states: torch.Tensor, position_ids=None) -> torch.Tensor:
    """``Inkling2L2Clip`` / ``Inkling2ScaledL2Clip`` ``[..., D]`` -> ``[..., D]`` (the input's dtype)."""
    if "l2_clip" in _OFF:
        return original(hidden_states) if position_ids is None else original(hidden_states, position_ids)
    return l2_clip_invariant(hidden_states, module.threshold, getattr(module, "scale", None))


def _bias_from(relative: torch.Tensor, proj: torch.Tensor, rel_extent: int, distance: torch.Tensor) -> torch.Tensor:
    """The relative bias ``[B, H, Tq, K]`` of ``relative`` ``[B, Tq, H, d_rel]`` for ``distance`` ``[Tq, K]``:
    ``relative @ proj`` gathered by distance, zero outside ``0 <= distance < rel_extent`` (upstream's)."""
    rel_logits = _linear(relative, proj.T.contiguous()).transpose(1, 2)
    index = distance.clamp(0, rel_extent - 1).expand(*rel_logits.shape[:2], -1, -1)
    return rel_logits.gather(-1, index).masked_fill((distance < 0) | (distance >= rel_extent), 0.0)


def relative_bias_forward(module, original, hidden_states: torch.Tensor, relative_distance: torch.Tensor,
                          position_ids: torch.Tensor) -> torch.Tensor:
    """``Inkling2RelativePositionBias`` (5.24 - 5.25): ``[B, T, hidden]`` -> bias ``[B, H, T, K]``."""
    if "relative" in _OFF:
        return original(hidden_states, relative_distance, position_ids)
    relative = module.linear(hidden_states).view(*hidden_states.shape[:-1], module.num_heads, -1)
    return _bias_from(module.norm(relative, position_ids), module.proj, module.rel_extent, relative_distance)


def relative_logits_forward(module, original, relative_states: torch.Tensor, query_positions: torch.Tensor,
                            key_positions: torch.Tensor) -> torch.Tensor:
    """``Inkling2RelativeLogits`` (5.23): relative states ``[B, T, H, d_rel]`` -> bias ``[B, H, T, K]``."""
    if "relative" in _OFF:
        return original(relative_states, query_positions, key_positions)
    distance = (query_positions[:, None] - key_positions[None, :])[None, None]
    return _bias_from(relative_states, module.proj, module.rel_extent, distance)


def _gate(attn_output: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``attn_output * sigmoid(gate)`` in float32, rounded to ``attn_output``'s dtype (both ``[B, T, H * D]``)."""
    gate = torch.sigmoid(gate.float()) if "gate" in _OFF else sigmoid_invariant(gate.float())
    return (attn_output.float() * gate).to(attn_output.dtype)


def gated_output_forward(module, original, attn_output: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Inkling2GatedOutputProjection`` (5.24 - 5.25): ``[B, T, H * D]`` gated by the layer input -> ``[B, T, hidden]``."""
    return module.linear(_gate(attn_output, module.gate_proj(hidden_states)))


def softcap_forward(module, original, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Inkling2Softcap`` (the final logits'): ``cap * tanh(x / cap)`` from ``exp``."""
    if "softcap" in _OFF:
        return original(hidden_states)
    return softcap_invariant(hidden_states, module.softcap)


def swiglu_forward(module, original, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``Inkling2SoftcappedSwiGLU``: ``[..., I]`` twice -> ``[..., I]`` (``gate``'s dtype)."""
    if "swiglu" in _OFF:
        return original(gate, up)
    return softcapped_swiglu_invariant(gate, up, module.gate_softcap.softcap, module.up_softcap.softcap)


def block_residual_forward(module, original, block_states: torch.Tensor, partial_block_states: torch.Tensor):
    """``Inkling2BlockAttentionResidual``: the blocks' states ``[B, T, L, hidden]`` and the current one
    ``[B, T, hidden]`` -> one float32 ``[B, T, hidden]`` per learned query (a tuple)."""
    if "block_residual" in _OFF:
        return original(block_states, partial_block_states)
    stacked = module.norm(torch.cat([block_states, partial_block_states.unsqueeze(-2)], dim=-2).float())
    return block_residual_invariant(module.query, stacked, stacked.shape[-1] ** -0.5).unbind(-2)


def message_gate_forward(module, original, hidden_states: torch.Tensor, message: torch.Tensor) -> torch.Tensor:
    """``Inkling2LoopMessageGate`` (Inkling 2 Loop, 5.24 - 5.25): ``(1 - tanh(f)) * h + tanh(m) * message`` float32
    ``[B, T, hidden]``, its two ``tanh`` as the softcap of 1 from ``exp``."""
    if "softcap" in _OFF:
        return original(hidden_states, message)
    hidden_states, message = hidden_states.float(), message.float()
    gate_input = torch.cat([module.norm(hidden_states), module.norm(message)], dim=-1)
    gate_input = module.down_proj(gate_input.to(module.down_proj.weight.dtype)).float()
    forget = softcap_invariant(module.forget_gate_proj(gate_input), 1.0)
    keep = softcap_invariant(module.message_gate_proj(gate_input), 1.0)
    return (1 - forget) * hidden_states + keep * message


def message_residual_forward(module, original, block_states: torch.Tensor, partial_block_states: torch.Tensor,
                             loop_layer_idx: int) -> torch.Tensor:
    """``Inkling2LoopMessageAttentionResidual``: the previous pass's block states ``[B, T, L, hidden]`` and hidden
    states ``[B, T, hidden]`` -> its four messages ``[B, T, 4, hidden]`` float32 for loop layer ``loop_layer_idx``."""
    if "block_residual" in _OFF:
        return original(block_states, partial_block_states, loop_layer_idx)
    stacked = module.norm(torch.cat([block_states, partial_block_states.unsqueeze(-2)], dim=-2).float())
    return block_residual_invariant(module.query[loop_layer_idx], stacked, stacked.shape[-1] ** -0.5)


def attention_forward(module, original, hidden_states: torch.Tensor, *args, **kwargs):
    """An Inkling 2 attention module's ``(output [B, T, hidden], None)``: from 5.24 on upstream's forward (its parts
    are patched), in 5.23 :func:`_fused_attention_forward`."""
    if not _compat.inkling2_fused_attention(module):
        return original(hidden_states, *args, **kwargs)
    return _fused_attention_forward(module, hidden_states, *args, **kwargs)


def _fused_attention_forward(module, hidden_states: torch.Tensor, attention_mask=None, conv_mask=None,
                             key_hidden_states=None, value_hidden_states=None, **kwargs):
    """``Inkling2SlidingAttention.forward`` / ``Inkling2FullAttention.forward`` of transformers 5.23 (the full one
    with its own key and value inputs and the logarithmic scaling of its queries and relative states), its output
    gate through :func:`_gate`; its clips, short convs and relative logits are called as upstream calls them (and so
    run this module's forms), the attention through the model's attention function (the invariant one)."""
    cache, rest, _, attention, update = gated_attention_parts(module, kwargs)
    convs = {"conv_mask": conv_mask, _compat.CACHE_KWARG: cache}
    full = key_hidden_states is not None
    key_in = key_hidden_states if full else hidden_states
    value_in = value_hidden_states if full else hidden_states
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    query = module.q_proj(hidden_states)
    key = module.k_sconv(module.k_proj(key_in), *((key_in,) if full else ()), **convs)
    value = module.v_sconv(module.v_proj(value_in), *((value_in,) if full else ()), **convs)
    relative, gate, sinks = module.r_proj(hidden_states), module.gate_proj(hidden_states), module.sink_proj(hidden_states)
    q_length = query.shape[1]
    if cache is not None:
        kv_length, kv_offset = cache.get_mask_sizes(q_length, module.layer_idx)
        q_offset = cache.get_query_offset(module.layer_idx)
    else:
        kv_length, q_offset, kv_offset = q_length, 0, 0
    kv_positions = torch.arange(kv_length, device=hidden_states.device) + kv_offset
    q_positions = torch.arange(q_length, device=hidden_states.device) + q_offset
    query = module.q_l2_clip(query.view(hidden_shape))
    relative = module.rel_l2_clip(relative.view(*input_shape, module.num_heads, -1))
    if full:
        config = module.config
        tau = 1.0 + config.log_scaling_alpha * torch.log(
            ((rest["position_ids"] + 1).float() / config.log_scaling_n_floor).clamp(min=1.0))
        tau = tau[..., None, None]
        query = (query.float() * tau).to(query.dtype)
        relative = (relative.float() * tau).to(relative.dtype)
    query = query.transpose(1, 2)
    key = module.k_l2_clip(key.view(hidden_shape)).transpose(1, 2)
    value = value.view(hidden_shape)
    value = module.v_norm(value.float()).to(value.dtype).transpose(1, 2)
    if cache is not None:
        key, value = update(key, value)
    bias = module.rel_logits_proj(relative, q_positions, kv_positions)
    out, _ = attention(module, query, key, value, attention_mask, dropout=module.attention_dropout if module.training
                       else 0.0, scaling=module.scaling, sliding_window=module.sliding_window, position_bias=bias,
                       sinks=sinks.transpose(1, 2).unsqueeze(-1), **rest)
    out = out.reshape(*input_shape, -1).contiguous()
    return module.o_proj(_gate(out, gate)), None


#: Module class -> this module's forward for it (:mod:`.hybrid_deterministic` patches them by name).
FORWARDS = {"Inkling2L2Clip": l2_clip_forward, "Inkling2ScaledL2Clip": l2_clip_forward,
            "Inkling2RelativePositionBias": relative_bias_forward, "Inkling2RelativeLogits": relative_logits_forward,
            "Inkling2GatedOutputProjection": gated_output_forward, "Inkling2Softcap": softcap_forward,
            "Inkling2SoftcappedSwiGLU": swiglu_forward, "Inkling2BlockAttentionResidual": block_residual_forward,
            "Inkling2SlidingAttention": attention_forward, "Inkling2FullAttention": attention_forward,
            "Inkling2LoopL2Clip": l2_clip_forward, "Inkling2LoopScaledL2Clip": l2_clip_forward,
            "Inkling2LoopRelativePositionBias": relative_bias_forward,
            "Inkling2LoopGatedOutputProjection": gated_output_forward, "Inkling2LoopSoftcap": softcap_forward,
            "Inkling2LoopSoftcappedSwiGLU": swiglu_forward, "Inkling2LoopBlockAttentionResidual": block_residual_forward,
            "Inkling2LoopMessageGate": message_gate_forward,
            "Inkling2LoopMessageAttentionResidual": message_residual_forward}
