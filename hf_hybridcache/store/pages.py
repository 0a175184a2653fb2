"""Pages: the KV of every attention layer kept as pages of one pool tensor per layer.

A page holds the keys and values of ``page_size`` consecutive tokens (one block) of every attention layer, at the
same page id in each layer's pool::

    keys[layer]    [capacity, page_size, Hkv, Dk]     page p = keys[layer][p]  (token-major, as vLLM's and
    values[layer]  [capacity, page_size, Hkv, Dv]                               flash-attention's paged layout)

Pages are reference counted: a stored KV block owns one reference to its page, and a serving engine's running
request owns one to each page of its block table, so a prefix hit shares a stored block by reference instead of
copying it. A page goes back to the free list when its last reference is dropped. A token's *row* is
``page * page_size + offset``: reading and writing rows of a flattened pool (``[capacity * page_size, Hkv, D]``) is
one index op per layer whatever the number of pages (the block-table idea of vLLM's paged attention, Kwon et al.
2023; the free-list pool after nano-vllm's block manager).

The pool grows on demand (its capacity doubles, the contents are copied), so a small model never reserves its whole
cache budget. A grown pool replaces its tensors: take them again after any allocation, and keep a forward that
writes rows inside :meth:`PagePool.in_use`, which growth waits for.

Callers serialize allocation and reference changes (the store's lock); reads and row writes of pages one holds need
no lock.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator

import torch

from ..config import AttentionLayerSpec

#: One stored KV block of one attention layer as a page view: (keys ``[Hkv, page_size, Dk]``, values
#: ``[Hkv, page_size, Dv]``), the layout of :data:`~hf_hybridcache.kernels.paged_copy.KVBlock`.
PageKV = tuple[torch.Tensor, torch.Tensor]


class PagePool:
    """Ref-counted KV pages of every attention layer.

    Args:
        layers: the attention layers (heads, widths and dtypes of their keys and values).
        page_size: tokens per page (the cache's ``block_size``).
        device_of: ``layer idx -> device`` where that layer's pool lives, or None to place it on the device of the
            first block written to it (stores used on their own).
        pin_host_memory: allocate host pools in page-locked memory (host-kept pages of CUDA layers).
        initial_pages: capacity of the first allocation.
    """

    def __init__(
        self,
        layers: tuple[AttentionLayerSpec, ...],
        page_size: int,
        device_of: Callable[[int], torch.device | None] | None = None,
        pin_host_memory: bool = False,
        initial_pages: int = 16,
    ) -> None:
        self.layers = {a.layer_idx: a for a in layers}
        self.page_size = page_size
        self._device_of = device_of or (lambda idx: None)
        self._pin = pin_host_memory
        self._initial = max(1, initial_pages)
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._devices: dict[int, torch.device] = {}
        self._refs: list[int] = []
        self._free: list[int] = []
        self._users = 0
        self._growing = threading.Condition()

    # ------------------------------------------------------------------ sizes

    @property
    def capacity(self) -> int:
        """Pages the pool tensors hold (used and free)."""
        return len(self._refs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all attention layers (keys and values)."""
        return sum(a.block_bytes(self.page_size) for a in self.layers.values())

    @property
    def reserved_bytes(self) -> int:
        """Bytes the pool tensors occupy (``capacity * page_bytes`` once allocated)."""
        return sum(t.numel() * t.element_size() for t in (*self._keys.values(), *self._values.values()))

    def device(self, layer_idx: int) -> torch.device | None:
        """The device of ``layer_idx``'s pool (None before its first block when no device was given)."""
        return self._devices.get(layer_idx) or self._device_of(layer_idx)

    # ------------------------------------------------------------------ references

    def allocate(self, num_pages: int) -> list[int]:
        """``num_pages`` free pages with one reference each (their contents are undefined until written); the pool
        grows when too few are free."""
        if num_pages > len(self._free):
            self._grow(self.capacity + num_pages - len(self._free))
        pages = [self._free.pop() for _ in range(num_pages)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def ref(self, pages: Iterable[int]) -> None:
        """One more reference to each of ``pages`` (each must be in use)."""
        for page in pages:
            assert self._refs[page] > 0, f"page {page} is free"
            self._refs[page] += 1

    def unref(self, pages: Iterable[int]) -> None:
        """Drop one reference to each of ``pages``; a page without references goes back to the free list."""
        for page in pages:
            assert self._refs[page] > 0, f"page {page} is already free"
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    # ------------------------------------------------------------------ blocks (one page at a time)

    def write_block(self, page: int, kv: dict[int, PageKV]) -> None:
        """Copy one block into ``page``: ``kv[layer]`` = (keys ``[Hkv, page_size, Dk]``, values
        ``[Hkv, page_size, Dv]``) for every attention layer, on any device."""
        assert set(kv) == set(self.layers), "a page needs every attention layer"
        for idx, (keys, values) in kv.items():
            self._ensure_layer(idx, keys.device)
            self._keys[idx][page].copy_(keys.detach().transpose(0, 1))
            self._values[idx][page].copy_(values.detach().transpose(0, 1))

    def block(self, page: int) -> dict[int, PageKV]:
        """Views of one page as a block: ``{layer: (keys [Hkv, page_size, Dk], values [Hkv, page_size, Dv])}``;
        read them, never write them (other requests may share the page)."""
        return {idx: (self._keys[idx][page].transpose(0, 1), self._values[idx][page].transpose(0, 1))
                for idx in self.layers}

    def gather(
        self, layer_idx: int, pages: torch.Tensor, room_tokens: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[1, Hkv, n * page_size, Dk]`` and values ``[1, Hkv, n * page_size, Dv]`` of ``pages`` (int64
        ``[n]``) in order, as new tensors on the pool's device: one ``index_select`` per tensor, written straight into
        the ``[B, H, T, D]`` layout (its output is that buffer seen as ``[n, page_size, Hkv, D]``), so each byte is
        moved once. With ``room_tokens``, each is the leading view of a buffer with room for that many more tokens
        (:func:`~hf_hybridcache.kernels.paged_copy.kv_room`)."""
        out = []
        for pool in (self._keys[layer_idx], self._values[layer_idx]):
            num_pages, heads, width = pages.shape[0], pool.shape[2], pool.shape[3]
            num_tokens = num_pages * self.page_size
            buffer = torch.empty((1, heads, num_tokens + room_tokens, width), dtype=pool.dtype, device=pool.device)
            leading = buffer[:, :, :num_tokens]
            token_major = leading[0].unflatten(1, (num_pages, self.page_size)).permute(1, 2, 0, 3)
            torch.index_select(pool, 0, pages.to(pool.device), out=token_major)
            out.append(leading)
        return out[0], out[1]

    # ------------------------------------------------------------------ token rows (many pages at once)

    def rows(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pools of ``layer_idx`` flattened to token rows: keys ``[capacity * page_size, Hkv, Dk]`` and values
        ``[..., Dv]``; row ``page * page_size + offset`` is one token. Views, valid until the pool grows."""
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        return keys.view(-1, *keys.shape[2:]), values.view(-1, *values.shape[2:])

    def write_rows(self, layer_idx: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write token rows: ``keys`` ``[T, Hkv, Dk]`` and ``values`` ``[T, Hkv, Dv]`` at ``rows`` (int64 ``[T]``,
        on the pool's device) of pages the caller holds and nobody else reads."""
        flat_keys, flat_values = self.rows(layer_idx)
        flat_keys.index_copy_(0, rows, keys.to(flat_keys.dtype))
        flat_values.index_copy_(0, rows, values.to(flat_values.dtype))

    def read_rows(self, layer_idx: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of token rows ``rows`` (int64 ``[N]``, on the pool's device): keys ``[N, Hkv, Dk]``, values
        ``[N, Hkv, Dv]``."""
        flat_keys, flat_values = self.rows(layer_idx)
        return flat_keys.index_select(0, rows), flat_values.index_select(0, rows)

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Hold the pool tensors steady (growth waits) while a forward reads and writes rows of them."""
        with self._growing:
            self._users += 1
        try:
            yield
        finally:
            with self._growing:
                self._users -= 1
                self._growing.notify_all()

    # ------------------------------------------------------------------ growth

    def ensure_devices(self) -> None:
        """Allocate every layer's pool on its given device now (a caller about to write rows needs them)."""
        for idx in self.layers:
            device = self._device_of(idx)
            assert device is not None or idx in self._devices, f"no device is known for attention layer {idx}"
            self._ensure_layer(idx, device or self._devices[idx])

    def clear(self) -> None:
        """Forget every page (references included); the pool tensors are dropped."""
        with self._growing:
            self._growing.wait_for(lambda: self._users == 0)
            self._keys.clear()
            self._values.clear()
            self._devices.clear()
            self._refs.clear()
            self._free.clear()

    def _ensure_layer(self, idx: int, device: torch.device) -> None:
        if idx in self._keys:
            return
        self._devices[idx] = torch.device(self._device_of(idx) or device)
        if not self._refs:
            self._grow(self._initial)
        else:
            self._keys[idx], self._values[idx] = self._new_tensors(idx, self.capacity)

    def _new_tensors(self, idx: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed key and value pools of ``capacity`` pages: normal tensors even when the call that grows the pool
        runs under ``torch.inference_mode()`` (an inference tensor cannot be written in place outside it, and later
        calls and the engine's thread write pages outside it)."""
        spec, device = self.layers[idx], self._devices[idx]
        pin = self._pin and device.type == "cpu" and torch.cuda.is_available()
        shapes = ((spec.num_kv_heads, spec.head_dim), (spec.num_kv_heads, spec.value_head_dim))
        with torch.inference_mode(False):
            return tuple(
                torch.zeros((capacity, self.page_size, *shape), dtype=spec.dtype, device=device, pin_memory=pin)
                for shape in shapes
            )

    def _grow(self, needed: int) -> None:
        """Make the capacity at least ``needed`` pages (doubling), copying the allocated layers' pages."""
        capacity = max(needed, 2 * self.capacity, self._initial)
        for idx in self.layers:
            device = self._device_of(idx)
            if idx not in self._devices and device is not None:
                self._devices[idx] = torch.device(device)
        with self._growing:
            self._growing.wait_for(lambda: self._users == 0)
            for idx in self._devices:
                keys, values = self._new_tensors(idx, capacity)
                if idx in self._keys:
                    keys[: self.capacity].copy_(self._keys[idx])
                    values[: self.capacity].copy_(self._values[idx])
                self._keys[idx], self._values[idx] = keys, values
            old = self.capacity
            self._refs.extend([0] * (capacity - old))
            self._free.extend(range(capacity - 1, old - 1, -1))
