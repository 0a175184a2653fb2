"""Qwen3-Next: gated delta net layers (``Qwen3NextGatedDeltaNet``) around gated full-attention layers
(``layer_types``); see :mod:`.gated_delta`. Upstream: ``transformers/models/qwen3_next/modeling_qwen3_next.py``
(5.23.0)."""

from __future__ import annotations

from .gated_delta import gdn_variant
from .linear_attention import linear_attention_support

SUPPORT = linear_attention_support(("qwen3_next",), gdn_variant("Qwen3NextGatedDeltaNet", "Qwen3NextAttention"))
