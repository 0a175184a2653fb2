"""Checkpoint storage: per Mamba layer a copy of (conv state, SSM state) at a block boundary, keyed by the id of the
block that ends at that boundary. No hashing here."""

from __future__ import annotations

import torch

from ..config import StateKey
from ..kernels.paged_copy import copy_states
from .placement import Placement

#: One Mamba layer's state: conv state ``[1, C, W]`` (model dtype) and SSM state (``[1, I, N]`` for Mamba-1,
#: usually float32). A checkpoint maps each :data:`~hf_hybridcache.config.StateKey` (the layer index, or
#: ``(layer idx, state idx)`` for a layer's later states) to one.
LayerState = tuple[torch.Tensor, torch.Tensor]


class CheckpointStore:
    """Checkpoints addressed by block id. Stored tensors are never handed out to the live cache: :meth:`get_copy`
    copies them (to the layer's device, which differs from where they are kept under ``offload="cpu"``)."""

    def __init__(self, mamba_layers: tuple[StateKey, ...], placement: Placement | None = None) -> None:
        self.mamba_layers = mamba_layers
        self.placement = placement or Placement()
        self._entries: dict[int, dict[StateKey, LayerState]] = {}
        self._bytes: dict[int, int] = {}
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._entries

    def block_ids(self) -> list[int]:
        return list(self._entries)

    def put(self, block_id: int, states: dict[StateKey, LayerState]) -> None:
        """Store ``states[layer_idx] = (conv, ssm)`` for every Mamba layer; the tensors must be copies."""
        assert block_id not in self._entries, "checkpoint stored twice"
        assert set(states) == set(self.mamba_layers), "a checkpoint needs every Mamba layer"
        stash = self.placement.stash
        states = {idx: (stash(idx, conv), stash(idx, ssm)) for idx, (conv, ssm) in states.items()}
        self._entries[block_id] = states
        self._bytes[block_id] = sum(t.numel() * t.element_size() for pair in states.values() for t in pair)
        self.num_bytes += self._bytes[block_id]

    def remove(self, block_id: int) -> None:
        del self._entries[block_id]
        self.num_bytes -= self._bytes.pop(block_id)

    def checkpoint_bytes(self, block_id: int) -> int:
        return self._bytes[block_id]

    def get(self, block_id: int) -> dict[StateKey, LayerState]:
        """The stored tensors of one checkpoint, ``{mamba layer idx: (conv, ssm)}``: read them, never write them."""
        return self._entries[block_id]

    def get_copy(self, block_id: int) -> dict[StateKey, LayerState]:
        """A fresh copy of the checkpoint on each layer's device, safe to hand to the live cache (decode writes it in
        place). Entries kept on their layers' devices are copied by one Triton launch on CUDA."""
        entry = self._entries[block_id]
        if self.placement.offload is None:
            copies = iter(copy_states([t for pair in entry.values() for t in pair]))
            return {idx: (next(copies), next(copies)) for idx in entry}
        fetch = self.placement.fetch
        return {idx: (fetch(idx, conv, True), fetch(idx, ssm, True)) for idx, (conv, ssm) in entry.items()}

    def clear(self) -> None:
        self._entries.clear()
        self._bytes.clear()
        self.num_bytes = 0
