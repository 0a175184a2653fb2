"""The steps the scans and their Triton twins share, in a module of their own so that neither twin imports the other:
the check of emitted positions (every kernel that emits states), Mamba-1's time steps and output gate, Mamba-2's
``dt`` discretization.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
import torch.nn.functional as F


def check_emit_positions(emit_positions: Sequence[int], seq_len: int) -> list[int]:
    """``emit_positions`` as a list, after checking it is strictly increasing within ``[1, seq_len]``.

    Raises:
        ValueError: a position is out of range or the positions are not strictly increasing.
    """
    positions = [int(t) for t in emit_positions]
    if any(t < 1 or t > seq_len for t in positions) or any(a >= b for a, b in pairwise(positions)):
        raise ValueError(
            f"emit_positions must be strictly increasing token counts in [1, {seq_len}] (the state after t of the "
            f"{seq_len} tokens); got {positions}."
        )
    return positions


def time_steps(delta: torch.Tensor, delta_bias: torch.Tensor | None, delta_softplus: bool) -> torch.Tensor:
    """``softplus(delta + delta_bias)`` in ``delta``'s dtype, the first lines of ``mamba_selective_scan``
    (``modeling_jamba.py``, transformers 5.23.0), copied."""
    dt = delta
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    return dt


def gate(y: torch.Tensor, u: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """``(y + u * D) * silu(z)``: the last lines of ``mamba_selective_scan`` (``modeling_jamba.py``, 5.23.0), copied."""
    if D is not None:
        y = y + u * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return y


def discretize_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float]
) -> torch.Tensor:
    """Mamba-2's time steps: ``dt + dt_bias``, through softplus when ``dt_softplus``, clamped to ``dt_limit``, in
    ``dt``'s dtype (the first steps of :func:`~hf_hybridcache.kernels.mamba2_chunk_scan_ref`)."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
