"""The fast torch kernels against their plain-torch references, and the backend switch (CPU, no Triton needed)."""

import pytest
import torch

from hf_hybridcache import kernels
from hf_hybridcache.kernels import backend, selective_scan, selective_scan_chunked, selective_scan_ref
from hf_hybridcache.kernels.paged_copy import kv_room

# fp32 round-off of sums of a few hundred terms of magnitude <= ~100.
FP32 = {"rtol": 1e-5, "atol": 1e-5}


def scan_inputs(batch, channels, seq_len, state_size, *, seed=0, dtype=torch.float32, a_scale=1.0, dt_shift=0.0):
    """Random Mamba-1 scan arguments (positional, up to ``delta_softplus=True``) and an initial state."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    args = (
        randn(batch, channels, seq_len).to(dtype),  # u
        (0.5 * randn(batch, channels, seq_len) + dt_shift).to(dtype),  # delta
        -torch.exp(randn(channels, state_size)) * a_scale,  # A
        randn(batch, state_size, seq_len).to(dtype),  # B
        randn(batch, state_size, seq_len).to(dtype),  # C
        randn(channels),  # D
        randn(batch, channels, seq_len).to(dtype),  # z
        0.1 * randn(channels),  # delta_bias
        True,  # delta_softplus
    )
    return args, randn(batch, channels, state_size)


def mamba2_inputs(batch, seq_len, heads, head_dim, groups, state_size, *, seed=0):
    """Random Mamba-2 scan arguments: positional ``(x, dt, A, B, C)``, keyword ``D``/``dt_bias``/``dt_softplus``,
    and an initial state ``[B, H, P, N]`` (for the Triton kernel's tests)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    args = (
        randn(batch, seq_len, heads, head_dim),
        randn(batch, seq_len, heads),
        -torch.exp(randn(heads)),
        randn(batch, seq_len, groups, state_size),
        randn(batch, seq_len, groups, state_size),
    )
    kwargs = {"D": randn(heads), "dt_bias": 0.1 * randn(heads), "dt_softplus": True}
    return args, kwargs, randn(batch, heads, head_dim, state_size)


def assert_scans_close(actual, expected, **tol):
    y, final, emitted = actual
    y_ref, final_ref, emitted_ref = expected
    assert y.dtype == y_ref.dtype and final.dtype == final_ref.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(final, final_ref, **FP32)
    assert len(emitted) == len(emitted_ref)
    for state, state_ref in zip(emitted, emitted_ref):
        torch.testing.assert_close(state, state_ref, **FP32)


CASES = {
    # (batch, channels, seq_len, state_size, chunk_tokens, segment_tokens)
    "odd-sizes": (2, 7, 37, 5, 4, 9),
    "one-token": (1, 3, 1, 4, 16, 256),
    "shorter-than-chunk": (1, 6, 11, 16, 16, 256),
    "many-segments": (1, 33, 100, 16, 8, 24),
    "chunk-of-one": (2, 5, 13, 3, 1, 4),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("from_state", [False, True], ids=["zero-state", "initial-state"])
def test_chunked_scan_matches_reference(case, from_state):
    batch, channels, seq_len, state_size, chunk, segment = case
    args, h0 = scan_inputs(batch, channels, seq_len, state_size)
    positions = sorted({1, (seq_len + 1) // 2, seq_len})
    initial = h0 if from_state else None
    expected = selective_scan_ref(*args, initial_state=initial, emit_positions=positions)
    actual = selective_scan_chunked(
        *args, initial_state=initial, emit_positions=positions, chunk_tokens=chunk, segment_tokens=segment
    )
    assert_scans_close(actual, expected, **FP32)


def test_tolerance_detects_a_lost_initial_state():
    """The power of the comparison above: dropping the carried state is far outside the tolerance."""
    args, h0 = scan_inputs(1, 8, 40, 4, a_scale=0.05)
    from_state = selective_scan_ref(*args, initial_state=h0, emit_positions=[40])
    from_zero = selective_scan_ref(*args, emit_positions=[40])
    assert (from_state[0] - from_zero[0])[..., -1].abs().max() > 100 * FP32["atol"]
    assert (from_state[2][0] - from_zero[2][0]).abs().max() > 100 * FP32["atol"]


@pytest.mark.parametrize("a_scale,dt_shift", [(1000.0, 3.0), (1e-4, -6.0)], ids=["underflowing-decay", "no-decay"])
def test_chunked_scan_is_stable_at_extreme_decays(a_scale, dt_shift):
    """Decays whose product over a chunk underflows (exp(A dt) ~ 1e-1300 per token) and decays of ~1 per token."""
    args, h0 = scan_inputs(2, 6, 45, 4, a_scale=a_scale, dt_shift=dt_shift)
    expected = selective_scan_ref(*args, initial_state=h0, emit_positions=[7, 44])
    actual = selective_scan_chunked(*args, initial_state=h0, emit_positions=[7, 44], chunk_tokens=16)
    assert_scans_close(actual, expected, **FP32)
    assert torch.isfinite(actual[0]).all()


def test_chunked_scan_bf16_inputs():
    """bf16 activations: states stay fp32 (equal to fp32 round-off); the reference rounds the state to bf16 before
    the C contraction and the chunked scan does not, so y agrees to bf16 resolution."""
    args, h0 = scan_inputs(1, 9, 30, 4, dtype=torch.bfloat16)
    expected = selective_scan_ref(*args, initial_state=h0, emit_positions=[5, 30])
    actual = selective_scan_chunked(*args, initial_state=h0, emit_positions=[5, 30], chunk_tokens=8)
    assert_scans_close(actual, expected, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("positions", [[0], [5, 3], [2, 2], [41]], ids=["zero", "unsorted", "repeated", "too-far"])
@pytest.mark.parametrize("scan", [selective_scan_ref, selective_scan_chunked], ids=["reference", "chunked"])
def test_bad_emit_positions_raise(scan, positions):
    args, _ = scan_inputs(1, 2, 40, 3)
    with pytest.raises(ValueError, match="emit_positions"):
        scan(*args, emit_positions=positions)


def test_dispatch_follows_the_backend(monkeypatch):
    args, h0 = scan_inputs(1, 5, 20, 3)
    calls = []
    monkeypatch.setattr(
        kernels.mamba1_scan,
        "selective_scan_chunked",
        lambda *a, **kw: calls.append("torch") or selective_scan_ref(*a, **kw),
    )
    with kernels.use_backend("reference"):
        assert backend.resolve(torch.device("cpu")) == "reference"
        selective_scan(*args, initial_state=h0)
    assert calls == []
    for name in ("auto", "torch"):
        with kernels.use_backend(name):
            selective_scan(*args, initial_state=h0)
    assert calls == ["torch", "torch"]


def test_bad_backend_name_raises_and_keeps_the_current_one():
    before = kernels.get_backend()
    with pytest.raises(ValueError, match="Unknown kernel backend 'fast'"):
        kernels.set_backend("fast")
    assert kernels.get_backend() == before


def test_forcing_triton_on_cpu_without_the_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    with kernels.use_backend("triton"), pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        backend.resolve(torch.device("cpu"))


def test_paged_copy_references_round_trip():
    """Blocks scattered out of live KV and gathered back give the live KV; every result is a copy."""
    keys, values = torch.randn(1, 2, 15, 3), torch.randn(1, 2, 15, 3)
    blocks = kernels.scatter_kv_blocks(keys, values, [0, 5, 10], 5)
    assert [(tuple(k.shape), tuple(v.shape)) for k, v in blocks] == [((2, 5, 3), (2, 5, 3))] * 3
    gathered_keys, gathered_values = kernels.gather_kv_blocks(blocks)
    assert torch.equal(gathered_keys, keys) and torch.equal(gathered_values, values)
    gathered_keys.zero_()
    blocks[0][0].zero_()
    assert keys.abs().sum() > 0 and torch.equal(kernels.gather_kv_blocks(blocks[1:])[0], keys[:, :, 5:])
    states = [torch.randn(1, 4, 3), torch.randn(1, 4, 2)]
    copies = kernels.copy_states(states)
    assert all(torch.equal(c, s) and c.data_ptr() != s.data_ptr() for c, s in zip(copies, states))


def test_gather_with_room_returns_the_leading_view_of_a_larger_buffer():
    keys, values = torch.randn(1, 2, 15, 3), torch.randn(1, 2, 15, 4)
    blocks = kernels.scatter_kv_blocks(keys, values, [0, 5, 10], 5)
    gathered_keys, gathered_values = kernels.gather_kv_blocks(blocks, room_tokens=7)
    assert torch.equal(gathered_keys, keys) and torch.equal(gathered_values, values)
    assert kv_room(gathered_keys) == kv_room(gathered_values) == 7
    assert kv_room(gathered_keys[..., :-2, :]) == 9  # a crop keeps the buffer
    assert kv_room(keys) == 0 and kv_room(torch.cat([keys, keys], -2)[..., :20, :]) == 10
    assert kv_room(keys.transpose(-1, -2)) == 0
    with pytest.raises(ValueError, match="room_tokens must be >= 0"):
        kernels.gather_kv_blocks(blocks, room_tokens=-1)


def test_paged_copy_errors():
    with pytest.raises(ValueError, match="at least one block"):
        kernels.gather_kv_blocks([])
    with pytest.raises(ValueError, match="share shapes, dtype and device"):
        kernels.gather_kv_blocks([(torch.zeros(1, 4, 3),) * 2, (torch.zeros(1, 4, 3, dtype=torch.bfloat16),) * 2])
    with pytest.raises(ValueError, match="share shapes, dtype and device"):
        kernels.gather_kv_blocks([(torch.zeros(1, 4, 3), torch.zeros(1, 4, 2)), (torch.zeros(1, 4, 3),) * 2])
    with pytest.raises(ValueError, match=r"pairs \(keys \[Hkv, block_size, Dk\]"):
        kernels.gather_kv_blocks([torch.zeros(2, 1, 4, 3)])
    with pytest.raises(ValueError, match="must share batch, heads and tokens"):
        kernels.scatter_kv_blocks(torch.zeros(1, 1, 8, 2), torch.zeros(1, 1, 7, 2), [0], 4)
    live = torch.zeros(2, 1, 10, 2)
    with pytest.raises(ValueError, match="within the 10 live tokens"):
        kernels.scatter_kv_blocks(live, live, [7], 4)
    with pytest.raises(ValueError, match="Row 2 does not exist"):
        kernels.scatter_kv_blocks(live, live, [0], 4, row=2)
