"""Triton versions of :mod:`~hf_hybridcache.kernels.paged_copy` (same signatures as its ``*_ref`` functions).

All three are one batched copy: a table of (source address, destination address, length) rows, one row per
contiguous run of memory, copied by one launch. Lengths are counted in the widest word (8, 4, 2 or 1 bytes) that
divides every address and length, so the loads stay wide.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

#: Words copied per program and loop step.
BLOCK_WORDS = 1024
#: Most programs per table row (longer rows loop).
MAX_PROGRAMS_PER_ROW = 1024
_WORD_TYPES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


@triton.jit
def _copy_rows_kernel(table_ptr, WORD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    src = tl.load(table_ptr + row * 3).to(tl.pointer_type(WORD))
    dst = tl.load(table_ptr + row * 3 + 1).to(tl.pointer_type(WORD))
    num_words = tl.load(table_ptr + row * 3 + 2)
    offs = tl.arange(0, BLOCK)
    for start in range(tl.program_id(1) * BLOCK, num_words, tl.num_programs(1) * BLOCK):
        mask = start + offs < num_words
        tl.store(dst + start + offs, tl.load(src + start + offs, mask=mask), mask=mask)


def _copy_rows(rows: list[tuple[int, int, int]], device: torch.device) -> None:
    """Copy ``nbytes`` from ``src`` to ``dst`` for every ``(src address, dst address, nbytes)`` row on ``device``."""
    if not rows:
        return
    word = 8
    for src, dst, nbytes in rows:
        word = math.gcd(word, src, dst, nbytes)
    table = torch.tensor([(src, dst, nbytes // word) for src, dst, nbytes in rows], dtype=torch.int64)
    longest = max(nbytes for _, _, nbytes in rows) // word
    grid = (len(rows), min(triton.cdiv(longest, BLOCK_WORDS), MAX_PROGRAMS_PER_ROW))
    _copy_rows_kernel[grid](table.to(device), WORD=_WORD_TYPES[word], BLOCK=BLOCK_WORDS)


def _head_rows(tensor: torch.Tensor, start_token: int, num_tokens: int) -> list[tuple[int, int]]:
    """(address, nbytes) of tokens ``[start_token, start_token + num_tokens)`` of each head of ``tensor``
    ``[Hkv, T, D]`` (tokens x D contiguous within a head)."""
    assert tensor.stride(2) == 1 and tensor.stride(1) == tensor.shape[2], "tokens x D must be contiguous per head"
    size = tensor.element_size()
    row_bytes = num_tokens * tensor.shape[2] * size
    base = tensor.data_ptr() + start_token * tensor.stride(1) * size
    return [(base + h * tensor.stride(0) * size, row_bytes) for h in range(tensor.shape[0])]


def _dense_heads(tensor: torch.Tensor) -> bool:
    return tensor.stride(-1) == 1 and tensor.stride(-2) == tensor.shape[-1]


def gather_kv_blocks_triton(
    blocks: Sequence[tuple[torch.Tensor, torch.Tensor]], room_tokens: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`~hf_hybridcache.kernels.paged_copy.gather_kv_blocks_ref`."""
    blocks = [tuple(t if t.is_contiguous() else t.contiguous() for t in block) for block in blocks]
    num_heads, block_size = blocks[0][0].shape[:2]
    num_tokens = len(blocks) * block_size
    outs = [
        torch.empty((1, num_heads, num_tokens + room_tokens, t.shape[2]), dtype=t.dtype, device=t.device)
        for t in blocks[0]
    ]
    rows = []
    for j, block in enumerate(blocks):
        for stored, out in zip(block, outs):
            src = _head_rows(stored, 0, block_size)
            dst = _head_rows(out[0], j * block_size, block_size)
            rows += [(s, d, n) for (s, n), (d, _) in zip(src, dst)]
    _copy_rows(rows, outs[0].device)
    return outs[0][:, :, :num_tokens], outs[1][:, :, :num_tokens]


def scatter_kv_blocks_triton(
    keys: torch.Tensor, values: torch.Tensor, block_starts: Sequence[int], block_size: int, row: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """See :func:`~hf_hybridcache.kernels.paged_copy.scatter_kv_blocks_ref`."""
    live = [t if _dense_heads(t) else t.contiguous() for t in (keys[row], values[row])]
    blocks = [
        tuple(torch.empty((t.shape[0], block_size, t.shape[2]), dtype=t.dtype, device=t.device) for t in live)
        for _ in block_starts
    ]
    rows = []
    for start, block in zip(block_starts, blocks):
        for source, stored in zip(live, block):
            src = _head_rows(source, start, block_size)
            dst = _head_rows(stored, 0, block_size)
            rows += [(s, d, n) for (s, n), (d, _) in zip(src, dst)]
    _copy_rows(rows, keys.device)
    return blocks


def copy_states_triton(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """See :func:`~hf_hybridcache.kernels.paged_copy.copy_states_ref` (all tensors on one device)."""
    sources = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    copies = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in sources]
    rows = [(s.data_ptr(), c.data_ptr(), s.numel() * s.element_size()) for s, c in zip(sources, copies) if s.numel()]
    _copy_rows(rows, sources[0].device)
    return copies
