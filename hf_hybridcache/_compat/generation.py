"""The generate() and forward() wrappers: where a call enters the package.

``generate()`` looks its decoding methods up on the class, so the wrappers sit on the instance methods it calls
(each an :class:`~hf_hybridcache._compat.accelerate._InstanceHook`, so deep copies and pickles of the model keep
them):

- ``generate`` -> ``hooks.generate_call(cache)``, a context manager around the whole call (the cache's lock);
- ``_prefill`` (greedy, sampling, beams) and ``_get_candidate_generator`` (assisted decoding) ->
  ``hooks.begin_request(cache, ...)`` before ``generate()`` reads ``cache.get_seq_length()`` and slices the prompt;
- ``prepare_inputs_for_generation``: assisted decoding's first forward re-feeds the whole prompt, so after a restore
  it is sliced to the uncached tail as ``_prefill`` would;
- ``_maybe_prepare_encoder_kwargs_for_generation``: a vision-language wrapper's images are encoded after the
  request's restore instead of before it (``hooks.defer_images``, then ``hooks.encode_images`` in ``_prefill``), so
  that the images inside the restored prefix are not encoded at all;
- ``_get_stopping_criteria``: the criteria are observed, so the rows ``generate()`` finishes (and then feeds the pad
  id) stop storing -> ``hooks.rows_done(cache, is_done)``;
- ``forward`` -> ``hooks.forward_call(cache, ...)``, a context manager around every forward (also direct
  ``model(ids, past_key_values=cache)`` calls).

The context managers release what they take in ``finally``, so any ``BaseException`` (``KeyboardInterrupt``,
``SystemExit``) raised inside a call leaves no lock held.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList

from . import attention, kernel_notices
from .accelerate import _InstanceHook, patch_instance_forward
from .cache_kwargs import CACHE_KWARG_NAMES, cache_kwarg, find_cache, prefill_slices

#: The generate() call running in this thread (or task), for the hooks that get no kwargs.
_GENERATING: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("hf_hybridcache_generating", default=None)


@dataclass
class _Call:
    """One running ``generate()`` call with the package's cache.

    Attributes:
        cache: the call's cache.
        slice_first_forward: restored tokens that assisted decoding's first forward must skip (0: none, or done).
        images: what ``hooks.defer_images`` returned for the call's images (None: none, or not deferred).
    """

    cache: Any
    slice_first_forward: int = 0
    images: Any = None


@dataclass(frozen=True)
class Hooks:
    """What the package does at each point of a call (module-level functions, so the model still deep-copies).

    Attributes:
        find: ``(model, kwargs) -> cache or None``: the package's cache in a call's kwargs (raises ``ValueError`` for
            a cache built for another model).
        generate_call: ``cache -> context manager`` held for one ``generate()`` call.
        begin_request: ``(cache, *, input_ids, attention_mask, inputs_embeds, use_cache, decode_tokens) -> int``:
            start a request that feeds at most ``decode_tokens`` tokens after its prompt, return the restored prompt
            tokens.
        forward_call: ``(cache, *, input_ids, inputs_embeds, use_cache) -> context manager`` held for one forward.
        rows_done: ``(cache, is_done)`` after each decoding step of a batch whose finished rows are fed the pad id
            from the next step on: ``is_done`` ``[B]`` bool is what ``generate()``'s stopping criteria said.
        defer_images: ``(model, input_ids, model_kwargs, generation_config) -> (images, encode_now)`` where
            ``generate()`` would encode a vision-language wrapper's images: ``images`` goes to ``begin_request``
            (None: the call has none); ``encode_now``: let ``generate()`` encode them as usual (else they were taken
            out of ``model_kwargs``, to be encoded by ``encode_images``).
        encode_images: ``(cache, images, model_kwargs)`` after ``begin_request``: put the features of the images
            the restored prefix does not cover into ``model_kwargs``.
    """

    find: Callable[[torch.nn.Module, dict], Any]
    generate_call: Callable[[Any], AbstractContextManager]
    begin_request: Callable[..., int]
    forward_call: Callable[..., AbstractContextManager]
    rows_done: Callable[[Any, torch.Tensor], None]
    defer_images: Callable[..., tuple[Any, bool]] | None = None
    encode_images: Callable[[Any, Any, dict], None] | None = None


def install_hooks(model: torch.nn.Module, hooks: Hooks) -> None:
    """Wrap this model instance's ``generate``, ``_prefill``, ``_get_candidate_generator``,
    ``prepare_inputs_for_generation`` and ``forward`` (idempotent; other instances and the class stay untouched)."""
    if getattr(model, "_hf_hybridcache_hooks", None) is not None:
        return
    model._hf_hybridcache_hooks = hooks
    for name, wrapper in (
        ("_prefill", _hooked_prefill),
        ("_get_candidate_generator", _hooked_candidate_generator),
        ("prepare_inputs_for_generation", _hooked_prepare_inputs),
        ("_get_stopping_criteria", _hooked_stopping_criteria),
        ("_maybe_prepare_encoder_kwargs_for_generation", _hooked_encoder_kwargs),
        ("generate", _hooked_generate),
    ):
        setattr(model, name, _InstanceHook(model, name, wrapper))
    patch_instance_forward(model, _wrapped_forward)
    attention.route_grouped_query_sdpa()


def _hooked_generate(self, *args, **kwargs):
    hooks = self._hf_hybridcache_hooks
    cache = hooks.find(self, kwargs)
    if cache is None:
        return type(self).generate(self, *args, **kwargs)
    wanted = cache_kwarg(self)
    if wanted == "cache_params" and _assisted(kwargs):
        raise ValueError(
            f"Prompt lookup and assistant models need transformers 5.24 or 5.25 for {type(self).__name__}: 5.23's "
            "assisted decoding looks for the cache under past_key_values, and this model takes it as cache_params "
            "(transformers 5.23 refuses it without hf_hybridcache too). Install transformers 5.24 or 5.25, or "
            "generate without prompt_lookup_num_tokens / assistant_model."
        )
    if kwargs.get(wanted) is not cache:
        # The cache under the other version's name (``cache=`` on 5.23, which refuses it; ``past_key_values=`` on
        # 5.24, which warns; ``past_key_values=`` for Mamba on 5.23): handed on under the name this model takes, so
        # one call works on every version.
        name = next(n for n in CACHE_KWARG_NAMES if kwargs.get(n) is cache)
        if wanted not in kwargs or kwargs[wanted] is None:
            kwargs[wanted] = kwargs.pop(name)
    token = _GENERATING.set(_Call(cache))
    try:
        with hooks.generate_call(cache), allow_speculative_decoding(self):
            return type(self).generate(self, *args, **kwargs)
    finally:
        _GENERATING.reset(token)


def _assisted(kwargs: dict) -> bool:
    """Whether a ``generate()`` call asks for prompt lookup or an assistant model (by keyword or its config)."""
    config = kwargs.get("generation_config")
    names = ("prompt_lookup_num_tokens", "assistant_model")
    return any(kwargs.get(n) is not None or getattr(config, n, None) is not None for n in names)


def _hooked_stopping_criteria(self, *args, **kwargs):
    """``generate()``'s stopping criteria, observed: which rows they finish is generate()'s own notion of a finished
    row (from the next step on it feeds such a row the pad id when an EOS criterion is present)."""
    criteria = type(self)._get_stopping_criteria(self, *args, **kwargs)
    call = _GENERATING.get()
    if call is None or not any(hasattr(c, "eos_token_id") for c in criteria):
        return criteria
    return _ObservedStoppingCriteria(criteria, self._hf_hybridcache_hooks.rows_done, call.cache)


class _ObservedStoppingCriteria(StoppingCriteriaList):
    def __init__(self, criteria, on_done: Callable, cache) -> None:
        super().__init__(criteria)
        self._on_done, self._cache = on_done, cache

    def __call__(self, input_ids, scores, **kwargs):
        is_done = super().__call__(input_ids, scores, **kwargs)
        self._on_done(self._cache, is_done)
        return is_done


def _hooked_encoder_kwargs(self, inputs_tensor, model_kwargs, *args, **kwargs):
    """Images of a call with the package's cache are handed to ``hooks.defer_images`` first."""
    call, hooks = _GENERATING.get(), self._hf_hybridcache_hooks
    if call is not None and hooks.defer_images is not None and hooks.find(self, model_kwargs) is call.cache:
        generation_config = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
        input_ids = model_kwargs.get("input_ids", inputs_tensor)
        call.images, encode_now = hooks.defer_images(self, input_ids, model_kwargs, generation_config)
        if not encode_now:
            return model_kwargs
    return type(self)._maybe_prepare_encoder_kwargs_for_generation(self, inputs_tensor, model_kwargs, *args, **kwargs)


def _begin_request(model, input_ids, model_kwargs: dict, generation_config) -> int:
    hooks = model._hf_hybridcache_hooks
    cache = hooks.find(model, model_kwargs)
    if cache is None:
        return 0
    call = _GENERATING.get()
    images = call.images if call is not None and call.cache is cache else None
    restored = hooks.begin_request(
        cache,
        input_ids=input_ids,
        attention_mask=model_kwargs.get("attention_mask"),
        inputs_embeds=model_kwargs.get("inputs_embeds"),
        use_cache=model_kwargs.get("use_cache"),
        decode_tokens=_decode_tokens(input_ids, generation_config),
        images=images,
    )
    if images is not None:
        hooks.encode_images(cache, images, model_kwargs)
    return restored


def _decode_tokens(input_ids: torch.Tensor, generation_config) -> int:
    """Tokens ``generate()`` feeds the model after the prompt: ``max_length`` (which ``generate()`` has set from
    ``max_new_tokens`` by the time it prefills) minus the prompt, less the last sampled token, which no forward sees."""
    max_length = getattr(generation_config, "max_length", None)
    if not isinstance(max_length, int):
        return 0
    return max(max_length - input_ids.shape[1] - 1, 0)


def _hooked_prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
    _begin_request(self, input_ids, model_kwargs, generation_config)
    cache = self._hf_hybridcache_hooks.find(self, model_kwargs)
    if cache is not None and not prefill_slices(cache, model_kwargs):
        # A cache of Mamba layers only, before 5.25: _prefill would feed it the whole prompt over the restored state,
        # so it is given the part the cache does not hold, as it slices any other cache (its mask stays whole: the
        # prompt then looks like "only the new tokens", which _prefill leaves as they are).
        input_ids = input_ids[:, cache.get_seq_length():]
    return type(self)._prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs)


def _hooked_candidate_generator(self, *args, **kwargs):
    bound = inspect.signature(type(self)._get_candidate_generator).bind(self, *args, **kwargs).arguments
    model_kwargs = bound["model_kwargs"]
    restored = _begin_request(self, bound["input_ids"], model_kwargs, bound["generation_config"])
    if restored:  # only a hooked generate() call restores
        _GENERATING.get().slice_first_forward = restored
    return type(self)._get_candidate_generator(self, *args, **kwargs)


def _hooked_prepare_inputs(self, input_ids, *args, **kwargs):
    call = _GENERATING.get()
    restored = call.slice_first_forward if call is not None and call.cache is find_cache(kwargs) else 0
    if restored and not args and kwargs.get("next_sequence_length") is None:
        call.slice_first_forward = 0
        kwargs["next_sequence_length"] = input_ids.shape[1] - restored
    return type(self).prepare_inputs_for_generation(self, input_ids, *args, **kwargs)


def _wrapped_forward(model, original_forward, *args, **kwargs):
    hooks = model._hf_hybridcache_hooks
    cache = hooks.find(model, kwargs)
    if cache is None:
        return original_forward(*args, **kwargs)
    checkpointing = model.training and model.is_activation_checkpointing
    if cache_kwarg(model) == "cache_params" and kwargs.get("cache_params") is None and not checkpointing:
        # Mamba on 5.23 takes any other name into its **kwargs unread and would run on a fresh cache of its own. (With
        # activation checkpointing in training the layers of every other model drop the cache, and so does this one:
        # 5.23's GradientCheckpointingLayer would not drop cache_params.)
        kwargs["cache_params"] = kwargs.pop(next(n for n in CACHE_KWARG_NAMES if kwargs.get(n) is cache))
    input_ids = kwargs.get("input_ids")
    if input_ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
        input_ids = args[0]
    scope = hooks.forward_call(
        cache, input_ids=input_ids, inputs_embeds=kwargs.get("inputs_embeds"), use_cache=kwargs.get("use_cache")
    )
    with scope, attention.package_forward(), kernel_notices.package_forward(model):
        if len(args) <= 1:
            ids_or_embeds = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
            _fill_position_ids(model, cache, ids_or_embeds, kwargs)
        return original_forward(*args, **kwargs)


@functools.cache
def _takes_position_ids(model_class: type) -> bool:
    return "position_ids" in inspect.signature(model_class.forward).parameters


def _fill_position_ids(model, cache, ids_or_embeds, kwargs: dict) -> None:
    """A direct forward over a non-empty cache without ``position_ids`` or a mask gets the positions ``generate()``
    would pass: Bamba (5.23) numbers them from 0 whatever the cache holds, so a decoding loop of its own would run,
    and store, KV at the wrong rotary positions; every other family counts from the cache's length already."""
    if ids_or_embeds is None or kwargs.get("position_ids") is not None or kwargs.get("attention_mask") is not None:
        return
    past = cache.get_seq_length()
    if past and _takes_position_ids(type(model)):
        kwargs["position_ids"] = torch.arange(past, past + ids_or_embeds.shape[1], device=ids_or_embeds.device)[None]


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


def run_forward(model, input_ids: torch.Tensor, cache) -> None:
    """One forward of ``input_ids`` ``[1, T]`` over ``cache``, keeping only the last position's logits where the model
    can.

    Position ids are passed as ``generate()`` passes them: Bamba's forward numbers positions from 0 when they are
    missing, whatever the cache already holds (transformers 5.23).
    """
    kwargs = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    past = cache.get_seq_length()
    position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)[None]
    kwargs[cache_kwarg(model)] = cache
    model(input_ids, use_cache=True, position_ids=position_ids, **kwargs)

