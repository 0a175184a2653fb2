"""GraniteMoeHybrid (IBM Granite 4.0-H): separate Mamba-2 layers (``GraniteMoeHybridMambaLayer``, the plain Mamba-2
mixer) and attention layers (``layer_types``). The mixer continues from a cached state correctly in transformers
5.23; only checkpoint emission is added (see :mod:`.mamba2`).

Upstream code mirrored: ``GraniteMoeHybridMambaLayer.forward`` in
``transformers/models/granitemoehybrid/modeling_granitemoehybrid.py`` (transformers 5.23.0), line for line the same
as ``Zamba2MambaMixer.forward``, so the shared copy in :mod:`.mamba2` serves it unchanged.
"""

from __future__ import annotations

from .mamba2 import Mamba2Variant, mamba2_support

SUPPORT = mamba2_support(
    ("granitemoehybrid",), Mamba2Variant("GraniteMoeHybridMambaLayer", "GraniteMoeHybridAttention")
)
