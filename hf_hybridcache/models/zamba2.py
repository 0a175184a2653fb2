"""Zamba2: Mamba-2 layers, and "hybrid" layers where a shared attention block (with rotary embeddings) runs before
the layer's own Mamba-2 mixer (``Zamba2HybridLayer``).

The shared block writes its KV under the hybrid layer's index, so that one cache layer holds both KV and a Mamba
state (transformers builds ``LinearAttentionAndFullAttentionLayer`` for it). The mixer continues from a cached state
correctly in transformers 5.23; only checkpoint emission is added (see :mod:`.mamba2`).

Upstream code mirrored: ``Zamba2MambaMixer.forward`` in ``transformers/models/zamba2/modeling_zamba2.py``
(transformers 5.23.0), copied as the shared Mamba-2 path in :mod:`.mamba2` with no variant.
"""

from __future__ import annotations

from .mamba2 import Mamba2Variant, mamba2_support

SUPPORT = mamba2_support(("zamba2",), Mamba2Variant("Zamba2MambaMixer", "Zamba2Attention"))
