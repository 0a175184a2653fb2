"""The attention masks of an engine step, handed to transformers' own attention functions.

Inside a continuous-batching step (:mod:`hf_hybridcache.engine`) every attention module is called once per group of
requests, with keys and values read from the page pool for the group: the decode group's rows are left-padded to
the longest one, a prefill group's rows continue from a common past. Which keys a query may see (padding, the
causal offset of the past, a sliding window) only the step knows, so the attention implementation the model uses is
registered again in transformers' ``AttentionInterface`` (``modeling_utils.py``, 5.23 - 5.24) as a router that,
inside a group call (a context variable set by :func:`group_attention`), replaces the module's ``attention_mask``
by the group's mask and calls the original function: transformers' ``sdpa_attention_forward``, or the module's own
``eager_attention_forward`` for eager models. Everything else (grouped-query packing, position biases, softcaps,
scaling) stays transformers'. Outside a group call the router calls the original unchanged, so other models and
``generate()`` calls in other threads are untouched. A module that carries :data:`ATTENTION_ATTR` (deterministic
mode, :mod:`.invariant_attention`) is answered by it, in and outside group calls.

Private names used: ``AttentionInterface.register``/``get``, the module-level ``eager_attention_forward`` of each
modeling file (what ``get_interface("eager", eager_attention_forward)`` falls back to).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

#: The attention implementations the engine serves (flash implementations take no 4D masks).
SUPPORTED = ("sdpa", "eager")
#: An attention module attribute holding ``(original, module, query, key, value, attention_mask, *args, **kwargs)
#: -> (output, weights)``, which the router calls instead of ``original`` (deterministic mode's attention,
#: :mod:`.invariant_attention`), with the step's mask inside a group call.
ATTENTION_ATTR = "_hf_hybridcache_attention"


class GroupAttention(Protocol):
    def attention_mask(self, query: torch.Tensor, key: torch.Tensor, explicit: bool) -> torch.Tensor | None:
        """The additive mask ``[G or 1, 1, T, K]`` of the layer being run for ``query`` ``[G, H, T, D]`` over
        ``key`` ``[G, Hkv, K, D]``; None when plain causal attention (``explicit`` False) needs none."""


_GROUP: contextvars.ContextVar[GroupAttention | None] = contextvars.ContextVar("hf_hybridcache_group", default=None)


@contextlib.contextmanager
def group_attention(group: GroupAttention) -> Iterator[None]:
    """Attention calls in this context (this thread) use ``group``'s masks."""
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)


def install_router(model: torch.nn.Module) -> None:
    """Route ``model``'s attention implementation (idempotent).

    Raises:
        ValueError: the model uses an attention implementation the engine cannot mask (flash attention, flex).
    """
    name = model.config._attn_implementation
    if name == "paged|eager":
        # transformers' own manager switches an eager model to its paged eager attention before it refuses a hybrid
        # ("Invalid layer type") and only switches back in stop(), which it never reaches: undo it here.
        model.set_attn_implementation("eager")
        name = "eager"
    if name not in SUPPORTED:
        raise ValueError(
            f"Continuous batching with HybridPrefixCache needs attn_implementation 'sdpa' or 'eager', and this model "
            f"uses {name!r}; load it with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))."
        )
    current = ALL_ATTENTION_FUNCTIONS.get(name)
    if getattr(current, "_hf_hybridcache_routed", False):
        return
    routed = functools.partial(_route, current, name == "eager")
    routed._hf_hybridcache_routed = True
    AttentionInterface.register(name, routed)


def _route(original: Callable | None, eager: bool, module, query, key, value, attention_mask, *args, **kwargs):
    function = original if original is not None else _module_eager(module)
    group = _GROUP.get()
    if group is not None:
        attention_mask = group.attention_mask(query, key, explicit=eager)
    marked = getattr(module, ATTENTION_ATTR, None)
    if marked is not None:
        return marked(function, module, query, key, value, attention_mask, *args, **kwargs)
    return function(module, query, key, value, attention_mask, *args, **kwargs)


def _module_eager(module) -> Callable:
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        raise ValueError(
            f"{type(module).__name__} has no module-level eager_attention_forward to route; load the model with "
            "attn_implementation='sdpa' to serve it with continuous batching."
        )
    return function
