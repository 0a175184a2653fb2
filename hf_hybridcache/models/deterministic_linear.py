"""The products of deterministic mode (issue 46): every linear layer its per-family forwards run, in one place; and
the invariant causal conv over a cache, which every mixer with a conv window runs alike (:func:`conv_over_cache`).

Each mixer module (:mod:`.mamba1_deterministic`, :mod:`.mamba2_deterministic`, :mod:`.gated_delta_deterministic`,
:mod:`.short_conv_deterministic`) keeps its own private ``_OFF`` switch set for the power tests and passes it here at
call time, so a test that reassigns a module's ``_OFF`` switches exactly the products that module runs.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F

from .. import _compat
from ..kernels.batch_invariant import invariant_linear
from ..kernels.conv_invariant import causal_conv_invariant
from ..kernels.decode_linear import weight_qualifies
from .decode_linear import wide_threads


def routed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  off: Collection[str] = ()) -> torch.Tensor:
    """``x @ weight.T + bias`` (``x`` ``[..., in]``, ``weight`` ``[out, in]``, ``bias`` ``[out]`` or None, one dtype on
    CPU) -> ``[..., out]`` through :func:`~hf_hybridcache.kernels.batch_invariant.invariant_linear`, so a row's result
    does not depend on the rows beside it. A small weight (one the package's decode route leaves alone, probed equal
    on one thread at construction by :func:`~hf_hybridcache.models.deterministic.check`) runs on the calling thread
    count; a wide one under :func:`~hf_hybridcache.models.decode_linear.wide_threads`, on all threads, as in a prefill
    (an engine decode step runs its other ops on one thread). ``off``: the caller's switch set; with ``"linear"`` in
    it, ``F.linear`` instead (the power tests' default op)."""
    if "linear" in off:
        return F.linear(x, weight, bias)
    if not weight_qualifies(tuple(weight.shape)):
        return invariant_linear(x, weight, bias)
    with wide_threads():
        return invariant_linear(x, weight, bias)


def conv_over_cache(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                    conv_state: torch.Tensor | None, cache, layer_idx: int, kernel_size: int, decode: bool,
                    state_idx: int | None = None) -> torch.Tensor:
    """The invariant causal conv of ``x`` ``[B, C, T]`` (``weight`` ``[C, W]``, ``activation`` None / ``"silu"``)
    continuing ``conv_state`` ``[B, C, W]`` (None: zeros) -> ``[B, C, T]``; the window goes to ``cache``: in place for a
    decode step (``decode``: one token over a held state), which counts its token as the package's decode step does,
    else through ``cache.update_conv_state``. ``state_idx``: the conv's own state slot in its layer (Inkling's four)."""
    slot = {} if state_idx is None else {"state_idx": state_idx}
    out, window = causal_conv_invariant(x, weight, bias, activation, conv_state)
    if decode:
        conv_state.copy_(window)
        _compat.count_decode_token(cache, layer_idx, **slot)
    else:
        cache.update_conv_state(x, layer_idx, **slot, conv_kernel_size=kernel_size)
    return out
