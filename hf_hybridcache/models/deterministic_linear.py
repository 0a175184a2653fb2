"""The products of deterministic mode (issue 46): every linear layer its per-family forwards run, in one place; the
invariant causal conv over a cache, which every mixer with a conv window runs alike (:func:`conv_over_cache`), after
reading what the cache holds for the call (:func:`cached_states`); and the delta rule over a cache, which the gated
delta net and KDA mixers run alike (:func:`delta_rule_over_cache`).

Each mixer module (:mod:`.mamba1_deterministic`, :mod:`.mamba2_deterministic`, :mod:`.gated_delta_deterministic`,
:mod:`.short_conv_deterministic`) keeps its own private ``_OFF`` switch set for the power tests and passes it here at
call time, so a test that reassigns a module's ``_OFF`` switches exactly the products that module runs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import _compat
from ..kernels.batch_invariant import invariant_linear
from ..kernels.conv_invariant import causal_conv_invariant
from ..kernels.decode_linear import weight_qualifies
from ..kernels.state_update import causal_conv1d_update
from .decode_linear import wide_threads
from .mamba1 import causal_conv, checkpoint_positions


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


def cached_states(cache, layer_idx: int, seq_len: int) -> tuple[torch.Tensor | None, torch.Tensor | None, bool,
                                                                Sequence[int]]:
    """``(conv_state, recurrent_state, decode, positions)`` of a recurrent mixer's call over ``seq_len`` tokens: the
    conv and recurrent states ``cache`` holds for ``layer_idx`` (None where it holds none), whether the call is a
    decode step (one token over held states, which it updates in place), and the token counts after which the call
    checkpoints its states (none for a decode step)."""
    conv_state = cache.get_conv_state(layer_idx)
    recurrent_state = cache.get_recurrent_state(layer_idx)
    decode = seq_len == 1 and conv_state is not None and recurrent_state is not None
    return conv_state, recurrent_state, decode, () if decode else checkpoint_positions(cache, seq_len)


def conv_over_cache(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                    conv_state: torch.Tensor | None, cache, layer_idx: int, kernel_size: int, decode: bool,
                    state_idx: int | None = None, *, off: Collection[str] = ()) -> torch.Tensor:
    """The invariant causal conv of ``x`` ``[B, C, T]`` (``weight`` ``[C, W]``, ``activation`` None / ``"silu"``)
    continuing ``conv_state`` ``[B, C, W]`` (None: zeros) -> ``[B, C, T]``; the window goes to ``cache``: in place for a
    decode step (``decode``: one token over a held state), which counts its token as the package's decode step does,
    else through ``cache.update_conv_state``. ``state_idx``: the conv's own state slot in its layer (Inkling's four).
    ``off``: the caller's switch set; with ``"conv"`` in it, the package's default conv instead (the fused conv update
    :func:`~hf_hybridcache.kernels.state_update.causal_conv1d_update` for a decode step, else
    :func:`~hf_hybridcache.models.mamba1.causal_conv` over the window ``update_conv_state`` returns)."""
    slot = {} if state_idx is None else {"state_idx": state_idx}
    if "conv" in off:
        if decode:
            out = causal_conv1d_update(x[..., 0], conv_state, weight, bias, activation)[..., None]
            _compat.count_decode_token(cache, layer_idx, **slot)
            return out
        full = cache.update_conv_state(x, layer_idx, **slot, conv_kernel_size=kernel_size)
        return causal_conv(full, weight, bias, activation, x.shape[-1])
    out, window = causal_conv_invariant(x, weight, bias, activation, conv_state)
    if decode:
        conv_state.copy_(window)
        _compat.count_decode_token(cache, layer_idx, **slot)
    else:
        cache.update_conv_state(x, layer_idx, **slot, conv_kernel_size=kernel_size)
    return out

class DeltaRule(NamedTuple):
    """A delta rule's kernels: deterministic mode's invariant ``step`` and ``scan`` (the gated delta net's
    :func:`~hf_hybridcache.kernels.gated_delta_invariant.gated_delta_rule_step_invariant`, KDA's
    :func:`~hf_hybridcache.kernels.kda_invariant.kda_step_invariant`, ...) and the package's ``recurrent`` step and
    ``chunked`` scan, which a mixer's power switch ``"rule"`` runs instead (same arguments as upstream's)."""

    step: Callable
    scan: Callable
    recurrent: Callable
    chunked: Callable


def delta_rule_over_cache(rule: DeltaRule, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          g: torch.Tensor, beta: torch.Tensor, recurrent_state: torch.Tensor | None, cache,
                          layer_idx: int, decode: bool, positions: Sequence[int], conv_checkpoints: Sequence,
                          *, off: Collection[str] = ()) -> torch.Tensor:
    """The rule's output ``[B, T, H, Dv]`` (``query``'s dtype) for ``query`` / ``key`` ``[B, T, Hk, Dk]``, ``value``
    ``[B, T, H, Dv]``, the log decay ``g`` ``[B, T, H]`` (gated delta net) or ``[B, T, H, Dk]`` (KDA) and ``beta``
    ``[B, T, H]``, from ``recurrent_state`` ``[B, H, Dk, Dv]`` float32 (None: zeros). A ``decode`` step (one token
    over a held state) updates the state in place; otherwise the final state goes to ``cache`` and the state after
    each of ``positions`` tokens, beside its ``conv_checkpoints``, to the cache's checkpoints. ``off``: the caller's
    switch set; with ``"rule"`` in it, the rule's ``recurrent`` / ``chunked`` kernels instead.

    Raises:
        ValueError: the cached recurrent state is not float32 (from the invariant rule).
    """
    if decode:
        return _rule_step(rule, off, recurrent_state, query[:, 0], key[:, 0], value[:, 0], g[:, 0], beta[:, 0])[:, None]
    if "rule" in off:
        out, final_state, states = rule.chunked(query, key, value, g, beta, initial_state=recurrent_state,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                emit_positions=positions)
    else:
        out, final_state, states = rule.scan(query, key, value, g, beta, recurrent_state, emit_positions=positions)
    cache.update_recurrent_state(final_state, layer_idx)
    if positions:
        cache.capture_states(layer_idx, positions, list(zip(conv_checkpoints, states)))
    return out


def _rule_step(rule: DeltaRule, off: Collection[str], state, query, key, value, g, beta) -> torch.Tensor:
    """One token in place on the cached state ``[B, H, Dk, Dv]`` float32 -> ``[B, H, Dv]`` in ``query``'s dtype."""
    if "rule" in off:
        out, final, _ = rule.recurrent(query[:, None], key[:, None], value[:, None], g[:, None], beta[:, None],
                                       initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        state.copy_(final)
        return out[:, 0]
    return rule.step(state, query, key, value, g, beta)
