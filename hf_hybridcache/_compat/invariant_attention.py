"""Deterministic mode's attention (issue 46) behind transformers' attention-function convention.

transformers' attention modules call ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``
(``modeling_utils.py``, 5.23 - 5.25) as ``f(module, query [B, H, T, D], key [B, Hkv, K, D], value, attention_mask,
dropout=..., scaling=..., **kwargs) -> (output [B, T, H, Dv], weights or None)``. The model's implementation
(``"sdpa"`` or ``"eager"``) is routed once by :func:`~hf_hybridcache._compat.engine_attention.install_router`, the
router the engine already uses for its steps' masks; a module marked by :func:`mark` is then answered by its mark
(``original`` is the function it would have run), inside an engine step with the step's masks, in ``generate()`` with
the model's own. So ``generate()``, the engine's prefill chunks, decode rows and verify groups reach one kernel,
:func:`~hf_hybridcache.kernels.attention_invariant.attention_invariant`; other models and unmarked modules run as
before.

Masks, as transformers hands them over: a bool mask (True: attend, the sdpa masks), an additive float mask (0:
attend, the eager masks and the engine's), or None: plain causal attention of the last ``T`` of ``K`` positions
(transformers' ``is_causal`` for sdpa; the engine's fresh prefill groups) or, for one query, every key.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import transformers
from packaging.version import Version
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..kernels.attention_invariant import attention_invariant, causal_visible
from .cache_kwargs import CACHE_KWARG_NAMES, find_cache
from .engine_attention import ATTENTION_ATTR, _module_eager, install_router

#: Attention modules hand ``cache.update`` their call's kwargs (``kwargs=kwargs``) from transformers 5.24 on.
_UPDATE_TAKES_KWARGS = Version(transformers.__version__) >= Version("5.24.0.dev0")
#: The attention implementations :func:`mark` can route.
ROUTED = ("sdpa", "eager")


def unroutable(model: torch.nn.Module) -> str | None:
    """Why :func:`mark` cannot route ``model``'s attention (its implementation, with what to do), or None."""
    name = model.config._attn_implementation
    if name in ROUTED + ("paged|eager",):
        return None
    return (f"attn_implementation={name!r} (deterministic mode routes 'sdpa' and 'eager' only: load the model with "
            "attn_implementation='sdpa' or call model.set_attn_implementation('sdpa'))")


def mark(model: torch.nn.Module, modules, forward: Callable) -> None:
    """Answer ``modules``' attention calls (attention modules of ``model``) with ``forward`` (idempotent).

    ``forward`` must be a module-level function (a ``copy.deepcopy`` of the model keeps it, as the package's other
    instance patches).

    Raises:
        ValueError: the model's attention implementation is not ``"sdpa"`` or ``"eager"`` (:func:`unroutable`).
    """
    problem = unroutable(model)
    if problem is not None:
        raise ValueError(f"{type(model).__name__} cannot run deterministic attention: {problem}.")
    install_router(model)
    for module in modules:
        setattr(module, ATTENTION_ATTR, forward)


def invariant_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                scaling: float | None = None, softcap: float | None = None,
                                sliding_window: int | None = None, window_at_zero: bool = False,
                                position_bias: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                                **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature around
    :func:`~hf_hybridcache.kernels.attention_invariant.attention_invariant`: ``query`` ``[B, H, T, D]``, ``key``
    ``[B, Hkv, K, D]``, ``value`` ``[B, Hkv, K, Dv]`` -> ``([B, T, H, Dv]`` in ``query``'s dtype, ``None)``. Other
    keyword arguments (position ids, flash-attention lengths) are not read.

    A ``sliding_window`` (Lara Mini's sliding layers pass theirs) runs the kernel's windowed form, each query's keys
    anchored at the query: the bits do not depend on how many keys the cache holds beyond the window.
    ``window_at_zero`` (the power tests' switch, never in use) runs the form anchored at position 0 instead, the
    window in the mask only: a query's bits then move once the cache drops the keys before its window.
    A ``position_bias`` ``[B, H, T, K]`` (Inkling's relative logits, which its eager function adds to the scaled
    scores) is added to the scores in float32. ``sinks`` ``[B, H, T, 1]`` (Inkling 2's sink logits, which its eager
    function appends to the scores as a last logit with no value) go to the kernel's fixed sink slot.

    Raises:
        ValueError: dropout is on (a training forward), or a logit softcap is asked for (not supported by the kernel
            yet).
    """
    if dropout:
        raise ValueError("Deterministic attention runs inference only: call model.eval() (dropout is on).")
    if softcap is not None:
        raise ValueError(f"Deterministic attention has no logit softcap yet; {type(module).__name__} asked for "
                         f"softcap={softcap}.")
    num_queries, num_keys = query.shape[-2], key.shape[-2]
    if attention_mask is None and num_queries > 1 and getattr(module, "is_causal", True):
        visible = causal_visible(num_queries, num_keys, query.device, window=sliding_window)
    elif attention_mask is None:
        visible = torch.ones(1, 1, num_queries, num_keys, dtype=torch.bool, device=query.device)
    else:
        mask = attention_mask[:, :, :, :num_keys]
        visible = mask if mask.dtype == torch.bool else mask == 0
    bias = None if position_bias is None else position_bias[:, :, :, :num_keys]
    out = attention_invariant(query, key, value, visible, query.shape[-1] ** -0.5 if scaling is None else scaling,
                              window=None if window_at_zero else sliding_window, bias=bias,
                              sinks=None if sinks is None else sinks[..., 0])
    return out.transpose(1, 2).contiguous(), None


def gated_attention_parts(module: torch.nn.Module, kwargs: dict, rotary: str = "apply_rotary_pos_emb") -> tuple:
    """What a copy of a gated attention module's forward (Qwen3.5's, Qwen3-Next's: ``Qwen3_5Attention.forward``;
    Ling's ``BailingHybridAttention.forward`` with ``rotary="apply_rotary_pos_emb_interleave"``; transformers 5.23 -
    5.25) takes from transformers: ``(cache or None, the call's other kwargs, the modeling file's function named
    ``rotary`` (None where it has none: Inkling's), the attention function the module's config names, update)``,
    where
    ``update(key [B, Hkv, T, D], value) -> (keys, values)`` writes the call's KV to the cache as that release does."""
    cache = find_cache(kwargs)
    rest = {name: value for name, value in kwargs.items() if name not in CACHE_KWARG_NAMES}
    modeling = sys.modules[type(module).__module__]
    function = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, _module_eager(module))

    def update(key, value):
        if _UPDATE_TAKES_KWARGS:
            return cache.update(key, value, module.layer_idx, kwargs=rest)
        return cache.update(key, value, module.layer_idx)

    return cache, rest, getattr(modeling, rotary, None), function, update
