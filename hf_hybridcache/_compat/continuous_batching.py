"""transformers' continuous batching, as the engine (:mod:`hf_hybridcache.engine`) uses it: its data classes, its
logits processors, and the instance hook that makes ``model.init_continuous_batching`` return the engine's manager.

transformers' ``generate_batch``, ``continuous_batching_context_manager`` and ``transformers serve
--continuous-batching`` all get their manager from ``self.init_continuous_batching(...)``
(``generation/continuous_batching/continuous_api.py``, 5.23.0 and 5.24.0), so an instance attribute of that name
routes all of them to the engine, and their own code (request ids, result ordering, progress bars) runs unchanged.
transformers' ``generate_batch`` reads only ``max_new_tokens`` of its ``**kwargs`` and drops the others silently;
the instance's ``generate_batch`` hook sets the ``GenerationConfig`` fields among them on a copy of the config (as
``generate()`` does, so the engine applies or refuses each one) and refuses any other keyword.
Reused as data or stateless helpers: ``GenerationOutput``, ``RequestStatus``, ``ContinuousBatchingConfig``,
``ContinuousBatchingLogitsProcessorList`` (per-request temperature / top-k / top-p) and
``model._get_logits_processor``. Its per-request processors read ``request.state.logit_processor_kwargs`` of the
requests they get (``cb_logits_processors.py``), which :func:`processor_args` hands them.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessorList
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from .accelerate import _InstanceHook
from .cache_kwargs import CACHE_KWARG_NAMES

__all__ = [
    "ContinuousBatchingConfig",
    "EngineOutput",
    "GenerationOutput",
    "RequestStatus",
    "bind_call",
    "cache_parameter",
    "install_manager_hook",
    "logits_processors",
    "group_argument",
    "processor_args",
    "reads_absolute_positions",
    "rollouts",
    "wrap_instance_forward",
]

#: The attributes of a model instance holding the engine's manager factory and (a weak reference to) its owner.
_FACTORY_ATTR, _OWNER_ATTR = "_hf_hybridcache_manager_factory", "_hf_hybridcache_manager_owner"
#: A manager kept by ``stop(keep_for_next_session=True)``, returned by the next ``init_continuous_batching``.
KEPT_ATTR = "_hf_hybridcache_kept_manager"


@dataclass
class EngineOutput(GenerationOutput):
    """transformers' ``GenerationOutput`` with what the prefix cache did for the request.

    Attributes:
        hit_tokens: prompt tokens restored from the cache (shared by reference) instead of computed; 0 for a miss.
        hit_report: why the hit is that long (:class:`~hf_hybridcache.core.explain.HitReport`), made at the request's
            first admission; None before it.
        prompt_scores, token_scores: the request's prompt and generated tokens'
            :class:`~hf_hybridcache.engine.scoring.TokenScore` lists when it asked for them, else None.
    """

    hit_tokens: int = field(default=0)
    hit_report: Any = field(default=None)
    prompt_scores: Any = field(default=None)
    token_scores: Any = field(default=None)


def install_manager_hook(model: torch.nn.Module, owner: Any, factory: Callable[..., Any]) -> None:
    """Make ``model.init_continuous_batching(generation_config=None, continuous_batching_config=None,
    workload_hints=None)`` (and through it ``model.generate_batch`` and ``model.continuous_batching_context_manager``)
    return ``factory(owner, generation_config, continuous_batching_config)``, on this instance only. ``factory`` is
    a module-level function and ``owner`` is held weakly, so copies of the model copy neither. The last owner
    installed on a model serves it."""
    vars(model)[_FACTORY_ATTR] = factory
    vars(model)[_OWNER_ATTR] = _OwnerRef(owner)
    if not isinstance(vars(model).get("init_continuous_batching"), _InstanceHook):
        model.init_continuous_batching = _InstanceHook(model, "init_continuous_batching", _init_continuous_batching)
    if not isinstance(vars(model).get("generate_batch"), _InstanceHook):
        model.generate_batch = _InstanceHook(model, "generate_batch", _generate_batch)


class _OwnerRef:
    """A weak reference to the cache serving a model's continuous batching that copies and pickles as a dead one: a
    copy of the model (``copy.deepcopy``, ``torch.save``) is not the model that cache was built for."""

    def __init__(self, owner: Any = None) -> None:
        self._ref = None if owner is None else weakref.ref(owner)

    def __call__(self) -> Any:
        return None if self._ref is None else self._ref()

    def __reduce__(self):
        return _OwnerRef, ()

    def __deepcopy__(self, memo) -> _OwnerRef:
        return _OwnerRef()


def _init_continuous_batching(model, generation_config=None, continuous_batching_config=None, workload_hints=None):
    kept = vars(model).get(KEPT_ATTR)
    if kept is not None:
        return kept
    owner = vars(model)[_OWNER_ATTR]()
    if owner is None:
        raise ValueError(
            "No HybridPrefixCache serves this model's continuous batching: the one built for it no longer exists, or "
            "this model is a copy (deepcopy, pickle) of the model it was built for; build a new "
            "HybridPrefixCache(model) and keep a reference to it for as long as you serve requests."
        )
    return vars(model)[_FACTORY_ATTR](owner, generation_config, continuous_batching_config)


class PromptWithImages(list):
    """A prompt's token ids (a ``list``, as transformers' ``generate_batch`` hands its inputs on to the manager's
    ``add_requests``) that carries what its request gets besides them: the prompt's images (``images``: what the
    model's processor returns besides ``input_ids``, for a vision-language wrapper's ``generate_batch(inputs,
    images=[...])``) and its own sampling seed (``seed``, inside :func:`rollouts`)."""

    def __init__(self, ids, images, seed: int | None = None) -> None:
        super().__init__(ids)
        self.images, self.seed = images, seed


#: The :func:`rollouts` context of this thread: ``(seeds of the next call's prompts, the outputs of its calls)``.
_ROLLOUTS: contextvars.ContextVar[tuple[Callable[[int], list[int]], list] | None] = contextvars.ContextVar(
    "hf_hybridcache_rollouts", default=None)


@contextlib.contextmanager
def rollouts(seeds: Callable[[int], list[int]]) -> Iterator[list[dict]]:
    """Inside it, every ``generate_batch`` call of this thread on a model the engine serves gives prompt ``i`` of its
    ``n`` prompts its own sampling seed ``seeds(n)[i]`` (the engine's ``add_request(seed=...)``), and appends what it
    returns (``{request id: output}``, in prompt order) to the list it yields: how
    :mod:`hf_hybridcache.post_training` sees the rollouts a trainer's own code generates."""
    captured: list[dict] = []
    token = _ROLLOUTS.set((seeds, captured))
    try:
        yield captured
    finally:
        _ROLLOUTS.reset(token)


def _generate_batch(model, inputs, generation_config=None, *args, images=None, **kwargs):
    """transformers' ``generate_batch`` with the ``GenerationConfig`` fields of ``kwargs`` (``max_new_tokens``,
    ``min_new_tokens``, ``repetition_penalty``, ...) set on a copy of ``generation_config`` (the model's when None),
    and ``images``, one entry (a ``{name: tensor}`` mapping, or None) per prompt, carried to the manager with the
    prompts (:class:`PromptWithImages`), as are the seeds of a :func:`rollouts` context.

    Raises:
        ValueError: a keyword that is neither a ``GenerationConfig`` field nor a ``generate_batch`` parameter;
            ``images`` whose length is not the number of prompts.
    """
    rollout = _ROLLOUTS.get()
    if images is not None and len(images) != len(inputs):
        raise ValueError(f"generate_batch got {len(images)} images entries for {len(inputs)} prompts; pass one "
                         "entry (the processor's outputs for that prompt, or None) per prompt.")
    if images is not None or rollout is not None:
        seeds = [None] * len(inputs) if rollout is None else rollout[0](len(inputs))
        inputs = [PromptWithImages(ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else ids,
                                   None if images is None else images[i], seeds[i]) for i, ids in enumerate(inputs)]
    method = type(model).generate_batch
    fields = {name: kwargs.pop(name) for name in list(kwargs) if name in GenerationConfig().to_dict()}
    unknown = sorted(set(kwargs) - set(inspect.signature(method).parameters))
    if unknown:
        raise ValueError(f"generate_batch got {', '.join(unknown)}, which is neither a GenerationConfig field nor one "
                         "of its parameters; check the spelling.")
    if fields:
        generation_config = copy.deepcopy(generation_config if generation_config is not None
                                          else model.generation_config)
        generation_config.update(**fields)
    outputs = method(model, inputs, generation_config, *args, **kwargs)
    if rollout is not None:
        rollout[1].append(outputs)
    return outputs


def wrap_instance_forward(module: torch.nn.Module, attribute: str, impl: Callable) -> bool:
    """Route this instance's forward through ``impl(module, *args, **kwargs)`` on top of whatever runs now (the
    package's mixer patches, accelerate's hook), which ``impl`` finds as ``vars(module)[attribute]`` and calls. False
    when already wrapped (idempotent)."""
    if attribute in vars(module):
        return False
    vars(module)[attribute] = module.forward
    module.forward = _InstanceHook(module, "forward", impl)
    return True


def logits_processors(model, generation_config: GenerationConfig, config: ContinuousBatchingConfig):
    """transformers' continuous-batching processors for ``generation_config`` (as its manager builds them)."""
    return ContinuousBatchingLogitsProcessorList(
        logits_processor=model._get_logits_processor(generation_config),
        per_request_processors=config.per_request_processors,
        drop_unsupported_processors=config.drop_unsupported_processors,
    )


#: transformers' continuous-batching warpers that keep the argmax of the logits at top-k 1 (and positive temperature).
_ORDER_KEEPING = ("ContinuousBatchingTemperatureLogitsWarper", "ContinuousBatchingTopKLogitsWarper",
                  "ContinuousBatchingTopPLogitsWarper")


def warpers_only(processors: ContinuousBatchingLogitsProcessorList) -> bool:
    """Whether ``processors`` holds only transformers' temperature, top-k and top-p warpers (none that moves the
    argmax, such as a repetition penalty)."""
    return all(type(p).__name__ in _ORDER_KEEPING for p in processors.logits_processor)


def processor_args(processors: ContinuousBatchingLogitsProcessorList, kwargs: list[dict]) -> torch.Tensor:
    """The per-request argument tensor ``[num tensors, len(kwargs)]`` int32 of ``processors`` for rows whose
    logits-processor kwargs are ``kwargs`` (one dict per row, in row order)."""
    rows = [SimpleNamespace(has_new_token=True, state=SimpleNamespace(logit_processor_kwargs=k)) for k in kwargs]
    storage = torch.empty((max(processors.tensors_required, 1), max(len(kwargs), 1)), dtype=torch.int32)
    return processors.prepare_tensor_args(rows, storage)


def cache_parameter(forward: Callable) -> str | None:
    """The name under which ``forward`` takes a cache (``past_key_values``, ``cache`` or ``cache_params``), or None."""
    parameters = inspect.signature(forward).parameters
    return next((name for name in CACHE_KWARG_NAMES if name in parameters), None)


def bind_call(module: torch.nn.Module, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """``module.forward``'s arguments of one call, by name (to replace the cache and split the tensors of a packed
    call)."""
    return _forward_signature(type(module).forward).bind(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _forward_signature(function: Callable) -> inspect.Signature:
    """The signature of a module class's ``forward`` without ``self`` (once per function: every layer of every
    engine step binds its call)."""
    signature = inspect.signature(function)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def takes_group_arguments(module: torch.nn.Module) -> bool:
    """Whether ``module.forward`` has a parameter of :data:`GROUP_ARGUMENTS` (its calls are then bound by name)."""
    parameters = _forward_signature(type(module).forward).parameters
    return any(name in parameters for name in GROUP_ARGUMENTS)


def reads_absolute_positions(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a module inside it asks the cache for its queries' absolute position
    (``get_query_offset``: Inkling's log-scaled attention), so that a batch of rows at different positions needs one
    call per position."""
    return any("get_query_offset" in inspect.unwrap(type(m).forward).__code__.co_names for m in module.modules())


#: Arguments a model computes once per forward from its cache's sizes and hands to its attention modules, which a
#: group of an engine step must get computed from its own view instead: Inkling 2's ``relative_distance``
#: ``[query_length, key_length]`` (5.24: ``get_relative_distance`` in ``modeling_inkling2.py``, from the layer's
#: ``get_mask_sizes`` and ``get_query_offset``).
GROUP_ARGUMENTS = ("relative_distance",)


def group_argument(
    name: str, module: torch.nn.Module, arguments: dict, view, num_tokens: int, device: torch.device
) -> torch.Tensor:
    """The group's own value of ``name`` (one of :data:`GROUP_ARGUMENTS`) for ``module`` called with ``arguments``
    (by name), from ``view`` (a cache of the group's rows) and its ``num_tokens`` queries per row."""
    layer_idx = module.layer_idx + (arguments.get("cache_offset") or 0)  # the cache layer holding its keys
    num_keys, kv_offset = view.get_mask_sizes(num_tokens, layer_idx)
    queries = torch.arange(num_tokens, device=device) + view.get_query_offset(layer_idx)
    keys = torch.arange(num_keys, device=device) + kv_offset
    return queries[:, None] - keys[None, :]
