"""Zamba2: Mamba-2 layers, and "hybrid" layers where a shared attention block (with rotary embeddings) runs before
the layer's own Mamba-2 mixer (``Zamba2HybridLayer``).

The shared block writes its KV under the hybrid layer's index, so that one cache layer holds both KV and a Mamba
state (transformers builds ``LinearAttentionAndFullAttentionLayer`` for it). The mixer continues from a cached state
correctly in transformers 5.23; only checkpoint emission is added (see :mod:`.mamba2`).
"""

from __future__ import annotations

from .mamba2 import Mamba2Variant, mamba2_support

SUPPORT = mamba2_support(("zamba2",), Mamba2Variant("Zamba2MambaMixer", "Zamba2Attention"))
