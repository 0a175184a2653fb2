"""Kimi Delta Attention (KDA) hybrids with MLA attention layers: Kimi Linear and Ling (``bailing_hybrid``).

A KDA mixer projects the input to q, k, v (``H`` heads of ``D`` each), runs a depthwise causal conv over ``q|k|v``
(conv state ``[C = 3 * H * D, W]``) and the delta rule with a decay per key channel (Kimi Team 2025, "Kimi Linear: An
Expressive, Efficient Attention Architecture"), recurrent state ``[H, Dk = D, Dv = D]`` in float32. Both modeling
files call the same module-level kernel, ``chunk_kimi_delta_attention``, for multi-token forwards; Ling's bounded
("safe") gate, ``lower_bound * sigmoid(exp(A_log) * (x + dt_bias))``, is computed by its forget-gate module before
the call, so one emitting kernel (:func:`~hf_hybridcache.kernels.chunk_kimi_delta_attention`, bit-identical to the
torch path of both files) serves both families.

Their attention layers are MLA (:func:`~.base.mla_attention_layer_spec`): the cache holds a normed latent as keys and
a shared rope key as values, of different widths. Kimi Linear's MLA has no rotary embedding (NoPE); Ling's applies it
to the rope key before the cache, so stored values are position-dependent, which a prefix hit preserves (the hit
restores exactly the positions ``[0, P)`` it was computed at).

Upstream: ``transformers/models/kimi_linear/modeling_kimi_linear.py`` and
``models/bailing_hybrid/modeling_bailing_hybrid.py`` (5.23.0).
"""

from __future__ import annotations

import torch

from ..kernels import chunk_kimi_delta_attention, kimi_delta_steps
from .base import mla_attention_layer_spec
from .linear_attention import LinearVariant, RecurrenceKernel, linear_attention_support

#: The chunked KDA both modeling files call by this name (transformers 5.23.0); on CPU (no ``fla``) our copy of its
#: torch path emits the states in the same pass, and a call of a few float32 tokens (a verify step) runs the
#: token-by-token form instead (5 tokens from a state, 16 heads of 128, one thread: 0.5 ms against 134 ms chunked).
KDA_KERNEL = RecurrenceKernel("chunk_kimi_delta_attention", emitting=chunk_kimi_delta_attention,
                              stepping=kimi_delta_steps)


def kda_conv_shape(mixer) -> tuple[int, int]:
    return mixer.conv_dim, mixer.conv_kernel_size


def kda_recurrent_shape(mixer) -> tuple[int, int, int]:
    return mixer.num_heads, mixer.head_dim, mixer.head_dim


def kda_conv_dtype(mixer) -> torch.dtype:
    """The conv state holds the q|k|v projections' outputs; Ling keeps its ``conv1d`` in float32
    (``_keep_in_fp32_modules_strict``), so in a bf16 checkpoint the conv weight's dtype is not the state's."""
    return mixer.q_proj.weight.dtype


def kda_variant(mixer_class: str, attention_class: str) -> LinearVariant:
    return LinearVariant(
        mixer_class, attention_class, kda_conv_shape, kda_recurrent_shape, (KDA_KERNEL,),
        attention_spec=mla_attention_layer_spec, conv_dtype=kda_conv_dtype,
    )


KIMI_LINEAR = linear_attention_support(
    ("kimi_linear",), kda_variant("KimiLinearDeltaAttention", "KimiLinearAttention")
)
BAILING_HYBRID = linear_attention_support(
    ("bailing_hybrid",), kda_variant("BailingHybridDeltaAttention", "BailingHybridAttention")
)
