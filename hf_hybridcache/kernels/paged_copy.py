"""Copies between the stored side (paged KV blocks, checkpoints) and the live cache, with their torch references.

- :func:`gather_kv_blocks`: stored KV blocks of one attention layer, each a pair (keys ``[Hkv, bs, Dk]``, values
  ``[Hkv, bs, Dv]``) -> live keys ``[1, Hkv, n * bs, Dk]`` and values ``[1, Hkv, n * bs, Dv]`` (restore), optionally
  the first ``n * bs`` tokens of buffers with room for more (the prompt's tail is then written after them instead of
  concatenated: one copy of the prefix per restore instead of two);
- :func:`scatter_kv_blocks`: live keys and values -> copies of some of their blocks, one such pair each (store);
- :func:`copy_states`: copies of a list of conv / SSM state tensors (checkpoint restore and capture).

Keys and values are separate tensors because their widths may differ (``Dk != Dv`` in MLA layers, whose cache holds
a compressed latent and a rope key); elsewhere ``Dk == Dv == D``.

On CUDA the Triton versions (``paged_copy_triton``) do each call in one launch whatever the number of blocks or
tensors, from a table of source and destination addresses (the block-table idea of vLLM's paged attention, Kwon et
al. 2023, without a preallocated pool); elsewhere the references below run, which are already single torch ops.
Every result is a new tensor: writing it never touches the source.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import backend

#: One stored KV block of one attention layer: (keys ``[Hkv, bs, Dk]``, values ``[Hkv, bs, Dv]``).
KVBlock = tuple[torch.Tensor, torch.Tensor]


def gather_kv_blocks_ref(blocks: Sequence[KVBlock], room_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[1, Hkv, len(blocks) * bs, Dk]`` and values ``[1, Hkv, len(blocks) * bs, Dv]`` (the blocks' dtype and
    device) of ``blocks``, each a pair (keys ``[Hkv, bs, Dk]``, values ``[Hkv, bs, Dv]``), in order. With
    ``room_tokens``, each is the leading view of a new buffer ``[1, Hkv, len(blocks) * bs + room_tokens, D]`` whose
    remaining tokens are uninitialized (:func:`kv_room`)."""
    num_tokens = len(blocks) * blocks[0][0].shape[1]
    outs = []
    for side in (0, 1):
        parts = [block[side] for block in blocks]
        if not room_tokens:
            outs.append(torch.cat(parts, dim=1).unsqueeze(0))
            continue
        heads, _, width = parts[0].shape
        buffer = torch.empty((1, heads, num_tokens + room_tokens, width), dtype=parts[0].dtype, device=parts[0].device)
        torch.cat(parts, dim=1, out=buffer[0, :, :num_tokens])
        outs.append(buffer[:, :, :num_tokens])
    return outs[0], outs[1]


def kv_room(tensor: torch.Tensor) -> int:
    """Tokens that fit after the last one of live keys or values ``[B, H, T, D]`` inside the buffer they are the
    leading view of (0 for an ordinary tensor): ``stride(-3) // D - T`` when the tokens x D of each head are dense."""
    if tensor.dim() != 4 or tensor.stride(-1) != 1 or tensor.stride(-2) != tensor.shape[-1] or not tensor.shape[-1]:
        return 0
    return max(tensor.stride(-3) // tensor.shape[-1] - tensor.shape[-2], 0)


def scatter_kv_blocks_ref(
    keys: torch.Tensor, values: torch.Tensor, block_starts: Sequence[int], block_size: int, row: int = 0
) -> list[KVBlock]:
    """Copies (keys ``[Hkv, block_size, Dk]``, values ``[Hkv, block_size, Dv]``) of the blocks of ``row`` of live
    ``keys`` ``[B, Hkv, T, Dk]`` / ``values`` ``[B, Hkv, T, Dv]`` that start at the token offsets ``block_starts``
    (tokens ``[s, s + block_size)``; left padding included)."""
    return [
        (keys[row, :, s : s + block_size].clone(), values[row, :, s : s + block_size].clone()) for s in block_starts
    ]


def copy_states_ref(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of every tensor (any shapes and dtypes)."""
    return [t.clone() for t in tensors]


def _is_pair(block) -> bool:
    return (
        isinstance(block, (tuple, list))
        and len(block) == 2
        and all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in block)
        and block[0].shape[:2] == block[1].shape[:2]
    )


def _describe(block) -> str:
    if not isinstance(block, (tuple, list)):
        return f"a {type(block).__name__} {tuple(getattr(block, 'shape', ()))}"
    return " / ".join(f"{tuple(t.shape)} {t.dtype} {t.device}" for t in block)


def _check_blocks(blocks: Sequence[KVBlock]) -> None:
    if not blocks:
        raise ValueError("gather_kv_blocks needs at least one block.")
    first = blocks[0]
    for block in blocks:
        if not _is_pair(block):
            raise ValueError(
                "KV blocks must be pairs (keys [Hkv, block_size, Dk], values [Hkv, block_size, Dv]); got "
                f"{_describe(block)}."
            )
        dtype, device = first[0].dtype, first[0].device
        if any(t.shape != f.shape or t.dtype != dtype or t.device != device for t, f in zip(block, first)):
            raise ValueError(
                "All KV blocks of a gather must share shapes, dtype and device; got "
                f"{_describe(first)} and {_describe(block)}."
            )


def _check_span(
    keys: torch.Tensor, values: torch.Tensor, block_starts: Sequence[int], block_size: int, row: int
) -> None:
    num_rows, _, num_tokens, _ = keys.shape
    if values.shape[:3] != keys.shape[:3]:
        raise ValueError(
            f"Live keys {tuple(keys.shape)} and values {tuple(values.shape)} must share batch, heads and tokens."
        )
    if block_size < 1 or any(s < 0 or s + block_size > num_tokens for s in block_starts):
        raise ValueError(
            f"Blocks of {block_size} tokens starting at {list(block_starts)} do not lie within the {num_tokens} live "
            "tokens."
        )
    if not 0 <= row < num_rows:
        raise ValueError(f"Row {row} does not exist in live KV of {num_rows} rows.")


def gather_kv_blocks(blocks: Sequence[KVBlock], room_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatching form of :func:`gather_kv_blocks_ref` (same arguments and results).

    Raises:
        ValueError: no blocks, blocks that are not (keys ``[Hkv, bs, Dk]``, values ``[Hkv, bs, Dv]``) pairs of
            one set of shapes, one dtype and one device, or a negative ``room_tokens``.
    """
    _check_blocks(blocks)
    if room_tokens < 0:
        raise ValueError(f"room_tokens must be >= 0, got {room_tokens}.")
    if backend.resolve(blocks[0][0].device, fast="reference") == "triton":
        from .paged_copy_triton import gather_kv_blocks_triton

        return gather_kv_blocks_triton(blocks, room_tokens)
    return gather_kv_blocks_ref(blocks, room_tokens)


def scatter_kv_blocks(
    keys: torch.Tensor, values: torch.Tensor, block_starts: Sequence[int], block_size: int, row: int = 0
) -> list[KVBlock]:
    """Dispatching form of :func:`scatter_kv_blocks_ref` (same arguments and results).

    Raises:
        ValueError: a block reaches outside the live tokens, ``row`` does not exist, or keys and values differ in
            batch, heads or tokens.
    """
    _check_span(keys, values, block_starts, block_size, row)
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
