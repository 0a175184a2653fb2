"""Module-level functions of transformers' modeling files that the linear-attention mixers call by name."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable

import torch


def route_module_function(module_name: str, name: str, router: Callable) -> None:
    """Make ``module_name.name(*args, **kwargs)`` call ``router(original, *args, **kwargs)`` (idempotent).

    The mixers call their recurrence kernels (``torch_chunk_gated_delta_rule`` and kin) by their module-level name,
    so the name is rebound once in the modeling module; ``router`` must call ``original`` unchanged outside this
    package's own mixer calls, so every other model of the family runs exactly as before. ``original`` is whatever
    transformers bound there (its torch path, or the ``fla`` kernel when that package is installed).
    """
    module = sys.modules[module_name]
    original = getattr(module, name)
    if getattr(original, "_hf_hybridcache_routed", False):
        return
    if isinstance(original, torch.nn.Module):
        # transformers 5.25 with ``kernels`` installed: the name holds the ``Func`` module that
        # ``use_kernel_forward_from_hub`` made of the function, and a pickled mixer rebuilds its private copies with
        # ``type(getattr(module, name))()`` (``kernels``' ``_rebuild_kernel_func``). So the name keeps an instance of
        # that class, whose own forward routes.
        routed = type(original)()
        routed.forward = functools.partial(router, original)
        routed.__wrapped__ = original
    else:

        @functools.wraps(original)
        def routed(*args, **kwargs):
            return router(original, *args, **kwargs)

    routed._hf_hybridcache_routed = True
    setattr(module, name, routed)


def python_function(obj: Callable) -> Callable:
    """The Python function a modeling module's name stands for: this package's routing unwrapped, and on
    transformers 5.25 with ``kernels`` installed the function inside the ``Func`` module that
    ``use_kernel_forward_from_hub`` made of it (``kernels/_internals/layer/layer.py``, ``_create_func_module``)."""
    obj = inspect.unwrap(obj)
    forward = getattr(type(obj), "forward", None) if isinstance(obj, torch.nn.Module) else None
    for cell in getattr(forward, "__closure__", None) or ():
        if inspect.isfunction(cell.cell_contents):
            return cell.cell_contents
    return obj
