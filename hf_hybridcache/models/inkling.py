"""Inkling and Inkling 2: every decoder layer is attention (full or sliding-window) plus four short convolutions.

Each ``InklingShortConvolution`` runs a depthwise causal conv with a residual, in float32, and keeps its window in
its layer's cache layer under its own ``state_idx`` (``conv_idx``): 0 and 1 on the key and value projections (before
the KV cache, so the cached keys and values are the convolved ones), 2 after the attention, 3 after the MLP. A
checkpoint is the four windows (no recurrent state); the KV is stored in blocks, the sliding-window layers' like any
sliding layer's. Upstream continues exactly from a cache (checked on the tiny model: one forward against a prefix
then the rest, 3e-8 on the logits in float32).

Inkling 2 has separate sliding and full attention classes, and its full-attention layers convolve keys and values
with a *dynamic* short conv (``Inkling2DynamicShortConvolution``: static taps plus per-token taps projected from the
layer input), which keeps the same window of raw inputs under ``state_idx`` 0 and 1; its block attention residuals
mix layers at one position and keep no state. Upstream continues exactly from a cache too (7e-7). In transformers
5.24 its key and value projections and their short convs sit in ``Inkling2KeyValueProjection`` modules (``k_proj``
with a ``linear`` and an ``sconv`` inside); the mixers and their cache calls are the same. Upstream:
``transformers/models/inkling/modeling_inkling.py``, ``models/inkling2/modeling_inkling2.py`` (5.23.0, 5.24.0).

Inkling 2 Loop (``inkling2_loop_text``, new in transformers 5.24: ``models/inkling2_loop/modeling_inkling2_loop.py``)
is Inkling 2 whose decoder layers ``[loop_layer_index_start, loop_layer_index_end)`` run ``loop_num_passes`` times,
each pass after the first restarting from the hidden states before the loop with messages from the previous pass.
Its mixers and attention are Inkling 2's; each pass after the first calls them with a ``cache_offset`` that puts its
KV and conv windows in cache layers of its own, after the model's ``num_hidden_layers``
(:func:`hf_hybridcache._compat.loop_cache_layers`). Its spec is Inkling 2's plus those cache layers: a checkpoint
holds the four windows of every cache layer, the loop passes' included, and a KV block the keys and values of every
cache layer. Upstream continues exactly from a cache (checked on the tiny model, 3 passes: one forward over a
prefix then the rest against one forward over everything, 1.3e-6 on the logits in float32).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .. import _compat
from ..config import ModelStateSpec
from .base import ModelSupport
from .linear_attention import LinearVariant, install_mixers, linear_attention_support, state_spec


def short_conv_shape(mixer) -> tuple[int, int]:
    conv1d = getattr(mixer, "conv1d", None)
    channels = conv1d.in_channels if conv1d is not None else mixer.static_weight.shape[1]  # the dynamic conv
    return channels, mixer.conv_kernel_size


def _float32(mixer) -> torch.dtype:
    """Inkling's short convs run in float32 in every model dtype, and so does the window they keep."""
    return torch.float32


SUPPORT = linear_attention_support(
    ("inkling_text",),
    LinearVariant(
        "InklingShortConvolution",
        "InklingAttention",
        short_conv_shape,
        state_idx_attr="conv_idx",
        conv_dtype=_float32,
    ),
)
INKLING2 = linear_attention_support(
    ("inkling2_text",),
    LinearVariant(
        ("Inkling2ShortConvolution", "Inkling2DynamicShortConvolution"),
        ("Inkling2SlidingAttention", "Inkling2FullAttention"),
        short_conv_shape,
        state_idx_attr="conv_idx",
        conv_dtype=_float32,
    ),
)


_LOOP_VARIANT = LinearVariant(
    ("Inkling2LoopShortConvolution", "Inkling2LoopDynamicShortConvolution"),
    ("Inkling2LoopSlidingAttention", "Inkling2LoopFullAttention"),
    short_conv_shape,
    state_idx_attr="conv_idx",
    conv_dtype=_float32,
)


def loop_state_spec(model: torch.nn.Module, block_size: int) -> ModelStateSpec:
    """Inkling 2's spec of the decoder layers, followed by the same layers' KV and conv windows once more for every
    cache layer a loop pass after the first keeps (:func:`hf_hybridcache._compat.loop_cache_layers`)."""
    spec = state_spec(model, block_size, _LOOP_VARIANT)
    extra = _compat.loop_cache_layers(model.config)
    attention = [dataclasses.replace(a, layer_idx=cache_idx)
                 for cache_idx, decoder_idx in extra.items() for a in spec.attention if a.layer_idx == decoder_idx]
    linear = [dataclasses.replace(m, layer_idx=cache_idx)
              for cache_idx, decoder_idx in extra.items() for m in spec.mamba if m.layer_idx == decoder_idx]
    return ModelStateSpec(spec.attention + tuple(attention), spec.mamba + tuple(linear), block_size)


INKLING2_LOOP = ModelSupport(
    model_types=("inkling2_loop_text",),
    install=functools.partial(install_mixers, variant=_LOOP_VARIANT),
    state_spec=loop_state_spec,
)
