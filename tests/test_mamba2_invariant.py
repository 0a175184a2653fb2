"""Mamba-2's scan with one arithmetic per token (hf_hybridcache/kernels/mamba2_invariant.py, issue 46): a token's
output and state are the same bits in a prefill, at any offset of a split prompt, or in a decode step, whatever rows
share the call; the scan agrees with the chunked SSD scan within round-off. Power: the same checks on the package's
default paths (``mamba2_chunk_scan`` for a prefill, ``mamba2_state_update`` for a decode step) fail on this CPU.

The gated RMSNorm after the scan (``gated_rms_norm_invariant``) gives a row the same bits alone or among others, at
one or two threads; upstream's (``Mamba2RMSNormGated``, taken from a toy model) does not at a width of 1000 on two
threads, where ``F.silu``'s scalar tail falls inside a row at a thread's boundary."""

import functools

import pytest
import torch

from hf_hybridcache.kernels import mamba2_chunk_scan
from hf_hybridcache.kernels import mamba2_invariant as inv
from hf_hybridcache.kernels.state_update import mamba2_state_update
from hf_hybridcache.toy import build_model

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CLOSE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-5},
         torch.float16: {"rtol": 1e-3, "atol": 1e-5}}  # float32 round-off, one rounding to the dtype
T = 37
SPLITS = [1, 5, 16, 17, 30, 36]
HEADS, HEAD_DIM, GROUPS, STATE = 4, 8, 2, 16


def _inputs(dtype, rows=1, seed=0, heads=HEADS):
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(rows, T, heads, HEAD_DIM, generator=g).to(dtype),
        dt=torch.randn(rows, T, heads, generator=g).to(dtype),
        B=torch.randn(rows, T, GROUPS, STATE, generator=g).to(dtype),
        C=torch.randn(rows, T, GROUPS, STATE, generator=g).to(dtype),
        A=-torch.rand(heads, generator=g) - 0.05, D=torch.randn(heads, generator=g),
        dt_bias=torch.randn(heads, generator=g) * 0.5 - 1,
    )


def _scan(p, lo, hi, state=None, emit=()):
    sl = slice(lo, hi)
    return inv.mamba2_scan_invariant(p["x"][:, sl], p["dt"][:, sl], p["A"], p["B"][:, sl], p["C"][:, sl], p["D"],
                                     p["dt_bias"], True, initial_state=state, emit_positions=emit)


def _step(p, t, state):
    return inv.mamba2_step_invariant(state, p["x"][:, t], p["dt"][:, t], p["A"], p["B"][:, t], p["C"][:, t], p["D"],
                                     p["dt_bias"], True)


def _chunked(p, lo, hi, state=None):
    sl = slice(lo, hi)
    return mamba2_chunk_scan(p["x"][:, sl], p["dt"][:, sl], p["A"], p["B"][:, sl], p["C"][:, sl], 16, D=p["D"],
                             dt_bias=p["dt_bias"], dt_softplus=True, initial_state=state)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_equals_decode_steps_bit_for_bit(dtype, rows):
    p = _inputs(dtype, rows)
    y, final, _ = _scan(p, 0, T)
    state = torch.zeros_like(final)
    assert torch.equal(torch.stack([_step(p, t, state) for t in range(T)], dim=1), y)
    assert torch.equal(state, final)
    y_ref, final_ref, _ = _chunked({k: v.float() for k, v in p.items()}, 0, T)
    torch.testing.assert_close(y, y_ref.to(dtype), **CLOSE[dtype])
    torch.testing.assert_close(final, final_ref, **CLOSE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_any_split_and_the_emitted_states_give_the_same_bits(dtype):
    p = _inputs(dtype, seed=1)
    y, final, emitted = _scan(p, 0, T, emit=SPLITS)
    for split, state_at_split in zip(SPLITS, emitted, strict=True):
        y_head, head_state, _ = _scan(p, 0, split)
        assert torch.equal(head_state, state_at_split), split
        y_tail, tail_state, _ = _scan(p, split, T, head_state)
        assert torch.equal(torch.cat([y_head, y_tail], dim=1), y) and torch.equal(tail_state, final), split


@pytest.mark.parametrize("heads", [HEADS, 256])  # 256 heads: the elementwise ops run on two threads
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_is_the_same_bits_whatever_rows_share_the_call(dtype, heads):
    batch = _inputs(dtype, rows=5, seed=2, heads=heads)
    alone = {k: (v[2:3] if k in ("x", "dt", "B", "C") else v) for k, v in batch.items()}
    y_batch, final_batch, _ = _scan(batch, 0, T)
    y_alone, final_alone, _ = _scan(alone, 0, T)
    assert torch.equal(y_batch[2:3], y_alone) and torch.equal(final_batch[2:3], final_alone)
    _, states, _ = _scan(batch, 0, 30)
    one = states[2:3].clone()
    assert torch.equal(_step(batch, 30, states)[2:3], _step(alone, 30, one))
    assert torch.equal(states[2:3], one)


def test_the_state_must_be_float32():
    with pytest.raises(ValueError, match="float32"):
        _step(_inputs(torch.bfloat16), 0, torch.zeros(1, HEADS, HEAD_DIM, STATE, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_power_the_default_paths_give_a_token_other_state_bits_in_a_decode_step(dtype):
    """The chunked prefill's last token against the same token as the package's decode step (measured: states 7.2e-7
    in float32, 9.5e-7 in bf16)."""
    p = _inputs(dtype, seed=3)
    _, final, _ = _chunked(p, 0, T)
    _, head_state, _ = _chunked(p, 0, T - 1)
    state = head_state.clone()
    t = T - 1
    mamba2_state_update(state, p["x"][:, t], p["dt"][:, t, :, None].expand(1, HEADS, HEAD_DIM),
                        p["A"][:, None, None].expand(HEADS, HEAD_DIM, STATE), p["B"][:, t], p["C"][:, t],
                        p["D"][:, None].expand(HEADS, HEAD_DIM), p["dt_bias"][:, None].expand(HEADS, HEAD_DIM), True)
    assert not torch.equal(state, final)


def test_power_the_chunked_scan_depends_on_where_its_grid_starts():
    p = _inputs(torch.float32, seed=4)
    _, final, _ = _chunked(p, 0, T)
    differs = []
    for split in SPLITS:
        _, head_state, _ = _chunked(p, 0, split)
        differs.append(not torch.equal(_chunked(p, split, T, head_state)[1], final))
    assert any(differs)


#: (rows, tokens) of the norm's calls: a decode step's rows, prefills of one and several rows (up to 128 x 1000
#: channels, past the 32,768 elements at which torch splits an elementwise op between threads).
NORM_CALLS = [(1, 1), (4, 1), (8, 1), (1, 37), (3, 13), (2, 64)]


def _norm_inputs(dtype, width, rows, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(rows, tokens, width, generator=g)  # float32: the scan's output, in every model dtype
    projected = torch.randn(rows, tokens, width + 37, generator=g).to(dtype)
    return y, projected[..., :width]  # the gate: a strided view of the projection, as in the mixer


def _worst_row_difference(norm, width, dtype) -> float:
    """Largest difference between a row's norm computed alone and inside each call of :data:`NORM_CALLS`."""
    worst = 0.0
    for seed, (rows, tokens) in enumerate(NORM_CALLS):
        y, gate = _norm_inputs(dtype, width, rows, tokens, seed)
        together = norm(y, gate)
        for r in range(rows):
            for t in range(tokens):
                alone = norm(y[r : r + 1, t : t + 1].clone(), gate[r : r + 1, t : t + 1].clone())
                worst = max(worst, (alone - together[r : r + 1, t : t + 1]).abs().max().item())
    return worst


def _upstream_norm(width, groups, dtype):
    """The model's own gated norm class (``Mamba2RMSNormGated``), at ``width`` channels, with a random weight."""
    norm_class = type(build_model("mamba2", seed=0).backbone.layers[0].mixer.norm)
    norm = norm_class(width, group_size=width // groups).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=torch.Generator().manual_seed(7)))
    return norm


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("width, groups", [(128, 2), (1000, 1), (200, 2)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_norm_gives_a_row_the_same_bits_whatever_shares_its_call(dtype, width, groups, threads):
    torch.set_num_threads(threads)
    upstream = _upstream_norm(width, groups, dtype)
    invariant = functools.partial(inv.gated_rms_norm_invariant, weight=upstream.weight, group_size=width // groups,
                                  eps=upstream.variance_epsilon)
    with torch.no_grad():
        assert _worst_row_difference(invariant, width, dtype) == 0.0
        y, gate = _norm_inputs(dtype, width, 3, 13, seed=9)
        torch.testing.assert_close(invariant(y, gate), upstream(y, gate), **CLOSE[dtype])


def test_power_upstreams_gated_norm_moves_a_row_with_its_batch():
    """Measured: 1.2e-7 in float32 at a width of 1000 on two threads."""
    torch.set_num_threads(2)
    with torch.no_grad():
        assert _worst_row_difference(_upstream_norm(1000, 1, torch.float32), 1000, torch.float32) > 0


def test_gated_norm_refuses_a_width_its_groups_do_not_divide():
    with pytest.raises(ValueError, match="not a multiple of its group size"):
        inv.gated_rms_norm_invariant(torch.zeros(1, 10), torch.zeros(1, 10), torch.ones(10), 4, 1e-6)
