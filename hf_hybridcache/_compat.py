"""Everything that knows transformers' internals lives here (tested with transformers 5.23).

- the names a cache travels under in ``generate()`` / ``forward()`` kwargs,
- the live cache layers (``DynamicLayer``, ``LinearAttentionLayer`` and their hybrids) and their private fields,
- ``GenerationMixin._prefill``, which reads ``cache.get_seq_length()`` once and slices the prompt to the uncached part,
- accelerate's instance-level forward hooks, which instance patches must sit under.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers.cache_utils import CacheLayerMixin, DynamicCache, LinearAttentionCacheLayerMixin

TRANSFORMERS_VERSION = transformers.__version__
CACHE_KWARG_NAMES = ("past_key_values", "cache", "cache_params")

try:
    from transformers.integrations.accelerate import force_accelerate_hooks
except ImportError:  # older layouts: the hooks of children then fire through their own forward only

    def force_accelerate_hooks(child_module_names):
        return lambda fn: fn


def find_cache(kwargs: dict[str, Any]) -> Any:
    """The cache object in a forward()/generate() kwargs dict, under whichever name this version uses."""
    for name in CACHE_KWARG_NAMES:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def new_live_layers(config) -> list:
    """Fresh per-layer cache objects, exactly as ``DynamicCache(config=...)`` builds them for this model."""
    return DynamicCache(config=config.get_text_config(decoder=True)).layers


def is_attention_layer(layer) -> bool:
    return isinstance(layer, CacheLayerMixin)


def is_linear_layer(layer) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def get_kv(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Live keys and values ``[B, Hkv, T, D]`` of an attention layer, or None before its first update."""
    if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
        return None
    return layer.keys, layer.values


def set_kv(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make a fresh attention layer hold ``keys``/``values`` ``[B, Hkv, P, D]`` (taken over, not copied)."""
    layer.lazy_initialization(keys[..., :0, :], values[..., :0, :])
    layer.keys, layer.values = keys, values


def get_linear_state(layer, state_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Live (conv state ``[B, C, W]``, SSM state) of a Mamba layer, or None before its first update."""
    if not layer.has_previous_state[state_idx]:
        return None
    return layer.conv_states[state_idx], layer.recurrent_states[state_idx]


def set_linear_state(layer, conv: torch.Tensor, ssm: torch.Tensor, state_idx: int = 0) -> None:
    """Make a fresh Mamba layer hold ``conv``/``ssm`` (taken over, not copied) and say that a state exists, so the
    mixer continues from it instead of treating the next tokens as a fresh prefill."""
    layer.lazy_initialization(conv_states=conv, state_idx=state_idx, conv_kernel_size=conv.shape[-1])
    layer.conv_states[state_idx] = conv
    layer.lazy_initialization(recurrent_states=ssm, state_idx=state_idx)
    layer.recurrent_states[state_idx] = ssm
    layer.has_previous_state[state_idx] = True


def patch_instance_forward(module: torch.nn.Module, make_forward: Callable[[Callable], Callable]) -> bool:
    """Replace ``module.forward`` on this instance only (other instances and the class stay untouched).

    When accelerate has hooked the module, its hook calls ``module._old_forward``, so that is what gets replaced.
    Returns False if the module was already patched (installing twice is a no-op).
    """
    if getattr(module, "_hf_hybridcache_patched", False):
        return False
    target = "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"
    setattr(module, target, make_forward(getattr(module, target)))
    module._hf_hybridcache_patched = True
    return True


def install_prefill_hook(model, on_prefill: Callable) -> None:
    """Call ``on_prefill(model, input_ids, model_kwargs)`` at the start of every ``generate()`` prefill, before
    ``_prefill`` reads ``get_seq_length()`` to slice the prompt. Instance-level and idempotent."""
    if getattr(model, "_hf_hybridcache_prefill_hook", False):
        return
    original = model._prefill

    @functools.wraps(original)
    def _prefill(input_ids, generation_config, model_kwargs, *args, **kwargs):
        on_prefill(model, input_ids, model_kwargs)
        return original(input_ids, generation_config, model_kwargs, *args, **kwargs)

    model._prefill = _prefill
    model._hf_hybridcache_prefill_hook = True


def install_forward_hooks(model, on_pre: Callable, on_post: Callable) -> None:
    """Run ``on_pre(model, args, kwargs)`` before and ``on_post(model)`` after every top-level forward."""
    if getattr(model, "_hf_hybridcache_forward_hooks", False):
        return
    model.register_forward_pre_hook(lambda m, args, kwargs: on_pre(m, args, kwargs), with_kwargs=True)
    model.register_forward_hook(lambda m, args, kwargs, out: on_post(m, kwargs), with_kwargs=True)
    model._hf_hybridcache_forward_hooks = True


def run_forward(model, input_ids: torch.Tensor, cache) -> None:
    """One forward of ``input_ids`` over ``cache``, keeping only the last position's logits where the model can."""
    kwargs = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    model(input_ids, past_key_values=cache, use_cache=True, **kwargs)


def forward_input_ids(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    input_ids = kwargs.get("input_ids")
    if input_ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
        input_ids = args[0]
    return input_ids


def split_mixer_call(args: tuple, kwargs: dict[str, Any]):
    """(hidden_states, cache, attention_mask) of a Mamba mixer call ``(hidden_states, cache_params, attention_mask)``;
    the cache kwarg is ``cache_params`` up to 5.23 and ``cache`` later."""
    hidden_states = args[0] if args else kwargs["hidden_states"]
    cache = args[1] if len(args) > 1 else find_cache(kwargs)
    attention_mask = args[2] if len(args) > 2 else kwargs.get("attention_mask")
    return hidden_states, cache, attention_mask
