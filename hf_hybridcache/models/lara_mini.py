"""Lara Mini (``lara_mini``, new in transformers 5.24): Qwen3.5's gated delta net layers (``LaraMiniGatedDeltaNet``)
beside sliding-window attention layers with rotary embeddings and full attention layers without position encoding
(both ``LaraMiniAttention``), routed experts in every layer; see :mod:`.gated_delta`. Upstream:
``transformers/models/lara_mini/modeling_lara_mini.py`` (5.24.0, 5.25.0)."""

from __future__ import annotations

from .gated_delta import gdn_variant
from .linear_attention import linear_attention_support

SUPPORT = linear_attention_support(("lara_mini",), gdn_variant("LaraMiniGatedDeltaNet", "LaraMiniAttention"))
