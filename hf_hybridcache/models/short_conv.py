"""Short-convolution mixers: LFM2 and LFM2-MoE.

The mixer (``Lfm2ShortConv``) projects the input to ``B, C, x``, runs a depthwise causal conv over ``B * x``
(conv state ``[hidden, L_cache]``) and gates with ``C``. There is no recurrence: a checkpoint is the conv window
alone (the last ``L_cache`` conv inputs), stored with an empty recurrent state. Upstream:
``transformers/models/lfm2/modeling_lfm2.py`` and ``models/lfm2_moe/modeling_lfm2_moe.py`` (5.23.0).
"""

from __future__ import annotations

from .linear_attention import LinearVariant, linear_attention_support


def short_conv_shape(mixer) -> tuple[int, int]:
    return mixer.conv.in_channels, mixer.conv_kernel_size


LFM2 = linear_attention_support(("lfm2",), LinearVariant("Lfm2ShortConv", "Lfm2Attention", short_conv_shape))
LFM2_MOE = linear_attention_support(
    ("lfm2_moe",), LinearVariant("Lfm2MoeShortConv", "Lfm2MoeAttention", short_conv_shape)
)
