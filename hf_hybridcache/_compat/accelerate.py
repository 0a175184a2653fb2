"""accelerate's hooks and instance-level patches: where an instance patch must sit, which device a module computes
on, and where offloaded weights live."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator

import torch

try:
    from transformers.integrations.accelerate import force_accelerate_hooks
except ImportError:  # older layouts: the hooks of children then fire through their own forward only

    def force_accelerate_hooks(child_module_names):
        return lambda fn: fn


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


def module_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``model`` once (the tensors of ``model.parameters()`` and ``model.buffers()``),
    from one walk of the module tree through ``nn.Module``'s ``_modules`` / ``_parameters`` / ``_buffers`` (PyTorch
    2.4 - 2.13): a sixth of the time of the two generators, for a check run at every request."""
    tensors: list[torch.Tensor] = []
    seen_modules, seen = set(), set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen_modules:
            continue
        seen_modules.add(id(module))
        for tensor in itertools.chain(module._parameters.values(), module._buffers.values()):
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
        stack.extend(child for child in reversed(module._modules.values()) if child is not None)
    return tensors


def weight_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(qualified name, tensor, value)`` of every parameter and buffer, in module order (a tensor tied into several
    modules comes once per module). ``value`` is the tensor itself, or for one that accelerate offloaded (on the meta
    device between forwards) the copy in its hook's weights map (host memory or read from disk); one that cannot be
    found stays on meta."""
    for module_name, module in model.named_modules():
        for name, tensor in itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)):
            value = tensor
            if tensor.device.type == "meta":
                for hook in _accelerate_hooks(module):
                    weights_map = getattr(hook, "weights_map", None)
                    if weights_map is not None and name in weights_map:
                        value = weights_map[name]
                        break
            yield f"{module_name}.{name}" if module_name else name, tensor, value
