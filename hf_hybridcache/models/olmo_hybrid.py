"""OLMo-hybrid: gated delta net layers (``OlmoHybridGatedDeltaNet``, separate q/k/v/a/b/g projections, beta up to 2
with ``linear_allow_neg_eigval``) in their own decoder layers, beside attention decoder layers; see
:mod:`.gated_delta`. Upstream: ``transformers/models/olmo_hybrid/modeling_olmo_hybrid.py`` (5.23.0)."""

from __future__ import annotations

from .gated_delta import gdn_variant
from .linear_attention import linear_attention_support

SUPPORT = linear_attention_support(("olmo_hybrid",), gdn_variant("OlmoHybridGatedDeltaNet", "OlmoHybridAttention"))
