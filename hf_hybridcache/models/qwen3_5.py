"""Qwen3.5, dense and MoE: gated delta net layers (``Qwen3_5GatedDeltaNet`` / ``Qwen3_5MoeGatedDeltaNet``) around
gated full-attention layers; see :mod:`.gated_delta`. Upstream: ``transformers/models/qwen3_5/modeling_qwen3_5.py``
and ``models/qwen3_5_moe/modeling_qwen3_5_moe.py`` (5.23.0)."""

from __future__ import annotations

from .gated_delta import gdn_variant
from .linear_attention import linear_attention_support

SUPPORT = linear_attention_support(("qwen3_5_text",), gdn_variant("Qwen3_5GatedDeltaNet", "Qwen3_5Attention"))
MOE_SUPPORT = linear_attention_support(
    ("qwen3_5_moe_text",), gdn_variant("Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeAttention")
)
