"""Inkling: every decoder layer is attention (full or sliding-window) plus four short convolutions.

Each ``InklingShortConvolution`` runs a depthwise causal conv with a residual, in float32, and keeps its window in
its layer's cache layer under its own ``state_idx`` (``conv_idx``): 0 and 1 on the key and value projections (before
the KV cache, so the cached keys and values are the convolved ones), 2 after the attention, 3 after the MLP. A
checkpoint is the four windows (no recurrent state); the KV is stored in blocks, the sliding-window layers' like any
sliding layer's. Upstream continues exactly from a cache (checked on the tiny model: one forward against a prefix
then the rest, 3e-8 on the logits in float32). Upstream: ``transformers/models/inkling/modeling_inkling.py``
(5.23.0).
"""

from __future__ import annotations

import torch

from .linear_attention import LinearVariant, linear_attention_support


def short_conv_shape(mixer) -> tuple[int, int]:
    return mixer.conv1d.in_channels, mixer.conv_kernel_size


SUPPORT = linear_attention_support(
    ("inkling_text",),
    LinearVariant(
        "InklingShortConvolution",
        "InklingAttention",
        short_conv_shape,
        state_idx_attr="conv_idx",
        conv_dtype=torch.float32,
    ),
)
