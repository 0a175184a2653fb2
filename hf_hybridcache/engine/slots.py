"""State slots: every running request's own conv and recurrent states, one row of a pool per recurrent state.

For each state key of the model (:data:`~hf_hybridcache.config.StateKey`: a Mamba / linear-attention / short-conv
layer, or one of a layer's several states) the pool holds ``conv [S, C, W]`` (the conv dtype) and ``ssm [S, ...]``
(``[S, I, N]`` for Mamba-1, ``[S, H, Dk, Dv]`` float32 for a gated delta net, ``[S, 0]`` for a short conv), on the
layer's device. A request takes a slot at admission and gives it back when it ends or is preempted; a prefix hit
copies the checkpoint into the slot, and a checkpoint is a copy of a slot row.
"""

from __future__ import annotations

import torch

from ..config import ModelStateSpec, StateKey, split_state_key
from ..store import LayerState


class StateSlots:
    """``num_slots`` rows of state per recurrent state of ``spec``.

    Args:
        spec: the model's state spec (shapes and dtypes of every state).
        num_slots: the engine's ``max_running_requests``.
        devices: ``{layer idx: device}`` of the model's layers.
    """

    def __init__(self, spec: ModelStateSpec, num_slots: int, devices: dict[int, torch.device]) -> None:
        self.num_slots = num_slots
        self.conv: dict[StateKey, torch.Tensor] = {}
        self.ssm: dict[StateKey, torch.Tensor] = {}
        for m in spec.mamba:
            device = devices[split_state_key(m.key)[0]]
            self.conv[m.key] = torch.zeros(num_slots, *m.conv.shape, dtype=m.conv.dtype, device=device)
            self.ssm[m.key] = torch.zeros(num_slots, *m.ssm.shape, dtype=m.ssm.dtype, device=device)
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A free slot (the caller checked :attr:`num_free`); its contents are stale until written."""
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} given back twice"
        self._free.append(slot)

    def write(self, slot: int, checkpoint: dict[StateKey, LayerState]) -> None:
        """Copy a checkpoint ``{key: (conv [1, C, W], ssm [1, ...])}`` into ``slot`` (a prefix hit)."""
        for key, (conv, ssm) in checkpoint.items():
            self.conv[key][slot].copy_(conv[0])
            self.ssm[key][slot].copy_(ssm[0])

    def read(self, slot: int) -> dict[StateKey, LayerState]:
        """A copy of ``slot``'s states as a checkpoint ``{key: (conv [1, C, W], ssm [1, ...])}``."""
        return {key: (self.conv[key][slot : slot + 1].clone(), self.ssm[key][slot : slot + 1].clone())
                for key in self.conv}
