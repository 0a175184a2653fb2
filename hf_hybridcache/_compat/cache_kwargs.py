"""How a call hands over its cache: the keyword a model's ``generate()`` / ``forward()`` takes it under (per
transformers version and model), where it sits in a mixer call, the mixer's padding mask, and whether ``_prefill``
slices the prompt by the cache's length itself.

transformers renamed the keyword (``past_key_values`` -> ``cache`` in 5.24; the pure state-space models Mamba,
Falcon-Mamba and Mamba-2 took ``cache_params`` up to 5.23 and ignore any other name), and its ``_prefill`` slices a
cache of linear layers only (Mamba's) from 5.25 on.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import transformers
from packaging.version import Version

#: The kwarg a cache travels under: ``past_key_values`` (renamed ``cache`` in transformers 5.24; mixers got
#: ``cache_params`` up to 5.23).
CACHE_KWARG_NAMES = ("past_key_values", "cache", "cache_params")
#: The name ``generate()`` and ``forward()`` take the cache under in the installed transformers: ``cache`` from 5.24
#: (``past_key_values`` still works there, with a ``FutureWarning``), ``past_key_values`` before.
CACHE_KWARG = "cache" if Version(transformers.__version__) >= Version("5.24.0.dev0") else "past_key_values"
#: transformers' ``_prefill`` slices the prompt by the length of a cache of linear layers only (Mamba's) from 5.25 on;
#: before, it feeds such a cache the whole prompt.
PREFILL_SLICES_LINEAR_CACHES = Version(transformers.__version__) >= Version("5.25.0.dev0")


@functools.cache
def _cache_kwarg_of(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache_params" if "cache_params" in parameters and CACHE_KWARG not in parameters else CACHE_KWARG


def cache_kwarg(model) -> str:
    """The name ``model``'s ``generate()`` and ``forward()`` take a cache under: :data:`CACHE_KWARG`, or
    ``cache_params`` where its forward takes only that (Mamba, Falcon-Mamba and Mamba-2 on 5.23, whose ``generate()``
    refuses ``past_key_values`` as unused)."""
    return _cache_kwarg_of(type(model))


def find_cache(kwargs: dict[str, Any]) -> Any:
    """The cache object in a forward()/generate() kwargs dict, under whichever name this version uses."""
    for name in CACHE_KWARG_NAMES:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def prefill_slices(cache, model_kwargs: dict) -> bool:
    """Whether transformers' ``_prefill`` slices the prompt by ``cache.get_seq_length()`` itself: it looks the cache
    up under :data:`CACHE_KWARG` only (not under Mamba's ``cache_params`` on 5.23), and before 5.25 skips a cache of
    linear layers only (5.24)."""
    return model_kwargs.get(CACHE_KWARG) is cache and (PREFILL_SLICES_LINEAR_CACHES or not all(cache.is_linear))


def split_mixer_call(args: tuple, kwargs: dict[str, Any]):
    """(hidden_states, cache, attention_mask) of a Mamba mixer call ``(hidden_states, cache_params, attention_mask)``;
    the cache kwarg is ``cache_params`` up to 5.23 and ``cache`` later. A cache kwarg, even None, wins over the second
    positional argument (Inkling 2's dynamic short conv takes its tap input there)."""
    hidden_states = args[0] if args else kwargs["hidden_states"]
    if any(name in kwargs for name in CACHE_KWARG_NAMES):
        cache = find_cache(kwargs)
    else:
        cache = args[1] if len(args) > 1 else None
    attention_mask = args[2] if len(args) > 2 else kwargs.get("attention_mask")
    return hidden_states, cache, attention_mask


def with_local_mixer_mask(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A Mamba mixer call ``(hidden_states [B, T, H], cache, attention_mask)`` with its padding mask cut to the call's
    own ``T`` positions (a 2D mask longer than that: its last ``T`` columns) and anything but a 2D mask (the engine's
    per-layer-type mapping) replaced by None, as ``create_recurrent_attention_mask`` does for the hybrids' mixers
    (5.25). The pure state-space models (Mamba, Falcon-Mamba, Mamba-2) hand their mixers the model's mask as it is,
    which covers the positions the cache already holds when a forward continues a padded batch."""
    hidden_states, _, mask = split_mixer_call(args, kwargs)
    if mask is None:
        return args, kwargs
    seq_len = hidden_states.shape[1]
    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
        if mask.shape[1] == seq_len:
            return args, kwargs
        local = mask[:, -seq_len:]
    else:
        local = None
    if len(args) > 2:
        return (*args[:2], local, *args[3:]), kwargs
    return args, {**kwargs, "attention_mask": local}
