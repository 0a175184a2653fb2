"""Triton kernels against their torch references: compiled on CUDA, in the Triton interpreter on CPU.

Without a GPU, tests/conftest.py sets ``TRITON_INTERPRET=1`` before triton is first imported, so these run in CI on
CPU at tiny odd sizes. ``triton`` is a test dependency: a missing install fails here rather than skipping.
"""

import pytest
import torch
from test_kernels import FP32, assert_scans_close, mamba2_inputs, scan_inputs

from hf_hybridcache import kernels
from hf_hybridcache.kernels import backend, paged_copy
from hf_hybridcache.kernels.mamba1_scan import selective_scan_ref
from hf_hybridcache.kernels.mamba1_scan_triton import selective_scan_triton
from hf_hybridcache.kernels.mamba2_scan import mamba2_chunk_scan_ref
from hf_hybridcache.kernels.mamba2_scan_triton import mamba2_chunk_scan_triton
from hf_hybridcache.kernels.paged_copy_triton import (
    copy_states_triton,
    gather_kv_blocks_triton,
    scatter_kv_blocks_triton,
)
from hf_hybridcache.config import AttentionLayerSpec
from hf_hybridcache.store.checkpoints import CheckpointStore
from hf_hybridcache.store.kv_store import KVStore

pytestmark = pytest.mark.triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
assert DEVICE.type == "cuda" or backend.interpreting(), "on CPU the Triton tests need TRITON_INTERPRET=1 (conftest.py)"


def to_device(args):
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)


SCAN_CASES = {
    # (batch, channels, seq_len, state_size, block_channels): partial channel blocks, state sizes below a power of 2
    "odd": (2, 7, 13, 5, 4),
    "one-token": (1, 3, 1, 4, 2),
    "full-state": (1, 9, 6, 16, 8),
}


@pytest.mark.parametrize("case", SCAN_CASES.values(), ids=SCAN_CASES.keys())
@pytest.mark.parametrize("from_state", [False, True], ids=["zero-state", "initial-state"])
def test_selective_scan_triton_matches_reference(case, from_state):
    batch, channels, seq_len, state_size, block = case
    args, h0 = scan_inputs(batch, channels, seq_len, state_size)
    args, h0 = to_device(args), h0.to(DEVICE)
    positions = sorted({1, (seq_len + 1) // 2, seq_len})
    initial = h0 if from_state else None
    expected = selective_scan_ref(*args, initial_state=initial, emit_positions=positions)
    actual = selective_scan_triton(*args, initial_state=initial, emit_positions=positions, block_channels=block)
    assert_scans_close(actual, expected, **FP32)


def test_selective_scan_triton_strided_bf16_inputs():
    """Jamba hands over transposed (non-contiguous) u/B/C in the model dtype."""
    args, h0 = scan_inputs(1, 6, 9, 3, dtype=torch.bfloat16, seed=3)
    u, delta, A, B, C, *rest = to_device(args)
    u, B, C = u.transpose(1, 2).contiguous().transpose(1, 2), B.mT.contiguous().mT, C.mT.contiguous().mT
    args = (u, delta, A, B, C, *rest)
    expected = selective_scan_ref(*args, initial_state=h0.to(DEVICE), emit_positions=[4])
    actual = selective_scan_triton(*args, initial_state=h0.to(DEVICE), emit_positions=[4], block_channels=4)
    assert_scans_close(actual, expected, rtol=2e-2, atol=5e-2)


def test_dispatch_runs_triton_when_forced():
    args, h0 = scan_inputs(1, 5, 4, 3)
    args, h0 = to_device(args), h0.to(DEVICE)
    with kernels.use_backend("triton"):
        assert backend.resolve(DEVICE) == "triton"
        actual = kernels.selective_scan(*args, initial_state=h0, emit_positions=[2])
    assert_scans_close(actual, selective_scan_ref(*args, initial_state=h0, emit_positions=[2]), **FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("value_dim", [7, 3], ids=["same-width", "mla-widths"])
@pytest.mark.parametrize("room", [0, 6], ids=["no-room", "room"])
def test_gather_kv_blocks_triton_equals_reference(dtype, value_dim, room):
    blocks = [
        (torch.randn(3, 5, 7, device=DEVICE).to(dtype), torch.randn(3, 5, value_dim, device=DEVICE).to(dtype))
        for _ in range(4)
    ]
    keys, values = gather_kv_blocks_triton(blocks, room)
    keys_ref, values_ref = paged_copy.gather_kv_blocks_ref(blocks, room)
    assert torch.equal(keys, keys_ref) and torch.equal(values, values_ref)
    assert paged_copy.kv_room(keys) == paged_copy.kv_room(values) == room
    keys.fill_(0)
    assert blocks[0][0].abs().sum() > 0, "the gather must return copies"


@pytest.mark.parametrize("value_dim", [7, 3], ids=["same-width", "mla-widths"])
def test_scatter_kv_blocks_triton_equals_reference(value_dim):
    """Blocks of row 1 of two rows, at offsets that are not multiples of the block size (left padding)."""
    keys, values = torch.randn(2, 3, 23, 7, device=DEVICE), torch.randn(2, 3, 23, value_dim, device=DEVICE)
    starts = [2, 17, 7]
    actual = scatter_kv_blocks_triton(keys, values, starts, 5, row=1)
    expected = paged_copy.scatter_kv_blocks_ref(keys, values, starts, 5, row=1)
    assert all(torch.equal(a, e) for pa, pe in zip(actual, expected) for a, e in zip(pa, pe))
    strided_keys = keys.transpose(2, 3).contiguous().transpose(2, 3)
    again = scatter_kv_blocks_triton(strided_keys, values, starts, 5, row=1)
    assert all(torch.equal(a, e) for pa, pe in zip(again, expected) for a, e in zip(pa, pe))


def test_copy_states_triton_equals_reference():
    tensors = [
        torch.randn(1, 5, 3, device=DEVICE).half(),  # conv state, 2-byte words
        torch.randn(1, 9, 4, device=DEVICE),  # SSM state
        torch.randn(2, 5, device=DEVICE)[:, 1:],  # non-contiguous
        torch.arange(7, dtype=torch.uint8, device=DEVICE)[1:],  # odd byte offset
    ]
    copies = copy_states_triton(tensors)
    assert all(torch.equal(c, t) and c.data_ptr() != t.data_ptr() for c, t in zip(copies, tensors))


def test_stores_copy_through_triton_when_forced():
    """CheckpointStore.get_copy dispatches to the kernel; KVStore.gather (one index op per layer) equals the blocks
    concatenated under either backend."""
    spec = AttentionLayerSpec(1, num_kv_heads=2, head_dim=4, dtype=torch.float32, value_head_dim=5)
    kv = KVStore((spec,), block_size=3)
    blocks = {b: (torch.randn(2, 3, 4, device=DEVICE), torch.randn(2, 3, 5, device=DEVICE)) for b in (7, 8, 9)}
    for block_id, block in blocks.items():
        kv.put(block_id, {1: block})
    checkpoints = CheckpointStore((0, 2))
    states = {idx: (torch.randn(1, 6, 4, device=DEVICE), torch.randn(1, 6, 3, device=DEVICE)) for idx in (0, 2)}
    checkpoints.put(8, states)
    with kernels.use_backend("triton"):
        keys, values = kv.gather(1, [9, 7])
        copy = checkpoints.get_copy(8)
    torch.testing.assert_close(keys[0], torch.cat([blocks[9][0], blocks[7][0]], dim=1), rtol=0, atol=0)
    torch.testing.assert_close(values[0], torch.cat([blocks[9][1], blocks[7][1]], dim=1), rtol=0, atol=0)
    for idx, (conv, ssm) in states.items():
        assert torch.equal(copy[idx][0], conv) and torch.equal(copy[idx][1], ssm)
        assert copy[idx][1].data_ptr() != ssm.data_ptr()


MAMBA2_CASES = {
    # (batch, seq_len, heads, head_dim, groups, state_size, reference chunk_size, kernel_chunk, emit positions)
    "odd-within-one-chunk": (1, 13, 2, 5, 1, 3, 8, 16, [1, 7, 13]),
    "chunks-and-groups": (2, 37, 4, 5, 2, 3, 8, 16, [5, 16, 32, 37]),
    "wide-tiles": (1, 21, 1, 17, 1, 20, 5, 32, [21]),
}


@pytest.mark.parametrize("case", MAMBA2_CASES.values(), ids=MAMBA2_CASES.keys())
@pytest.mark.parametrize("from_state", [False, True], ids=["zero-state", "initial-state"])
def test_mamba2_chunk_scan_triton_matches_reference(case, from_state):
    """States emitted on and off both chunkings' boundaries; partial last chunks; groups shared by heads."""
    batch, seq_len, heads, head_dim, groups, state_size, chunk_size, kernel_chunk, positions = case
    args, kwargs, h0 = mamba2_inputs(batch, seq_len, heads, head_dim, groups, state_size)
    args, h0 = to_device(args), h0.to(DEVICE)
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    initial = h0 if from_state else None
    expected = mamba2_chunk_scan_ref(*args, chunk_size, initial_state=initial, emit_positions=positions, **kwargs)
    actual = mamba2_chunk_scan_triton(
        *args, chunk_size, initial_state=initial, emit_positions=positions, kernel_chunk=kernel_chunk, **kwargs
    )
    assert_scans_close(actual, expected, **FP32)


def test_mamba2_dispatch_runs_triton_when_forced():
    args, kwargs, h0 = mamba2_inputs(1, 6, 2, 3, 1, 4)
    args, h0 = to_device(args), h0.to(DEVICE)
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with kernels.use_backend("triton"):
        actual = kernels.mamba2_chunk_scan(*args, 4, initial_state=h0, emit_positions=[3], **kwargs)
    expected = mamba2_chunk_scan_ref(*args, 4, initial_state=h0, emit_positions=[3], **kwargs)
    assert_scans_close(actual, expected, **FP32)


def test_mamba2_chunk_scan_triton_rejects_a_bad_kernel_chunk():
    args, _, _ = mamba2_inputs(1, 4, 1, 2, 1, 2)
    with pytest.raises(ValueError, match="kernel_chunk"):
        mamba2_chunk_scan_triton(*to_device(args), kernel_chunk=24)
