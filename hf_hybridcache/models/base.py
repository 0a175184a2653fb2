"""What a model family must tell the cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import _compat
from ..config import AttentionLayerSpec, ModelStateSpec


@dataclass(frozen=True)
class ModelSupport:
    """One supported family.

    Attributes:
        model_types: ``config.model_type`` values served by this module.
        install: patches the model's mixers on the instance (idempotent, no effect on other models).
        state_spec: ``(model, block_size) -> ModelStateSpec``, the layers and byte sizes of KV blocks and checkpoints.
    """

    model_types: tuple[str, ...]
    install: Callable[[torch.nn.Module], None]
    state_spec: Callable[[torch.nn.Module, int], ModelStateSpec]

    def spec_for(self, model: torch.nn.Module, block_size: int) -> ModelStateSpec:
        """``state_spec`` with the sliding windows of the attention layers transformers caches as sliding-window
        layers (any family).

        Raises:
            ValueError: ``block_size`` is longer than a sliding window.
        """
        spec = self.state_spec(model, block_size).with_sliding_windows(_compat.sliding_windows(model.config))
        spec.check_block_size()
        return spec


def attention_layer_spec(layer_idx: int, attention: torch.nn.Module) -> AttentionLayerSpec:
    """KV of one attention module with ``k_proj`` and ``head_dim`` (GQA heads counted from ``k_proj``)."""
    num_kv_heads = attention.k_proj.out_features // attention.head_dim
    return AttentionLayerSpec(layer_idx, num_kv_heads, attention.head_dim, attention.k_proj.weight.dtype)
