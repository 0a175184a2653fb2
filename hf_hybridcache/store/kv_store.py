"""Paged KV storage: per stored block and attention layer, keys ``[Hkv, block_size, Dk]`` and values
``[Hkv, block_size, Dv]`` (two tensors, since MLA layers cache keys and values of different widths).

The store knows block ids and tensors only; which block holds which tokens is the block pool's business.
"""

from __future__ import annotations

import torch

from ..kernels.paged_copy import KVBlock, gather_kv_blocks
from ..placement import Placement


class KVStore:
    """Stored KV blocks of every attention layer, addressed by block id; ``placement`` says on which device each
    layer's blocks are kept and where restored copies go."""

    def __init__(self, attention_layers: tuple[int, ...], placement: Placement | None = None) -> None:
        self.attention_layers = attention_layers
        self.placement = placement or Placement()
        self._blocks: dict[int, dict[int, KVBlock]] = {}
        self._bytes: dict[int, int] = {}
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._blocks

    def block_ids(self) -> list[int]:
        return list(self._blocks)

    def put(self, block_id: int, kv: dict[int, KVBlock]) -> None:
        """Store ``kv[layer_idx]`` = (keys ``[Hkv, block_size, Dk]``, values ``[Hkv, block_size, Dv]``) for every
        attention layer. The tensors must not alias the live cache (pass copies)."""
        assert block_id not in self._blocks, "KV block stored twice"
        assert set(kv) == set(self.attention_layers), "a KV block needs every attention layer"
        stash = self.placement.stash
        kv = {idx: (stash(idx, keys), stash(idx, values)) for idx, (keys, values) in kv.items()}
        self._blocks[block_id] = kv
        self._bytes[block_id] = sum(t.numel() * t.element_size() for pair in kv.values() for t in pair)
        self.num_bytes += self._bytes[block_id]

    def remove(self, block_id: int) -> None:
        del self._blocks[block_id]
        self.num_bytes -= self._bytes.pop(block_id)

    def block_bytes(self, block_id: int) -> int:
        return self._bytes[block_id]

    def get(self, block_id: int) -> dict[int, KVBlock]:
        """The stored tensors of one block, ``{layer idx: (keys [Hkv, block_size, Dk], values [Hkv, block_size,
        Dv])}``: read them, never write them."""
        return self._blocks[block_id]

    def gather(self, layer_idx: int, block_ids: list[int], room_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``block_ids`` in order, as new tensors ``[1, Hkv, len(block_ids) * block_size, Dk]``
        and ``[..., Dv]`` on the layer's device (a copy: writing them never touches the store; one Triton launch on
        CUDA, then a copy to the device when entries are offloaded). With ``room_tokens``, each is the leading view
        of a buffer with room for that many more tokens (:func:`~hf_hybridcache.kernels.paged_copy.kv_room`)."""
        keys, values = gather_kv_blocks([self._blocks[b][layer_idx] for b in block_ids], room_tokens)
        return self._to_layer(layer_idx, keys, room_tokens), self._to_layer(layer_idx, values, room_tokens)

    def _to_layer(self, layer_idx: int, tensor: torch.Tensor, room_tokens: int) -> torch.Tensor:
        device = self.placement.device(layer_idx, tensor)
        if tensor.device == device:
            return tensor
        if not room_tokens:
            return self.placement.fetch(layer_idx, tensor, False)
        shape = (*tensor.shape[:-2], tensor.shape[-2] + room_tokens, tensor.shape[-1])
        buffer = torch.empty(shape, dtype=tensor.dtype, device=device)
        buffer[..., : tensor.shape[-2], :].copy_(tensor)
        return buffer[..., : tensor.shape[-2], :]

    def clear(self) -> None:
        self._blocks.clear()
        self._bytes.clear()
        self.num_bytes = 0
