"""Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side on the same input
(``FalconH1DecoderLayer``), so every cache layer holds both KV and a Mamba state (transformers builds
``LinearAttentionAndFullAttentionLayer`` for all of them).

The mixer scales its input (``ssm_in_multiplier``) and its projection (µP ``mup_vector``), and gates either through
the gated RMS norm or through ``silu(gate)`` (``mamba_rms_norm``). It continues from a cached state correctly in
transformers 5.23; only checkpoint emission is added (see :mod:`.mamba2`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelStateSpec
from .base import ModelSupport
from .mamba2 import Mamba2Variant, attention_layer_spec, install_mixers, mamba_layer_spec


def _project(mixer, hidden_states: torch.Tensor) -> torch.Tensor:
    return mixer.in_proj(hidden_states * mixer.ssm_in_multiplier) * mixer.mup_vector


def _gate_and_norm(mixer, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    if mixer.mamba_rms_norm:
        return mixer.norm(y, gate)
    return y * F.silu(gate)


VARIANT = Mamba2Variant(mixer_class="FalconH1Mixer", project=_project, gate_and_norm=_gate_and_norm)


def install(model: torch.nn.Module) -> None:
    install_mixers(model, VARIANT)


def state_spec(model: torch.nn.Module, block_size: int) -> ModelStateSpec:
    layers = model.model.layers
    attention = tuple(attention_layer_spec(idx, layer.self_attn) for idx, layer in enumerate(layers))
    mamba = tuple(mamba_layer_spec(idx, layer.mamba) for idx, layer in enumerate(layers))
    return ModelStateSpec(attention, mamba, block_size)


SUPPORT = ModelSupport(model_types=("falcon_h1",), install=install, state_spec=state_spec)
