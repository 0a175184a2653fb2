"""Stateful modules run once per group of an engine step: the packed tokens are split per group, each group gets its
own cache view, the outputs are packed again.

The modules wrapped are, in every decoder layer, the outermost modules whose forward takes a cache (a mixer, an
attention module, or a sub-layer holding them such as Zamba's shared transformer block): found from their
signatures, so a family needs no code here. Outside an engine step (the cache is not a
:class:`~hf_hybridcache.engine.views.StepCache`) the wrapper calls the module as before. Inside one, for each
:class:`~hf_hybridcache.engine.plan.Group` it calls the module (its upstream code and the package's patches
unchanged) on

- every tensor argument of shape ``[1, N, ...]`` (hidden states, rotary ``cos`` / ``sin``, position ids) cut to the
  group's ``[G, T, ...]``,
- the group's :class:`~hf_hybridcache.engine.views.GroupView` in place of the step cache,

with the group's attention masks routed (:mod:`hf_hybridcache._compat.engine_attention`), then writes the group's
states back to its slots. Outputs of shape ``[G, T, hidden]`` are packed back to ``[1, N, hidden]``; other outputs
(attention weights) become None. A module that reads its queries' absolute positions from the cache runs the decode
group once per distinct position.
"""

from __future__ import annotations

import inspect

import torch

from .. import _compat
from .._compat.continuous_batching import (
    GROUP_ARGUMENTS,
    bind_call,
    cache_parameter,
    group_argument,
    reads_absolute_positions,
    takes_group_arguments,
    wrap_instance_forward,
)
from .._compat.engine_attention import group_attention
from .plan import Group
from .views import StepCache

_INNER = "_hf_hybridcache_engine_inner"
_POSITIONAL = "_hf_hybridcache_engine_positional"
_BINDS = "_hf_hybridcache_engine_binds"


def wrap_stateful_modules(model: torch.nn.Module) -> int:
    """Wrap the stateful modules of ``model`` (this instance; idempotent). Returns how many are wrapped."""
    wrapped = set()
    for layer in _compat.decoder_layers(model):
        for module in _outermost_stateful(layer):
            if id(module) not in wrapped and wrap_instance_forward(module, _INNER, _grouped_forward):
                vars(module)[_POSITIONAL] = reads_absolute_positions(module)
                vars(module)[_BINDS] = takes_group_arguments(module)
            wrapped.add(id(module))
    return len(wrapped)


def _outermost_stateful(module: torch.nn.Module):
    for child in module.children():
        if cache_parameter(type(child).forward) is not None:
            yield child
        else:
            yield from _outermost_stateful(child)


def _grouped_forward(module, *args, **kwargs):
    inner = vars(module)[_INNER]
    step = next((v for v in (*args, *kwargs.values()) if isinstance(v, StepCache)), None)
    if step is None:
        return inner(*args, **kwargs)
    # Binding the call by name (inspect) costs about 10 us a call: only modules that take a group argument need it.
    bound = bind_call(module, args, kwargs) if vars(module)[_BINDS] else None
    outputs = []
    for group in step.plan.groups:
        parts = group.split_by_past() if group.ragged and vars(module)[_POSITIONAL] else [group]
        for part in parts:
            view = step.view(part)
            if bound is None:
                call_args = tuple(_cut(value, step, view, part) for value in args)
                call_kwargs = {name: _cut(value, step, view, part) for name, value in kwargs.items()}
            else:
                call_args, call_kwargs = _for_group(module, bound, step, view, part)
            with group_attention(view):
                out = inner(*call_args, **call_kwargs)
            view.write_back()
            outputs.append((part, out))
    return _pack(outputs)


def _for_group(module, bound: inspect.BoundArguments, step: StepCache, view, group: Group):
    """The call's arguments for ``group``: the view for the step cache, token tensors cut to ``[G, T, ...]``, and
    the arguments a model derives from its cache's sizes computed again from the view."""
    arguments = {name: _cut(value, step, view, group) for name, value in bound.arguments.items()}
    for name in GROUP_ARGUMENTS:
        value = arguments.get(name)
        if isinstance(value, torch.Tensor):
            arguments[name] = group_argument(name, module, arguments, view, group.num_tokens, value.device)
    cut = inspect.BoundArguments(bound.signature, arguments)
    return cut.args, cut.kwargs


def _cut(value, step: StepCache, view, group: Group):
    if value is step:
        return view
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == step.plan.num_tokens:
            return value[0, group.start : group.end].reshape(group.num_rows, group.num_tokens, *value.shape[2:])
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_cut(v, step, view, group) for v in value)
    if isinstance(value, dict):
        return {k: _cut(v, step, view, group) for k, v in value.items()}
    return value


def _pack(outputs: list[tuple[Group, object]]):
    """The groups' outputs as one packed output (``[G, T, hidden]`` tensors concatenated to ``[1, N, hidden]``)."""
    first = outputs[0][1]
    if isinstance(first, torch.Tensor):
        if len(outputs) == 1 and _is_tokens(first, outputs[0][0]):
            return first.reshape(1, -1, first.shape[-1])  # one group: a view, not a copy
        if all(_is_tokens(out, group) for group, out in outputs):
            return torch.cat([out.reshape(1, -1, out.shape[-1]) for _, out in outputs], dim=1)
        return None
    if isinstance(first, (tuple, list)):
        return type(first)(_pack([(group, out[i]) for group, out in outputs]) for i in range(len(first)))
    return first if all(out is first for _, out in outputs) else None


def _is_tokens(out: torch.Tensor, group: Group) -> bool:
    return out.dim() == 3 and out.shape[0] == group.num_rows and out.shape[1] == group.num_tokens
