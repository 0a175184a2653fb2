"""Which weights stored entries were computed under: a cheap per-request key and a fingerprint per weights state.

A KV block or checkpoint is only valid for the weights that computed it. Loading, switching or disabling a PEFT/LoRA
adapter, ``load_state_dict`` or an in-place edit under ``torch.no_grad()`` changes them without changing the model's
identity (class, config, dtype). So every request first reads a :func:`weights_key` — each parameter's identity,
storage and autograd version counter, plus the active adapters and whether they are disabled — and when it differs
from the last one, the weights get a new :func:`weights_fingerprint`, which is mixed into the root of every block hash
chain (vLLM mixes the LoRA id into its block hashes for the same reason). Entries stored under other weights are then
never served, and switching back (the same adapter again, the original weights restored) finds them again.

Not seen: edits through ``param.data`` (they bypass the version counter by design); call ``cache.clear()`` after
such an edit.
"""

from __future__ import annotations

import hashlib

import torch

from . import _compat

#: Elements sampled from each parameter for the weights fingerprint.
FINGERPRINT_SAMPLES = 64


def adapter_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """PEFT's tuner layers in ``model`` (LoRA and the rest); none when peft is not installed."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def adapter_state(layers: list[torch.nn.Module]) -> tuple:
    """The adapters active in ``layers`` and whether they are disabled, as a hashable tuple (empty without PEFT)."""
    return tuple(sorted({(tuple(layer.active_adapters), bool(layer.disable_adapters)) for layer in layers}))


def parameter_key(model: torch.nn.Module) -> int:
    """Changes when a parameter is added, removed, replaced, re-pointed or written in place (autograd version)."""
    return hash(tuple((id(p), p.data_ptr(), p._version) for p in model.parameters()))


def weights_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's name, shape, dtype and up to :data:`FINGERPRINT_SAMPLES` evenly spaced values
    (read from accelerate's offload maps for offloaded weights): two weight sets with one config get different
    fingerprints, at the cost of a few small reads per parameter rather than hashing every weight."""
    h = hashlib.sha256()
    for name, value in sorted(_compat.parameter_values(model), key=lambda item: item[0]):
        h.update(f"{name}|{tuple(value.shape)}|{value.dtype}|".encode())
        if value.device.type != "meta" and value.numel():
            flat = value.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // FINGERPRINT_SAMPLES)][:FINGERPRINT_SAMPLES]
            h.update(sample.to("cpu", torch.float64).numpy().tobytes())
    return h.hexdigest()


class WeightsTracker:
    """The weights state of one model, re-read at every request.

    Attributes:
        fingerprint: names the current weights state (weights fingerprint + adapter state); mixed into root hashes.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._param_key = parameter_key(model)
        self._adapters = adapter_layers(model)
        self._adapter_state = adapter_state(self._adapters)
        self._weights = weights_fingerprint(model)
        self.fingerprint = self._combined()

    def _combined(self) -> str:
        return hashlib.sha256(f"{self._weights}|{self._adapter_state}".encode()).hexdigest()

    def refresh(self) -> bool:
        """Re-read the weights state; True when it changed since the last call."""
        param_key = parameter_key(self._model)
        if param_key != self._param_key:
            self._param_key = param_key
            self._adapters = adapter_layers(self._model)
            self._weights = weights_fingerprint(self._model)
        self._adapter_state = adapter_state(self._adapters)
        fingerprint = self._combined()
        changed, self.fingerprint = fingerprint != self.fingerprint, fingerprint
        return changed
