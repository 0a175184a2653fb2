"""Short-convolution mixers: LFM2, LFM2-MoE and LFM3.

The mixer (``Lfm2ShortConv``) projects the input to ``B, C, x``, runs a depthwise causal conv over ``B * x``
(conv state ``[hidden, L_cache]``) and gates with ``C``. There is no recurrence: a checkpoint is the conv window
alone (the last ``L_cache`` conv inputs), stored with an empty recurrent state. LFM3 adds sliding-window attention
layers, which the block store restores like any sliding layer (:class:`~hf_hybridcache.config.AttentionLayerSpec`).
Upstream: ``transformers/models/lfm2/modeling_lfm2.py``, ``models/lfm2_moe/modeling_lfm2_moe.py`` and
``models/lfm3/modeling_lfm3.py`` (5.23.0).
"""

from __future__ import annotations

from .linear_attention import LinearVariant, linear_attention_support

#: The single-token conv update the short-conv mixers call on a decode step, fused in fp32 decode steps.
_DECODE = ("causal_conv1d_update",)


def short_conv_shape(mixer) -> tuple[int, int]:
    return mixer.conv.in_channels, mixer.conv_kernel_size


LFM2 = linear_attention_support(
    ("lfm2",), LinearVariant("Lfm2ShortConv", "Lfm2Attention", short_conv_shape, decode_functions=_DECODE)
)
LFM2_MOE = linear_attention_support(
    ("lfm2_moe",), LinearVariant("Lfm2MoeShortConv", "Lfm2MoeAttention", short_conv_shape, decode_functions=_DECODE)
)
LFM3 = linear_attention_support(
    ("lfm3",), LinearVariant("Lfm3ShortConv", "Lfm3Attention", short_conv_shape, decode_functions=_DECODE)
)
