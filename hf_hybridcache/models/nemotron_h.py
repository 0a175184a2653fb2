"""NemotronH: a pattern of Mamba-2 (``NemotronHMamba2Mixer``, the plain Mamba-2 mixer), attention, MLP and MoE
layers; the MLP and MoE layers hold no cache (transformers gives them a ``DummyLayer``). The mixer continues from a
cached state correctly in transformers 5.23; only checkpoint emission is added (see :mod:`.mamba2`).

Upstream code mirrored: ``NemotronHMamba2Mixer.forward`` in ``transformers/models/nemotron_h/modeling_nemotron_h.py``
(transformers 5.23.0), line for line the same as ``Zamba2MambaMixer.forward``, so the shared copy in :mod:`.mamba2`
serves it unchanged.
"""

from __future__ import annotations

from .mamba2 import Mamba2Variant, mamba2_support

SUPPORT = mamba2_support(("nemotron_h",), Mamba2Variant("NemotronHMamba2Mixer", "NemotronHAttention"))
