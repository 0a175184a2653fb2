"""Paged KV storage: each stored block is one page of the attention layers' pools (:class:`~.pages.PagePool`),
seen per block and attention layer as keys ``[Hkv, block_size, Dk]`` and values ``[Hkv, block_size, Dv]`` (two
tensors, since MLA layers cache keys and values of different widths).

The store knows block ids and pages only; which block holds which tokens is the block pool's business. A block owns
one reference to its page; a serving engine may hold more (a running request reading a hit by reference, or a page
it filled and handed to the store with :meth:`KVStore.adopt`).
"""

from __future__ import annotations

from array import array

import torch

from ..config import AttentionLayerSpec
from ..kernels.paged_copy import KVBlock
from .pages import PagePool
from .placement import Placement


class KVStore:
    """Stored KV blocks of every attention layer, addressed by block id; ``placement`` says on which device each
    layer's pages are kept and where restored copies go.

    Attributes:
        pages: the :class:`~.pages.PagePool` holding the blocks (shared with a serving engine).
    """

    def __init__(
        self, attention: tuple[AttentionLayerSpec, ...], block_size: int, placement: Placement | None = None
    ) -> None:
        self.attention_layers = tuple(a.layer_idx for a in attention)
        self.placement = placement or Placement()
        self.pages = PagePool(attention, block_size, self._storage_device, pin_host_memory=bool(self.placement.offload))
        self.block_bytes_each = self.pages.page_bytes
        self._page_of: dict[int, int] = {}

    def _storage_device(self, layer_idx: int) -> torch.device | None:
        if self.placement.offload:
            return torch.device("cpu")
        return None if self.placement.devices is None else self.placement.devices[layer_idx]

    @property
    def num_bytes(self) -> int:
        """Bytes of the stored blocks' pages."""
        return len(self._page_of) * self.block_bytes_each

    def __len__(self) -> int:
        return len(self._page_of)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._page_of

    def block_ids(self) -> list[int]:
        return list(self._page_of)

    def put(self, block_id: int, kv: dict[int, KVBlock]) -> None:
        """Store ``kv[layer_idx]`` = (keys ``[Hkv, block_size, Dk]``, values ``[Hkv, block_size, Dv]``) for every
        attention layer, copied into a new page."""
        assert block_id not in self._page_of, "KV block stored twice"
        assert set(kv) == set(self.attention_layers), "a KV block needs every attention layer"
        (page,) = self.pages.allocate(1)
        try:
            self.pages.write_block(page, kv)
        except BaseException:
            self.pages.unref([page])
            raise
        self._page_of[block_id] = page

    def adopt(self, block_id: int, page: int) -> None:
        """Store the block held by ``page`` (a page of :attr:`pages` its writer holds and will not write again) by
        reference: no copy."""
        assert block_id not in self._page_of, "KV block stored twice"
        self.pages.ref([page])
        self._page_of[block_id] = page

    def remove(self, block_id: int) -> None:
        self.pages.unref([self._page_of.pop(block_id)])

    def block_bytes(self, block_id: int) -> int:
        return self.block_bytes_each

    def page_of(self, block_id: int) -> int:
        """The page holding a stored block."""
        return self._page_of[block_id]

    def page_table(self, block_ids) -> torch.Tensor:
        """The pages of ``block_ids`` in order, int64 ``[len(block_ids)]`` (a block table)."""
        if not block_ids:
            return torch.empty(0, dtype=torch.int64)
        # An int64 array's buffer taken as is: half the time of torch.tensor on a list of ints.
        return torch.frombuffer(array("q", [self._page_of[b] for b in block_ids]), dtype=torch.int64)

    def get(self, block_id: int) -> dict[int, KVBlock]:
        """The stored tensors of one block, ``{layer idx: (keys [Hkv, block_size, Dk], values [Hkv, block_size,
        Dv])}``: views of its page (read them, never write them; copy them to keep them past the block's
        eviction, after which the page is reused)."""
        return self.pages.block(self._page_of[block_id])

    def gather(
        self, layer_idx: int, block_ids: list[int] | torch.Tensor, room_tokens: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``block_ids`` in order, as new tensors ``[1, Hkv, len(block_ids) * block_size, Dk]``
        and ``[..., Dv]`` on the layer's device (a copy: writing them never touches the store): one gather per
        tensor (:meth:`PagePool.gather`), then a copy to the device when entries are offloaded. With
        ``room_tokens``, each is the leading view of a buffer with room for that many more tokens
        (:func:`~hf_hybridcache.kernels.paged_copy.kv_room`). ``block_ids`` may be their block table already
        (:meth:`page_table`, int64 ``[n]``), so that a restore of several layers builds it once."""
        pages = block_ids if isinstance(block_ids, torch.Tensor) else self.page_table(block_ids)
        keys, values = self.pages.gather(layer_idx, pages, room_tokens)
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
        """Drop every stored block's reference to its page (pages a serving engine still holds stay)."""
        self.pages.unref(self._page_of.values())
        self._page_of.clear()
