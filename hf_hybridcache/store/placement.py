"""Where stored tensors live: on the device of the layer that made them, or in host memory (``offload="cpu"``).

Stored KV blocks and checkpoints are restored into the live layer of the same index, so by default each one stays on
that layer's device (a model spread over devices by ``accelerate`` keeps every layer's entries next to it, and a
restore is a device-local copy). With ``offload="cpu"`` entries are kept in host memory — page-locked when the layer
is on a CUDA device, so the copy back is asynchronous — and copied to the layer's device on restore, which trades
restore time for device memory (vLLM's CPU KV offloading makes the same trade).
"""

from __future__ import annotations

import torch

from .. import _compat
from ..config import StateKey, split_state_key

OFFLOAD_CHOICES = (None, "cpu")


class Placement:
    """Moves tensors into and out of storage for each layer.

    Args:
        devices: ``{layer idx: device}``, the device each cache layer's live tensors are on (the execution device of
            the decoder layer); None keeps every tensor where it is given (stores used on their own).
        offload: None (keep entries on their layer's device) or ``"cpu"`` (keep them in host memory).

    Raises:
        ValueError: ``offload`` is not None or ``"cpu"``.
    """

    def __init__(self, devices: dict[int, torch.device] | None = None, offload: str | None = None) -> None:
        if offload not in OFFLOAD_CHOICES:
            raise ValueError(
                f"`offload` must be None (keep stored entries on their layer's device) or 'cpu' (keep them in host "
                f"memory and copy them to the device on restore), got {offload!r}."
            )
        self.devices = devices
        self.offload = offload

    def device(self, layer_idx: StateKey, tensor: torch.Tensor) -> torch.device:
        """Where ``layer_idx``'s live tensors are (``tensor``'s own device when no devices were given); a checkpoint's
        ``(layer idx, state idx)`` key is on its layer's device."""
        return tensor.device if self.devices is None else self.devices[split_state_key(layer_idx)[0]]

    def stash(self, layer_idx: int, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor to keep for ``layer_idx``, given a private copy (never a view of the live cache)."""
        target = torch.device("cpu") if self.offload else self.device(layer_idx, tensor)
        if tensor.device == target:
            return tensor
        if target.type == "cpu" and tensor.is_cuda:
            # Page-locked host memory makes the copy back to the device asynchronous; this copy is synchronous, so
            # the entry is complete before anyone reads it on the host (saving, hashing).
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return host.copy_(tensor)
        return tensor.to(target)

    def fetch(self, layer_idx: int, tensor: torch.Tensor, copy: bool) -> torch.Tensor:
        """``tensor`` on ``layer_idx``'s device; a new tensor when ``copy`` (pass False for a result that is already
        a private copy, such as a concatenation)."""
        return tensor.to(self.device(layer_idx, tensor), non_blocking=tensor.is_pinned(), copy=copy)


def layer_devices(model: torch.nn.Module, layer_indices) -> dict[int, torch.device]:
    """``{layer idx: device}``: where decoder layer ``i`` computes (its accelerate execution device, else the device
    of its weights), for each of ``layer_indices``; a loop pass's own cache layer is on its decoder layer's device
    (:func:`hf_hybridcache._compat.loop_cache_layers`)."""
    layers = _compat.decoder_layers(model)
    owners = _compat.loop_cache_layers(model.config)
    return {idx: _compat.execution_device(layers[owners.get(idx, idx)]) or model.device for idx in layer_indices}


def synchronize(devices) -> None:
    """Wait for the kernels queued on every accelerator device in ``devices`` (CPU devices need no wait), so a wall
    clock read afterwards covers the work; used to time forwards."""
    for device in {torch.device(d) for d in devices}:
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
