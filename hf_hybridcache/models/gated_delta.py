"""Gated delta net (GDN) mixers: Qwen3-Next, Qwen3.5 (dense and MoE), OLMo-hybrid, qwen4_exp.

Each mixer projects the input to q, k, v (plus gates), runs a depthwise causal conv over ``q|k|v`` (conv state
``[C = 2*Hk*Dk + Hv*Dv, W]``) and the gated delta rule (Yang et al., "Gated Delta Networks", ICLR 2025) with a
recurrent state ``[Hv, Dk, Dv]`` in float32. The forwards differ in their projections and stay upstream's; what they
share is the kernel they call, ``torch_chunk_gated_delta_rule``, and the state layout, so a family file is one
:class:`~.linear_attention.LinearVariant` made by :func:`gdn_variant`.
"""

from __future__ import annotations

from ..kernels import chunk_gated_delta_rule, gated_delta_steps
from .linear_attention import LinearVariant, RecurrenceKernel

#: The chunked gated delta rule every GDN modeling file calls by this name (transformers 5.23.0); on CPU (no
#: ``fla``) our copy of its torch path emits the states in the same pass, and a call of a few float32 tokens (a verify
#: step) runs the token-by-token form instead.
GDN_KERNEL = RecurrenceKernel("torch_chunk_gated_delta_rule", emitting=chunk_gated_delta_rule,
                              stepping=gated_delta_steps)


def gdn_conv_shape(mixer) -> tuple[int, int]:
    return mixer.conv_dim, mixer.conv_kernel_size


def gdn_recurrent_shape(mixer) -> tuple[int, int, int]:
    return mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim


def gdn_variant(mixer_class: str, attention_class: str) -> LinearVariant:
    return LinearVariant(mixer_class, attention_class, gdn_conv_shape, gdn_recurrent_shape, (GDN_KERNEL,),
                         decode_functions=("causal_conv1d_update", "torch_recurrent_gated_delta_rule"))
