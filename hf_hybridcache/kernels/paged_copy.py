"""Copies between the stored side (paged KV blocks, checkpoints) and the live cache, with their torch references.

- :func:`gather_kv_blocks`: stored KV blocks ``[2, Hkv, bs, D]`` of one attention layer -> live keys and values
  ``[1, Hkv, n * bs, D]`` (restore);
- :func:`scatter_kv_blocks`: live keys and values -> copies of some of their blocks, ``[2, Hkv, bs, D]`` each (store);
- :func:`copy_states`: copies of a list of conv / SSM state tensors (checkpoint restore and capture).

On CUDA the Triton versions (``paged_copy_triton``) do each call in one launch whatever the number of blocks or
tensors, from a table of source and destination addresses (the block-table idea of vLLM's paged attention, Kwon et
al. 2023, without a preallocated pool); elsewhere the references below run, which are already single torch ops.
Every result is a new tensor: writing it never touches the source.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import backend


def gather_kv_blocks_ref(blocks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[1, Hkv, len(blocks) * bs, D]`` (the blocks' dtype and device) of ``blocks``, each
    ``[2, Hkv, bs, D]`` (keys, values), in order."""
    kv = torch.cat(list(blocks), dim=2)
    return kv[0].unsqueeze(0), kv[1].unsqueeze(0)


def scatter_kv_blocks_ref(
    keys: torch.Tensor, values: torch.Tensor, block_starts: Sequence[int], block_size: int, row: int = 0
) -> list[torch.Tensor]:
    """Copies ``[2, Hkv, block_size, D]`` of the blocks of ``row`` of live ``keys`` / ``values`` ``[B, Hkv, T, D]``
    that start at the token offsets ``block_starts`` (tokens ``[s, s + block_size)``; left padding included)."""
    return [torch.stack([keys[row, :, s : s + block_size], values[row, :, s : s + block_size]]) for s in block_starts]


def copy_states_ref(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of every tensor (any shapes and dtypes)."""
    return [t.clone() for t in tensors]


def _check_blocks(blocks: Sequence[torch.Tensor]) -> None:
    if not blocks:
        raise ValueError("gather_kv_blocks needs at least one block.")
    first = blocks[0]
    if first.dim() != 4 or first.shape[0] != 2:
        raise ValueError(f"KV blocks must be [2, Hkv, block_size, D]; got {tuple(first.shape)}.")
    for block in blocks:
        if block.shape != first.shape or block.dtype != first.dtype or block.device != first.device:
            raise ValueError(
                "All KV blocks of a gather must share shape, dtype and device; got "
                f"{tuple(first.shape)} {first.dtype} {first.device} and {tuple(block.shape)} {block.dtype} "
                f"{block.device}."
            )


def _check_span(keys: torch.Tensor, block_starts: Sequence[int], block_size: int, row: int) -> None:
    num_rows, _, num_tokens, _ = keys.shape
    if block_size < 1 or any(s < 0 or s + block_size > num_tokens for s in block_starts):
        raise ValueError(
            f"Blocks of {block_size} tokens starting at {list(block_starts)} do not lie within the {num_tokens} live "
            "tokens."
        )
    if not 0 <= row < num_rows:
        raise ValueError(f"Row {row} does not exist in live KV of {num_rows} rows.")


def gather_kv_blocks(blocks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatching form of :func:`gather_kv_blocks_ref` (same arguments and results).

    Raises:
        ValueError: no blocks, or blocks that are not ``[2, Hkv, bs, D]`` of one shape, dtype and device.
    """
    _check_blocks(blocks)
    if backend.resolve(blocks[0].device, fast="reference") == "triton":
        from .paged_copy_triton import gather_kv_blocks_triton

        return gather_kv_blocks_triton(blocks)
    return gather_kv_blocks_ref(blocks)


def scatter_kv_blocks(
    keys: torch.Tensor, values: torch.Tensor, block_starts: Sequence[int], block_size: int, row: int = 0
) -> list[torch.Tensor]:
    """Dispatching form of :func:`scatter_kv_blocks_ref` (same arguments and results).

    Raises:
        ValueError: a block reaches outside the live tokens, or ``row`` does not exist.
    """
    _check_span(keys, block_starts, block_size, row)
    if backend.resolve(keys.device, fast="reference") == "triton":
        from .paged_copy_triton import scatter_kv_blocks_triton

        return scatter_kv_blocks_triton(keys, values, block_starts, block_size, row)
    return scatter_kv_blocks_ref(keys, values, block_starts, block_size, row)


def copy_states(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Dispatching form of :func:`copy_states_ref` (same arguments and results; one launch on CUDA when the tensors
    share a device)."""
    one_device = bool(tensors) and all(t.device == tensors[0].device for t in tensors)
    if one_device and backend.resolve(tensors[0].device, fast="reference") == "triton":
        from .paged_copy_triton import copy_states_triton

        return copy_states_triton(tensors)
    return copy_states_ref(tensors)
