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

from .mamba2 import Mamba2Variant, mamba2_support


def _project(mixer, hidden_states: torch.Tensor) -> torch.Tensor:
    return mixer.in_proj(hidden_states * mixer.ssm_in_multiplier) * mixer.mup_vector


def _gate_and_norm(mixer, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    if mixer.mamba_rms_norm:
        return mixer.norm(y, gate)
    return y * F.silu(gate)


SUPPORT = mamba2_support(
    ("falcon_h1",),
    Mamba2Variant("FalconH1Mixer", "FalconH1Attention", project=_project, gate_and_norm=_gate_and_norm),
)
