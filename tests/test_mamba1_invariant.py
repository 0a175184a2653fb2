"""Mamba-1's scan with one arithmetic per token (hf_hybridcache/kernels/mamba1_invariant.py, issue 46): a token's
output and state are the same bits whether it arrives in a prefill, at any offset of a split prompt, or in a decode
step, and whatever other rows share the call; the scan agrees with the reference within round-off. Power: the same
checks on the package's default paths (``selective_scan`` for a prefill, ``selective_state_update`` for a decode
step; ``F.silu`` / ``F.softplus`` for the activations) fail on this CPU."""

import pytest
import torch
import torch.nn.functional as F

from hf_hybridcache.kernels import selective_scan, selective_scan_ref
from hf_hybridcache.kernels import mamba1_invariant as inv
from hf_hybridcache.kernels.state_update import selective_state_update

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CLOSE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-5},
         torch.float16: {"rtol": 1e-3, "atol": 1e-5}}  # float32 round-off, one rounding to the dtype
T = 37  # odd, past two 16-token chunks of the chunked scan
SPLITS = [1, 5, 16, 17, 30, 36]


def _inputs(dtype, rows=1, seed=0, channels=48, state_size=16):
    g = torch.Generator().manual_seed(seed)
    u, delta, z = ((torch.randn(rows, channels, T, generator=g) * 2).to(dtype) for _ in range(3))
    B, C = (torch.randn(rows, state_size, T, generator=g).to(dtype) for _ in range(2))
    params = dict(A=-torch.rand(channels, state_size, generator=g) - 0.05, D=torch.randn(channels, generator=g),
                  delta_bias=torch.randn(channels, generator=g) * 0.5 - 1)
    return dict(u=u, delta=delta, B=B, C=C, z=z, **params)


def _prefill(scan, x, lo, hi, state=None):
    sl = slice(lo, hi)
    return scan(x["u"][..., sl], x["delta"][..., sl], x["A"], x["B"][..., sl], x["C"][..., sl], x["D"],
                x["z"][..., sl], x["delta_bias"], True, initial_state=state)


def _decode(step, x, t, state):
    return step(state, x["u"][..., t], x["delta"][..., t], x["A"], x["B"][..., t], x["C"][..., t], x["D"],
                x["z"][..., t], x["delta_bias"], True)


def _decode_all(step, x, lo, hi, state):
    return torch.stack([_decode(step, x, t, state) for t in range(lo, hi)], dim=-1)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_equals_decode_steps_bit_for_bit(dtype, rows):
    x = _inputs(dtype, rows)
    y, final, _ = _prefill(inv.selective_scan_invariant, x, 0, T)
    state = torch.zeros_like(final)
    assert torch.equal(_decode_all(inv.selective_step_invariant, x, 0, T, state), y)
    assert torch.equal(state, final)
    # Against the reference on the same inputs in float32: this scan rounds only its output to the input dtype.
    exact = _prefill(selective_scan_ref, {k: v.float() for k, v in x.items()}, 0, T)[0]
    torch.testing.assert_close(y, exact.to(dtype), **CLOSE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_any_split_and_the_emitted_states_give_the_same_bits(dtype):
    x = _inputs(dtype, seed=1)
    y, final, emitted = inv.selective_scan_invariant(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                                                     x["delta_bias"], True, emit_positions=SPLITS)
    for split, state_at_split in zip(SPLITS, emitted, strict=True):
        y_head, head_state, _ = _prefill(inv.selective_scan_invariant, x, 0, split)
        assert torch.equal(head_state, state_at_split), split
        y_tail, tail_state, _ = _prefill(inv.selective_scan_invariant, x, split, T, head_state)
        assert torch.equal(torch.cat([y_head, y_tail], dim=-1), y), split
        assert torch.equal(tail_state, final), split


@pytest.mark.parametrize("channels", [48, 2048])  # 2048: the elementwise ops run on two threads
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_is_the_same_bits_whatever_rows_share_the_call(dtype, channels):
    batch = _inputs(dtype, rows=5, seed=2, channels=channels)
    alone = {k: (v[2:3] if k in ("u", "delta", "B", "C", "z") else v) for k, v in batch.items()}
    y_batch, final_batch, _ = _prefill(inv.selective_scan_invariant, batch, 0, T)
    y_alone, final_alone, _ = _prefill(inv.selective_scan_invariant, alone, 0, T)
    assert torch.equal(y_batch[2:3], y_alone) and torch.equal(final_batch[2:3], final_alone)
    # A decode step of 5 rows against the row alone, from the states after 30 tokens.
    _, states, _ = _prefill(inv.selective_scan_invariant, batch, 0, 30)
    one = states[2:3].clone()
    assert torch.equal(_decode(inv.selective_step_invariant, batch, 30, states)[2:3],
                       _decode(inv.selective_step_invariant, alone, 30, one))
    assert torch.equal(states[2:3], one)


def test_the_state_must_be_float32():
    x = _inputs(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        _decode(inv.selective_step_invariant, x, 0, torch.zeros(1, 48, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_power_the_default_paths_give_a_token_other_bits_in_a_decode_step(dtype):
    """The package's own prefill and decode kernels: the last token of a prefill against the same token as a decode
    step after the others (measured: 1.1e-2 in bf16, 9.5e-7 in float32)."""
    x = _inputs(dtype, seed=3)
    y, _, _ = _prefill(selective_scan, x, 0, T)
    _, head_state, _ = _prefill(selective_scan, x, 0, T - 1)
    assert not torch.equal(_decode(selective_state_update, x, T - 1, head_state.clone()), y[..., -1])


def test_power_the_chunked_scan_depends_on_where_its_grid_starts():
    x = _inputs(torch.float32, seed=4)
    y, final, _ = _prefill(selective_scan, x, 0, T)
    differs = []
    for split in SPLITS:
        _, head_state, _ = _prefill(selective_scan, x, 0, split)
        y_tail, tail_state, _ = _prefill(selective_scan, x, split, T, head_state)
        differs.append(not (torch.equal(y_tail, y[..., split:]) and torch.equal(tail_state, final)))
    assert any(differs)


@pytest.mark.parametrize(("ours", "torchs"), [(inv.silu_invariant, F.silu), (inv.softplus_invariant, F.softplus)],
                         ids=["silu", "softplus"])
def test_power_the_activations_depend_on_an_elements_offset_and_ours_do_not(ours, torchs):
    """An element alone (the scalar tail of a vectorized loop) against the same element inside a long tensor."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(5)) * 4
    alone = torch.stack([ours(x[i : i + 1])[0] for i in range(512)])
    assert torch.equal(alone, ours(x)[:512])
    torch.testing.assert_close(ours(x), torchs(x), rtol=1e-6, atol=1e-6)
    torch_alone = torch.stack([torchs(x[i : i + 1])[0] for i in range(512)])
    if torch.equal(torch_alone, torchs(x)[:512]):
        pytest.skip(f"{torchs.__name__} gives the same bits in the scalar tail with this torch build")
