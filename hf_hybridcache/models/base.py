"""What a model family must tell the cache."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from .. import _compat, kernels
from ..config import AttentionLayerSpec, ModelStateSpec

logger = logging.getLogger("hf_hybridcache")
_explained: set[str] = set()


@dataclass(frozen=True)
class ModelSupport:
    """One supported family.

    Attributes:
        model_types: ``config.model_type`` values served by this module.
        install: patches the model's mixers on the instance (idempotent, no effect on other models).
        state_spec: ``(model, block_size) -> ModelStateSpec``, the layers and byte sizes of KV blocks and checkpoints.
        scan: which prefills the patched mixers run through which scan of this package where it stands in for
            transformers' ``scan_kernels`` (a clause: "prefills that store checkpoints run hf_hybridcache's ...");
            empty where upstream's kernels keep running.
        scan_kernels: transformers' kernels (as its "falling back" notices name them) that the scan stands in for.
        kernel_packages: the pip packages whose CUDA kernels transformers' own path of this family would use.
    """

    model_types: tuple[str, ...]
    install: Callable[[torch.nn.Module], None]
    state_spec: Callable[[torch.nn.Module, int], ModelStateSpec]
    scan: str = ""
    scan_kernels: tuple[str, ...] = ()
    kernel_packages: tuple[str, ...] = ()

    def explain_kernels(self, model: torch.nn.Module, devices: Iterable[torch.device]) -> None:
        """Drop transformers' "falling back" notices of the kernels ``scan`` stands in for inside this model's
        forwards with its cache (:mod:`hf_hybridcache._compat.kernel_notices`), and say once per process, model
        class and device type which path runs what: a warning where a kernel package is missing (where
        transformers' own notices would have shown), at info level otherwise. ``devices`` are the layers' devices:
        the line speaks of CUDA when any is a CUDA device."""
        if not self.scan_kernels:
            return
        device = max((torch.device(d) for d in devices), key=lambda d: d.type == "cuda")
        _compat.quiet_kernel_notices(model, self.scan_kernels)
        key = f"{type(model).__name__}/{device.type}"
        if key in _explained:
            return
        _explained.add(key)
        missing = [p for p in self.kernel_packages if importlib.util.find_spec(p.replace("-", "_")) is None]
        fast = "Triton" if device.type == "cuda" and kernels.backend.triton_available() else "torch"
        stock = f"its PyTorch reference: {' and '.join(missing)} not installed" if missing else "CUDA kernels"
        named = " / ".join(f"`{k}`" for k in self.scan_kernels)
        logger.log(
            logging.WARNING if missing else logging.INFO,
            f"hf_hybridcache: {type(model).__name__} on {device.type}: {self.scan} ({fast}) in place of transformers' "
            f"{named}; float32 decode steps run hf_hybridcache's fused single-token update, the other decode steps and "
            f"prefills transformers' own kernels ({stock}). On CUDA, `pip install "
            f"{' '.join(self.kernel_packages)}` speeds up those; hf_hybridcache's scan does not use them.",
        )

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
    """KV of one attention module with ``k_proj`` and ``head_dim`` (GQA heads counted from ``k_proj``, or from its
    ``linear`` where ``k_proj`` is a module around one: Inkling 2 on transformers 5.24)."""
    projection = attention.k_proj if hasattr(attention.k_proj, "out_features") else attention.k_proj.linear
    num_kv_heads = projection.out_features // attention.head_dim
    return AttentionLayerSpec(layer_idx, num_kv_heads, attention.head_dim, projection.weight.dtype)


def mla_attention_layer_spec(layer_idx: int, attention: torch.nn.Module) -> AttentionLayerSpec:
    """KV of one multi-head latent attention (MLA) module, as it reaches the cache: its forward hands
    ``past_key_values.update`` the normed compressed latent ``[B, 1, T, kv_lora_rank]`` as keys and the shared rope
    key ``[B, 1, T, qk_rope_head_dim]`` as values (one head each), and expands them into per-head keys and values
    only after the cache (DeepSeek-V2's MLA; ``KimiLinearAttention``, ``BailingHybridAttention`` in transformers
    5.23.0). The widths come from the module's ``kv_lora_rank`` and ``qk_rope_head_dim``, checked against
    ``kv_a_proj_with_mqa``, which projects to both."""
    keys_dim, values_dim = attention.kv_lora_rank, attention.qk_rope_head_dim
    projection = attention.kv_a_proj_with_mqa
    assert projection.out_features == keys_dim + values_dim, (
        f"{type(attention).__name__}.kv_a_proj_with_mqa projects to {projection.out_features} features, not "
        f"kv_lora_rank + qk_rope_head_dim = {keys_dim} + {values_dim}"
    )
    return AttentionLayerSpec(layer_idx, 1, keys_dim, projection.weight.dtype, value_head_dim=values_dim)
