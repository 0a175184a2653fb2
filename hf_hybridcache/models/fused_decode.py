"""Fused single-token state updates inside the upstream mixer forwards that call them by module-level name.

The gated delta nets, the short convs and the Mamba-2 mixers run a decode step through functions of their modeling
module (``causal_conv1d_update``, ``torch_recurrent_gated_delta_rule``, ``mamba2_selective_state_update``,
transformers 5.23 - 5.24): torch fallbacks written for any dtype and token count, slow at one token (a oneDNN
``conv1d`` per call, chains of dtype conversions). :func:`route` rebinds those names once to routers that call the
original everywhere except inside :func:`fused`, the context this package's patched mixers open around a
single-token call over a cache in float32 outside the ``"reference"`` kernel backend; there the routers run the
fused updates of :mod:`hf_hybridcache.kernels.state_update` (equal within fp32 round-off; in reduced precision the
reassociated products would round differently from transformers' own decode, which bf16 replies must equal).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable, Iterator

import torch

from .. import _compat
from ..kernels import get_backend
from ..kernels.state_update import causal_conv1d_update, gated_delta_step, mamba2_state_update

_FUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_hybridcache_fused_decode", default=False)


def wanted(hidden_states: torch.Tensor, cache) -> bool:
    """Whether a mixer call on ``hidden_states`` ``[B, T, hidden]`` over ``cache`` runs its decode fused: one token
    in float32 over one of this package's caches (the engine's group views, ``generate()``'s live cache: they answer
    ``checkpoint_positions``; another cache runs transformers' own decode, bit-identical), outside the
    ``"reference"`` backend."""
    return (hidden_states.shape[1] == 1 and hasattr(cache, "checkpoint_positions")
            and hidden_states.dtype == torch.float32 and get_backend() != "reference")


@contextlib.contextmanager
def fused() -> Iterator[None]:
    """The routed decode functions called in this context (this thread) run the fused state updates."""
    token = _FUSED.set(True)
    try:
        yield
    finally:
        _FUSED.reset(token)


def _bind(parameters: tuple[str, ...], args: tuple, kwargs: dict, extra: bool = False) -> dict | None:
    """The call's arguments by name; None for arguments the function does not take (``extra``: the torch path takes
    and ignores other keywords, as transformers' do)."""
    if len(args) > len(parameters):
        return None
    call = dict(zip(parameters, args), **kwargs)
    return call if extra or call.keys() <= set(parameters) else None


_CONV_PARAMETERS = ("hidden_states", "conv_state", "weight", "bias", "activation")


def _conv_update(original: Callable, *args, **kwargs):
    """``causal_conv1d_update(hidden_states [B, C, 1], conv_state [B, C, W], weight [C, W], bias, activation)``."""
    call = _bind(_CONV_PARAMETERS, args, kwargs) if _FUSED.get() else None
    if call is None or "weight" not in call or call["hidden_states"].shape[-1] != 1:
        return original(*args, **kwargs)
    out = causal_conv1d_update(call["hidden_states"][..., 0], call["conv_state"], call["weight"], call.get("bias"),
                               call.get("activation"))
    return out.unsqueeze(-1)


_GDN_PARAMETERS = ("query", "key", "value", "g", "beta", "initial_state", "output_final_state",
                   "use_qk_l2norm_in_kernel", "cu_seqlens")


def _gated_delta_step(original: Callable, *args, **kwargs):
    """``torch_recurrent_gated_delta_rule(query, key, value, g=, beta=, initial_state=, output_final_state=,
    use_qk_l2norm_in_kernel=, cu_seqlens=)`` for one token over a cached state."""
    call = _bind(_GDN_PARAMETERS, args, kwargs, extra=True) if _FUSED.get() else None
    if (call is None or call["query"].shape[1] != 1 or call.get("initial_state") is None
            or call.get("cu_seqlens") is not None):
        return original(*args, **kwargs)
    out, state = gated_delta_step(call["query"], call["key"], call["value"], call["g"], call["beta"],
                                  call["initial_state"], call.get("use_qk_l2norm_in_kernel", False))
    return out, state if call.get("output_final_state") else None


_MAMBA2_PARAMETERS = ("state", "hidden_states", "dt", "A", "B", "C", "D", "dt_bias", "dt_softplus", "z")


def _mamba2_state_update(original: Callable, *args, **kwargs):
    """``mamba2_selective_state_update(state, hidden_states, dt, A, B, C, D, dt_bias=, dt_softplus=, z=)``."""
    call = _bind(_MAMBA2_PARAMETERS, args, kwargs, extra=True) if _FUSED.get() else None
    if call is None or call["state"].dtype != torch.float32:
        return original(*args, **kwargs)
    return mamba2_state_update(*(call.get(name) for name in _MAMBA2_PARAMETERS[:8]),
                               dt_softplus=call.get("dt_softplus", False), z=call.get("z"))


#: The routers, by the name of the function they stand in for.
ROUTERS = {
    "causal_conv1d_update": _conv_update,
    "torch_recurrent_gated_delta_rule": _gated_delta_step,
    "mamba2_selective_state_update": _mamba2_state_update,
}


def route(module_name: str, names: tuple[str, ...]) -> None:
    """Route the functions ``names`` (keys of :data:`ROUTERS`) of the modeling module ``module_name`` (idempotent;
    a name the module lacks is skipped: its mixer runs the step another way)."""
    for name in names:
        if hasattr(sys.modules[module_name], name):
            _compat.route_module_function(module_name, name, ROUTERS[name])
