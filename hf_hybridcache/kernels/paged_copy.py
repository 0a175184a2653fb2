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
    keys: torch.Tensor, values: torch.Tensor, block_indices: Sequence[int], block_size: int
) -> list[torch.Tensor]:
    """Copies ``[2, Hkv, block_size, D]`` of blocks ``block_indices`` (tokens ``[i * block_size, (i + 1) *
    block_size)``) of row 0 of live ``keys`` / ``values`` ``[B, Hkv, T, D]``."""
    blocks = []
    for index in block_indices:
        span = slice(index * block_size, (index + 1) * block_size)
        blocks.append(torch.stack([keys[0, :, span], values[0, :, span]]))
    return blocks


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


def _check_span(keys: torch.Tensor, block_indices: Sequence[int], block_size: int) -> None:
    num_tokens = keys.shape[2]
    if block_size < 1 or any(i < 0 or (i + 1) * block_size > num_tokens for i in block_indices):
        raise ValueError(
            f"Blocks {list(block_indices)} of {block_size} tokens do not lie within the {num_tokens} live tokens."
        )


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
    keys: torch.Tensor, values: torch.Tensor, block_indices: Sequence[int], block_size: int
) -> list[torch.Tensor]:
    """Dispatching form of :func:`scatter_kv_blocks_ref` (same arguments and results).

    Raises:
        ValueError: a block reaches past the live tokens.
    """
    _check_span(keys, block_indices, block_size)
    if backend.resolve(keys.device, fast="reference") == "triton":
        from .paged_copy_triton import scatter_kv_blocks_triton

        return scatter_kv_blocks_triton(keys, values, block_indices, block_size)
    return scatter_kv_blocks_ref(keys, values, block_indices, block_size)


def copy_states(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Dispatching form of :func:`copy_states_ref` (same arguments and results; one launch on CUDA when the tensors
    share a device)."""
    one_device = bool(tensors) and all(t.device == tensors[0].device for t in tensors)
    if one_device and backend.resolve(tensors[0].device, fast="reference") == "triton":
        from .paged_copy_triton import copy_states_triton

        return copy_states_triton(tensors)
    return copy_states_ref(tensors)
