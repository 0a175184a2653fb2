"""Hub kernels that take over a mixer's cache handling, which the prefix cache must refuse.

transformers 5.25 moved the Mamba mixers' conv and scan into module functions that are handed the cache
(``causal_conv1d_forward``, ``mamba_scan_forward``, ``mamba2_scan_forward``) and lets the ``kernels`` library swap
them, or a whole mixer (``Qwen3_5GatedDeltaNet`` on some GPUs), for a kernel from the Hub: ``from_pretrained``
kernelizes by default (``use_kernels``). Such a kernel keeps the recurrent state its own way ("a runtime that manages
the conv state itself", the functions' docstrings say), so the states this package restores, emits at block
boundaries and rolls back are not the ones it reads. Kernels that are not handed the cache (norms, rotary
embeddings, ``causal_conv1d_fn``) change nothing the cache relies on and are left alone.

``kernels`` records a swap on the module whose forward it replaced (``kernels/_internals/layer/layer.py``,
``_replace_forward``: a ``_kernel_repo`` entry in its ``__dict__``); the per-instance wrappers of a mixer's module
functions live in the mixer's ``_kernel_funcs`` (``use_kernelized_func``).
"""

from __future__ import annotations

import inspect

import torch

#: The module functions of transformers 5.25's mixers that are handed the cache (their ``cache`` argument).
CACHE_KERNEL_FUNCTIONS = ("causal_conv1d_forward", "mamba_scan_forward", "mamba2_scan_forward")
#: Where ``kernels`` records the Hub repository a replaced forward came from.
KERNEL_REPO_ATTR = "_kernel_repo"
_CACHE_PARAMETERS = ("cache", "cache_params", "past_key_values")


def cache_kernels_from_hub(model: torch.nn.Module) -> list[str]:
    """``"<module class>.<function> (<repository>)"`` (or ``"<module class> (<repository>)"`` for a whole module)
    for every Hub kernel of ``model`` that is handed the cache; empty when none was swapped in (every CPU model,
    and any model loaded with ``use_kernels=False``)."""
    found = []
    for module in model.modules():
        own = vars(module)
        if KERNEL_REPO_ATTR in own and _takes_cache(type(module).forward):
            found.append(f"{type(module).__name__} ({own[KERNEL_REPO_ATTR]})")
        for name, wrapper in own.get("_kernel_funcs", {}).items():
            if name in CACHE_KERNEL_FUNCTIONS and KERNEL_REPO_ATTR in vars(wrapper):
                found.append(f"{type(module).__name__}.{name} ({vars(wrapper)[KERNEL_REPO_ATTR]})")
    return sorted(set(found))


def refuse_cache_kernels_from_hub(model: torch.nn.Module) -> None:
    """Refuse a model whose mixers run Hub kernels that are handed the cache.

    Raises:
        ValueError: naming the kernels, and how to load the model without them.
    """
    found = cache_kernels_from_hub(model)
    if found:
        raise ValueError(
            f"{type(model).__name__} runs Hub kernels that keep the recurrent state their own way ({', '.join(found)}), "
            "so a HybridPrefixCache cannot restore, checkpoint or roll back that state. Load the model with "
            "from_pretrained(..., use_kernels=False) (or set USE_HUB_KERNELS=NO), or call model.reset_kernels(), "
            "then build the cache."
        )


def kernels_from_hub(model: torch.nn.Module) -> list[str]:
    """``"<module class> (<repository>)"`` / ``"<module class>.<function> (<repository>)"`` for every Hub kernel
    ``kernels`` swapped into ``model`` (any module, whether or not it is handed the cache); empty when none was."""
    found = []
    for module in model.modules():
        own = vars(module)
        if KERNEL_REPO_ATTR in own:
            found.append(f"{type(module).__name__} ({own[KERNEL_REPO_ATTR]})")
        for name, wrapper in own.get("_kernel_funcs", {}).items():
            if KERNEL_REPO_ATTR in vars(wrapper):
                found.append(f"{type(module).__name__}.{name} ({vars(wrapper)[KERNEL_REPO_ATTR]})")
    return sorted(set(found))


def _takes_cache(forward) -> bool:
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in parameters for name in _CACHE_PARAMETERS)
