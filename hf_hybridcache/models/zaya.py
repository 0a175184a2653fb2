"""ZAYA: every decoder layer is attention (full or sliding-window) whose q/k/v come from a CCA projection.

``ZayaCCAProjection`` (compressed convolutional attention) convolves the concatenated q and k projections causally
over ``(cca_time0 - 1) + (cca_time1 - 1)`` past tokens and mixes into each value head half of the previous token's
"delayed" value projection. So its cache layer keeps a conv window of the raw q|k inputs ``[Cqk, W]`` and, as its
recurrent state, the last token's delayed value projection ``[Hkv * D / 2]`` (model dtype); the KV is stored in
blocks (the sliding-window layers' like any sliding layer's). Upstream continues exactly from a cache (tiny model:
one forward against a prefix then the rest, 5e-7 on the logits in float32).

The projection hands the cache its window already cut (``update_conv_state(qk[..., -W:])``), so the windows at block
boundaries inside a forward cannot be cut from what the cache sees. The patched forward runs the upstream one
unchanged and, when the cache wants states inside the call, recomputes the projection's conv inputs and delayed
values from the same inputs with the same modules (the same ops on the same shapes, so bit-identical): the window
after ``t`` tokens is ``qk`` up to ``t``, the recurrent state is the delayed value of token ``t - 1``. In
deterministic mode the patched forward runs :mod:`.zaya_deterministic`'s instead, which keeps the same states. Upstream:
``transformers/models/zaya/modeling_zaya.py`` (5.23.0).
"""

from __future__ import annotations

import torch

from .. import _compat
from ..config import MambaLayerSpec, ModelStateSpec, TensorSpec
from .base import ModelSupport, attention_layer_spec
from .mamba1 import checkpoint_positions, conv_states_at, deterministic_over

_CCA_CLASS = "ZayaCCAProjection"


def _emitting_forward(cca, original, hidden_states, past_key_values=None, conv_mask=None):
    cache, seq_len = past_key_values, hidden_states.shape[1]
    deterministic = deterministic_over(cca, cache)
    if deterministic is not None and (cache is None or not cache.is_recording_past(cca.layer_idx)):
        forward, over = deterministic  # deterministic mode's (models/zaya_deterministic.py)
        return forward(cca, hidden_states, over, conv_mask)
    if cache is None or seq_len == 1 or cache.is_recording_past(cca.layer_idx):
        return original(hidden_states, past_key_values, conv_mask)
    positions = checkpoint_positions(cache, seq_len)
    if not positions:
        return original(hidden_states, past_key_values, conv_mask)
    previous = cache.get_conv_state(cca.layer_idx, state_idx=0)  # None on a fresh prompt, as upstream reads it
    previous = None if previous is None else previous.clone()  # the call below updates it in place
    out = original(hidden_states, past_key_values, conv_mask)
    if conv_mask is not None:  # as upstream masks its input
        hidden_states = hidden_states * conv_mask[:, :, None].to(hidden_states.dtype)
    qk = torch.cat([cca.q_proj(hidden_states), cca.k_proj(hidden_states)], dim=-1).transpose(1, 2)
    convs = conv_states_at(qk, previous, cca.conv_kernel_size, positions)
    delayed = cca.v_proj_delayed(hidden_states)
    recurrent = [delayed[:, t - 1].clone() for t in positions]
    cache.capture_states(cca.layer_idx, positions, list(zip(convs, recurrent)))
    return out


def install(model: torch.nn.Module) -> None:
    """Patch every CCA projection of ``model`` (this instance only; idempotent)."""
    for module in model.modules():
        if type(module).__name__ == _CCA_CLASS:
            _compat.patch_instance_forward(module, _emitting_forward)


def state_spec(model: torch.nn.Module, block_size: int) -> ModelStateSpec:
    """Decoder layer ``i``'s CCA projection holds both the KV shape (its ``k_proj``) and the states of cache layer
    ``i``."""
    attention, linear = [], []
    for idx, layer in enumerate(_compat.decoder_layers(model)):
        cca = layer.self_attn.qkv_proj
        dtype = cca.k_proj.weight.dtype
        channels = cca.conv_qk_depthwise.in_channels
        conv = TensorSpec((channels, cca.conv_kernel_size), dtype)
        recurrent = TensorSpec((cca.v_proj_delayed.out_features,), dtype)
        linear.append(MambaLayerSpec(idx, conv=conv, ssm=recurrent))
        attention.append(attention_layer_spec(idx, cca))
    return ModelStateSpec(tuple(attention), tuple(linear), block_size)


SUPPORT = ModelSupport(model_types=("zaya",), install=install, state_spec=state_spec)
