"""Zamba2: Mamba-2 layers, and "hybrid" layers where a shared attention block (with rotary embeddings) runs before
the layer's own Mamba-2 mixer (``Zamba2HybridLayer``).

The shared block writes its KV under the hybrid layer's index, so that one cache layer holds both KV and a Mamba
state (transformers builds ``LinearAttentionAndFullAttentionLayer`` for it). The mixer continues from a cached state
correctly in transformers 5.23; only checkpoint emission is added (see :mod:`.mamba2`).
"""

from __future__ import annotations

import torch

from ..config import ModelStateSpec
from .base import ModelSupport
from .mamba2 import Mamba2Variant, attention_layer_spec, install_mixers, mamba_layer_spec

VARIANT = Mamba2Variant(mixer_class="Zamba2MambaMixer")


def install(model: torch.nn.Module) -> None:
    install_mixers(model, VARIANT)


def state_spec(model: torch.nn.Module, block_size: int) -> ModelStateSpec:
    attention, mamba = [], []
    for idx, layer in enumerate(model.model.layers):
        mamba_decoder = getattr(layer, "mamba_decoder", layer)
        mamba.append(mamba_layer_spec(idx, mamba_decoder.mamba))
        if hasattr(layer, "shared_transformer"):
            attention.append(attention_layer_spec(idx, layer.shared_transformer.self_attn))
    return ModelStateSpec(tuple(attention), tuple(mamba), block_size)


SUPPORT = ModelSupport(model_types=("zamba2",), install=install, state_spec=state_spec)
