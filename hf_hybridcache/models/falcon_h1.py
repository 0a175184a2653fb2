"""Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side on the same input
(``FalconH1DecoderLayer``), so every cache layer holds both KV and a Mamba state (transformers builds
``LinearAttentionAndFullAttentionLayer`` for all of them).

The mixer scales its input (``ssm_in_multiplier``) and its projection (µP ``mup_vector``), and gates either through
the gated RMS norm or through ``silu(gate)`` (``mamba_rms_norm``). It continues from a cached state correctly in
transformers 5.23; only checkpoint emission is added (see :mod:`.mamba2`).

Upstream code mirrored: ``FalconH1Mixer.forward`` in ``transformers/models/falcon_h1/modeling_falcon_h1.py``
(transformers 5.23.0). :func:`_project` copies its "Key difference 1" (the multipliers around ``in_proj``) and
:func:`_gate_and_norm` its chunk-form "Key difference 3" (gated RMS norm or ``silu(gate)``); the rest is the shared
Mamba-2 copy in :mod:`.mamba2`, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mamba2 import Mamba2Variant, mamba2_support


def _project(mixer, hidden_states: torch.Tensor) -> torch.Tensor:
    """``in_proj(hidden_states * ssm_in_multiplier) * mup_vector``, as ``FalconH1Mixer.forward`` (5.23.0)."""
    return mixer.in_proj(hidden_states * mixer.ssm_in_multiplier) * mixer.mup_vector


def _gate_and_norm(mixer, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The chunk-form gate of ``FalconH1Mixer.forward`` (5.23.0): ``norm(y, gate)`` with ``mamba_rms_norm``, else
    ``y * silu(gate)``."""
    if mixer.mamba_rms_norm:
        return mixer.norm(y, gate)
    return y * F.silu(gate)


SUPPORT = mamba2_support(
    ("falcon_h1",),
    Mamba2Variant("FalconH1Mixer", "FalconH1Attention", project=_project, gate_and_norm=_gate_and_norm),
)
