"""Falcon-H1's Mamba-2 mixer in deterministic mode (issue 46): :mod:`.mamba2_deterministic`'s forward with Falcon-H1's
two differences as hooks (the package's default path has the same two, :mod:`.falcon_h1`):

- the projection ``in_proj(x * ssm_in_multiplier) * mup_vector``, ``in_proj`` through the row-invariant linear (the
  scalings are one correctly rounded product per element, the same bits at any offset);
- after the scan, either the gated RMS norm (``mamba_rms_norm``; per group of ``n_groups``, the gate's silu applied
  after the norm where ``norm_before_gate``, before it otherwise) with the silu from ``exp``, or ``y * silu(gate)``
  with the invariant SiLU rounded to the gate's dtype, as upstream's ``F.silu(gate)`` is.

The layer's attention (``FalconH1Attention``, its ``key_multiplier`` an elementwise scaling), its MLP
(``FalconH1MLP``: linears and SiLU module, ``gate_multiplier`` / ``down_multiplier`` elementwise) and the layer's
µP multipliers (``attention_in_multiplier``, ``attention_out_multiplier``, ``ssm_out_multiplier``, the embedding and
LM head multipliers) are :mod:`.hybrid_deterministic`'s or run as upstream.

Upstream code mirrored: ``FalconH1Mixer.forward`` and ``FalconH1RMSNormGated.forward``
(``transformers/models/falcon_h1/modeling_falcon_h1.py``, transformers 5.23 - 5.25). The switch ``"norm"`` of
:data:`.mamba2_deterministic._OFF` runs upstream's gate and norm (``F.silu``).
"""

from __future__ import annotations

import functools

import torch

from ..kernels.gated_delta_invariant import gated_rms_norm_after_invariant
from ..kernels.mamba1_invariant import silu_invariant
from ..kernels.mamba2_invariant import gated_rms_norm_invariant
from . import mamba2_deterministic
from .falcon_h1 import _gate_and_norm as upstream_gate_and_norm
from .mamba2_deterministic import _linear, lm_head_forward

__all__ = ["deterministic_forward", "lm_head_forward"]


def _project(mixer, hidden_states: torch.Tensor) -> torch.Tensor:
    """``in_proj(hidden_states * ssm_in_multiplier) * mup_vector`` ``[B, T, gate + conv channels + H]``."""
    projected = _linear(hidden_states * mixer.ssm_in_multiplier, mixer.in_proj.weight, mixer.in_proj.bias)
    return projected * mixer.mup_vector


def _gate_and_norm(mixer, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``y`` ``[B, T, I]`` float32 gated by ``gate`` ``[B, T, I]`` (and normed per group) -> ``[B, T, I]`` float32."""
    if "norm" in mamba2_deterministic._OFF:
        return upstream_gate_and_norm(mixer, y, gate)
    if not mixer.mamba_rms_norm:
        return y * silu_invariant(gate.float()).to(gate.dtype)
    norm = mixer.norm
    group_size = y.shape[-1] // norm.n_groups
    if not norm.norm_before_gate:
        return gated_rms_norm_invariant(y, gate, norm.weight, group_size, norm.variance_epsilon)
    grouped = (*y.shape[:-1], norm.n_groups, group_size)
    out = gated_rms_norm_after_invariant(y.reshape(grouped), gate.reshape(grouped),
                                         norm.weight.view(norm.n_groups, group_size), norm.variance_epsilon)
    return out.reshape(y.shape)


#: The mixer forward :mod:`.deterministic` installs on ``FalconH1Mixer`` modules.
deterministic_forward = functools.partial(mamba2_deterministic.deterministic_forward, project=_project,
                                          gate_and_norm=_gate_and_norm)
