"""Bamba: separate Mamba-2 layers (``BambaMixer``, the plain Mamba-2 mixer) and attention layers
(``attn_layer_indices``). The mixer continues from a cached state correctly in transformers 5.23; only checkpoint
emission is added (see :mod:`.mamba2`).

Upstream code mirrored: ``BambaMixer.forward`` in ``transformers/models/bamba/modeling_bamba.py``
(transformers 5.23.0), line for line the same as ``Zamba2MambaMixer.forward``, so the shared copy in :mod:`.mamba2`
serves it unchanged.
"""

from __future__ import annotations

from .mamba2 import Mamba2Variant, mamba2_support

SUPPORT = mamba2_support(("bamba",), Mamba2Variant("BambaMixer", "BambaAttention"))
