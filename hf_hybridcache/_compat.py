"""Everything that knows transformers' internals lives here (tested with transformers 5.23).

- the names a cache travels under in ``generate()`` / ``forward()`` kwargs,
- the live cache layers (``DynamicLayer``, ``LinearAttentionLayer`` and their hybrids) and their private fields,
- ``GenerationMixin._prefill``, which reads ``cache.get_seq_length()`` once and slices the prompt to the uncached part,
- accelerate's instance-level forward hooks, which instance patches must sit under, and its per-module execution
  devices and offloaded weights.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import threading
from collections.abc import Callable, Iterator
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


def patch_instance_forward(module: torch.nn.Module, patched: Callable) -> bool:
    """Route this instance's forward through ``patched(module, original_forward, *args, **kwargs)``; other instances
    and the class stay untouched.

    When accelerate has hooked the module, its hook calls ``module._old_forward``, so that is what gets replaced.
    Everything installed is a bound method or a module-level function, so ``copy.deepcopy`` of the model rebinds it
    to the copy (a closure over this instance would make a copy run the original's weights) and pickling works.
    Returns False if the module was already patched (installing twice is a no-op).
    """
    if getattr(module, "_hf_hybridcache_patched", False):
        return False
    target = "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"
    module._hf_hybridcache_original_forward = getattr(module, target)
    module._hf_hybridcache_forward_impl = patched
    setattr(module, target, _InstanceHook(module, "forward", _patched_forward))
    module._hf_hybridcache_patched = True
    return True


class _InstanceHook:
    """Stands in for ``owner.<name>`` on one instance and calls ``impl(owner, *args, **kwargs)``.

    A plain object rather than a closure or a bound method: ``copy.deepcopy`` of the owner rebinds it to the copy,
    ``pickle`` stores it by reference to ``impl``, and ``inspect.signature`` reports the original method's signature
    (transformers inspects ``prepare_inputs_for_generation`` and ``forward``).
    """

    def __init__(self, owner, name: str, impl: Callable) -> None:
        self.owner, self.name, self.impl = owner, name, impl

    def __call__(self, *args, **kwargs):
        return self.impl(self.owner, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(getattr(type(self.owner), self.name).__get__(self.owner))


def _patched_forward(self, *args, **kwargs):
    return self._hf_hybridcache_forward_impl(self, self._hf_hybridcache_original_forward, *args, **kwargs)


def install_request_hooks(model, on_request: Callable, on_generate: Callable) -> None:
    """Hook the start of every request, instance-level and idempotent (module-level functions bound to the model,
    so a deep copy of the model hooks the copy).

    ``generate()`` looks its decoding methods up on the class, so the hooks sit on the instance methods they call:

    - ``on_request(model, input_ids, model_kwargs, generation_config)`` runs at the start of ``_prefill`` (greedy,
      sampling, beams), before it reads ``get_seq_length()`` to slice the prompt, and in
      ``_get_candidate_generator``, which assisted decoding (prompt lookup, assistant models) calls before its first
      forward. It returns the number of restored tokens.
    - Assisted decoding's first forward feeds the whole prompt (``next_sequence_length=None``); when tokens were
      restored, ``prepare_inputs_for_generation`` slices it to the uncached part as ``_prefill`` would.
    - ``on_generate(model, kwargs)`` wraps ``generate()`` and returns a context manager for the call.
    """
    if getattr(model, "_hf_hybridcache_request_hooks", False):
        return
    model._hf_hybridcache_on_request = on_request
    model._hf_hybridcache_on_generate = on_generate
    for name, hook in (
        ("_prefill", _hooked_prefill),
        ("_get_candidate_generator", _hooked_candidate_generator),
        ("prepare_inputs_for_generation", _hooked_prepare_inputs),
        ("generate", _hooked_generate),
    ):
        setattr(model, name, _InstanceHook(model, name, hook))
    model._hf_hybridcache_request_hooks = True


def _hooked_prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
    self._hf_hybridcache_on_request(self, input_ids, model_kwargs, generation_config)
    return type(self)._prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs)


def _hooked_candidate_generator(self, *args, **kwargs):
    bound = inspect.signature(type(self)._get_candidate_generator).bind(self, *args, **kwargs).arguments
    model_kwargs = bound["model_kwargs"]
    restored = self._hf_hybridcache_on_request(self, bound["input_ids"], model_kwargs, bound["generation_config"])
    if restored:
        find_cache(model_kwargs)._slice_first_forward = restored
    return type(self)._get_candidate_generator(self, *args, **kwargs)


def _hooked_prepare_inputs(self, input_ids, *args, **kwargs):
    cache = find_cache(kwargs)
    restored = getattr(cache, "_slice_first_forward", 0)
    if restored and not args and kwargs.get("next_sequence_length") is None:
        cache._slice_first_forward = 0
        kwargs["next_sequence_length"] = input_ids.shape[1] - restored
    return type(self).prepare_inputs_for_generation(self, input_ids, *args, **kwargs)


def _hooked_generate(self, *args, **kwargs):
    with self._hf_hybridcache_on_generate(self, kwargs):
        return type(self).generate(self, *args, **kwargs)


_STATEFUL_LOCK = threading.Lock()
_MISSING = object()


@contextlib.contextmanager
def allow_speculative_decoding(model):
    """Context manager: let ``generate()`` accept prompt lookup / assistant models for this stateful model (it refuses
    them because a recurrent state cannot be rolled back; a HybridPrefixCache can roll it back).

    Counted per model, so that calls with different caches in several threads never leave the override behind."""
    with _STATEFUL_LOCK:
        depth = vars(model).get("_hf_hybridcache_stateful_depth", 0)
        if depth == 0:
            model._hf_hybridcache_stateful_saved = vars(model).get("_is_stateful", _MISSING)
            model._is_stateful = False
        model._hf_hybridcache_stateful_depth = depth + 1
    try:
        yield
    finally:
        with _STATEFUL_LOCK:
            model._hf_hybridcache_stateful_depth -= 1
            if model._hf_hybridcache_stateful_depth == 0:
                saved = model._hf_hybridcache_stateful_saved
                if saved is _MISSING:
                    del model._is_stateful
                else:
                    model._is_stateful = saved


def crop_kv(layer, num_tokens: int) -> None:
    """Drop the last ``num_tokens`` positions of an attention layer's live KV."""
    layer.keys = layer.keys[..., :-num_tokens, :]
    layer.values = layer.values[..., :-num_tokens, :]


def install_forward_hooks(model, on_pre: Callable, on_post: Callable) -> None:
    """Run ``on_pre(model, args, kwargs)`` before and ``on_post(model, args, kwargs, output)`` after every top-level
    forward; ``on_post`` also runs when the forward (or ``on_pre``) raised, with ``output=None``. Module-level
    functions, so the hooks survive deep copies and pickling."""
    if getattr(model, "_hf_hybridcache_forward_hooks", False):
        return
    model.register_forward_pre_hook(on_pre, with_kwargs=True)
    model.register_forward_hook(on_post, with_kwargs=True, always_call=True)
    model._hf_hybridcache_forward_hooks = True


def run_forward(model, input_ids: torch.Tensor, cache) -> None:
    """One forward of ``input_ids`` over ``cache``, keeping only the last position's logits where the model can.

    Position ids are passed as ``generate()`` passes them: Bamba's forward numbers positions from 0 when they are
    missing, whatever the cache already holds (transformers 5.23).
    """
    kwargs = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    past = cache.get_seq_length()
    position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)[None]
    model(input_ids, past_key_values=cache, use_cache=True, position_ids=position_ids, **kwargs)


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


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers; layer ``i`` owns cache layer ``i`` in every supported family."""
    return model.model.layers


def _accelerate_hooks(module) -> list:
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", [hook]))  # a SequentialHook holds several


def execution_device(module: torch.nn.Module) -> torch.device | None:
    """The device ``module`` computes on: the execution device of accelerate's hook on it or on a submodule
    (offloaded weights sit on the meta device or in host memory and are moved there for each forward), else the
    device of its first parameter or buffer that is not on the meta device; None if there is none."""
    for sub in module.modules():
        for hook in _accelerate_hooks(sub):
            device = getattr(hook, "execution_device", None)
            if device is not None:
                return torch.device(device)
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return None


def parameter_values(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(qualified name, value)`` of every parameter, in module order. A parameter that accelerate offloaded (on the
    meta device between forwards) is read from its hook's weights map; one that cannot be found stays on meta."""
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if param.device.type == "meta":
                for hook in _accelerate_hooks(module):
                    weights_map = getattr(hook, "weights_map", None)
                    if weights_map is not None and name in weights_map:
                        param = weights_map[name]
                        break
            yield f"{module_name}.{name}" if module_name else name, param
