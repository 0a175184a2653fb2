"""The gated delta rule with one arithmetic per token (hf_hybridcache/kernels/gated_delta_invariant.py, issue 46): a
token's output and state are the same bits in a prefill, at any offset of a split prompt, or in a decode step, and a
row's the same alone or among others; the scan agrees with the chunked rule within round-off. Power: the same checks
on the package's default paths (``chunk_gated_delta_rule`` for a prefill, ``recurrent_gated_delta_rule`` for a decode
step) fail on this CPU.

The gated RMSNorm after the rule (``gated_rms_norm_after_invariant``) gives a row the same bits alone or among others
at two threads; upstream's (``Qwen3_5RMSNormGated``, taken from a toy model) does not at a width of 1000, where
``F.silu``'s scalar tail falls inside a row."""

import pytest
import torch

from hf_hybridcache.kernels import chunk_gated_delta_rule, recurrent_gated_delta_rule
from hf_hybridcache.kernels import gated_delta_invariant as inv
from hf_hybridcache.toy import build_model

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
T = 37
SPLITS = [1, 5, 16, 17, 30, 36]
K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 16, 8


def _inputs(dtype, rows=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        query=torch.randn(rows, T, K_HEADS, K_DIM, generator=g).to(dtype),
        key=torch.randn(rows, T, K_HEADS, K_DIM, generator=g).to(dtype),
        value=torch.randn(rows, T, V_HEADS, V_DIM, generator=g).to(dtype),
        g=(-torch.rand(rows, T, V_HEADS, generator=g) * 0.3).to(dtype),
        beta=torch.rand(rows, T, V_HEADS, generator=g).to(dtype),
    )


def _cut(p, lo, hi, rows=slice(None)):
    return {name: x[rows, lo:hi] for name, x in p.items()}


def _scan(p, lo, hi, state=None, emit=(), rows=slice(None)):
    return inv.gated_delta_rule_scan_invariant(**_cut(p, lo, hi, rows), initial_state=state, emit_positions=emit)


def _steps(p, lo, hi, state):
    """Tokens ``[lo, hi)`` as decode steps in place on ``state``; their outputs ``[B, hi - lo, Hv, Dv]``."""
    return torch.stack([inv.gated_delta_rule_step_invariant(state, *(x[:, t] for x in p.values()))
                        for t in range(lo, hi)], dim=1)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_equals_decode_steps_bit_for_bit(dtype, rows):
    p = _inputs(dtype, rows)
    out, final, emitted = _scan(p, 0, T, emit=SPLITS)
    state = torch.zeros(rows, V_HEADS, K_DIM, V_DIM)
    steps = []
    for t in range(T):
        steps.append(_steps(p, t, t + 1, state))
        if t + 1 in SPLITS:
            assert torch.equal(emitted[SPLITS.index(t + 1)], state), f"state after {t + 1} tokens"
    assert torch.equal(torch.cat(steps, dim=1), out)
    assert torch.equal(final, state)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split", SPLITS)
def test_a_split_prompt_equals_one_prefill_bit_for_bit(dtype, split):
    p = _inputs(dtype, 2)
    out, final, _ = _scan(p, 0, T)
    head, state, _ = _scan(p, 0, split)
    tail, state, _ = _scan(p, split, T, state)
    assert torch.equal(torch.cat([head, tail], dim=1), out)
    assert torch.equal(state, final)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_alone_equals_the_row_in_a_batch(dtype, threads):
    torch.set_num_threads(threads)
    p = _inputs(dtype, 9, seed=1)
    out, final, _ = _scan(p, 0, T)
    for row in (0, 4, 8):
        alone, state, _ = _scan(p, 0, T, rows=slice(row, row + 1))
        assert torch.equal(alone[0], out[row]) and torch.equal(state[0], final[row]), f"row {row}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_scan_is_the_chunked_rule_within_round_off(dtype):
    p = _inputs(dtype, 2)
    state0 = torch.randn(2, V_HEADS, K_DIM, V_DIM, generator=torch.Generator().manual_seed(3)) * 0.1
    out, final, emitted = _scan(p, 0, T, state0, emit=[16])
    ref_out, ref_final, ref_emitted = chunk_gated_delta_rule(**p, chunk_size=16, initial_state=state0,
                                                             output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                             emit_positions=[16])
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype != torch.float32 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(final, ref_final, rtol=1e-4, atol=tol["atol"])
    torch.testing.assert_close(emitted[0], ref_emitted[0], rtol=1e-4, atol=tol["atol"])


def test_power_the_default_paths_move_a_token_with_its_path():
    """The package's default rule: a prefill (chunked) and the same tokens as decode steps (recurrent) differ, and
    so does a split prompt against one prefill, in float32."""
    p = _inputs(torch.float32, 3)
    kwargs = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    out, final, _ = chunk_gated_delta_rule(**p, **kwargs)
    state, steps = None, []
    for t in range(T):
        step, state, _ = recurrent_gated_delta_rule(**_cut(p, t, t + 1), initial_state=state, **kwargs)
        steps.append(step)
    assert not torch.equal(torch.cat(steps, dim=1), out)
    head, mid, _ = chunk_gated_delta_rule(**_cut(p, 0, 17), **kwargs)
    tail, _, _ = chunk_gated_delta_rule(**_cut(p, 17, T), initial_state=mid, **kwargs)
    assert not torch.equal(torch.cat([head, tail], dim=1), out)


def test_emit_positions_are_checked():
    with pytest.raises(ValueError):
        _scan(_inputs(torch.float32), 0, T, emit=[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_norm_rows_alone_equal_rows_in_a_batch_where_upstreams_move(dtype):
    torch.set_num_threads(2)
    width = 1000
    norm = build_model("qwen3_5_text", seed=0, linear_value_head_dim=width).model.layers[0].linear_attn.norm
    norm = norm.to(dtype)
    g = torch.Generator().manual_seed(0)
    y, gate = (torch.randn(7, width, generator=g).to(dtype) for _ in range(2))

    def moved(fn):
        full = fn(y, gate)
        return [r for r in range(7) if not torch.equal(fn(y[r:r + 1], gate[r:r + 1])[0], full[r])]

    assert moved(lambda a, b: inv.gated_rms_norm_after_invariant(a, b, norm.weight, norm.variance_epsilon)) == []
    with torch.no_grad():
        torch.testing.assert_close(inv.gated_rms_norm_after_invariant(y, gate, norm.weight, norm.variance_epsilon),
                                   norm(y, gate), rtol=1.6e-2, atol=1e-5)
        if dtype == torch.float32:
            assert moved(norm) != []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sigmoid_invariant_is_the_sigmoid_and_stays_put(dtype):
    torch.set_num_threads(2)
    x = (torch.randn(40, 100, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    full = inv.sigmoid_invariant(x)
    torch.testing.assert_close(full, torch.sigmoid(x), rtol=1.6e-2 if dtype != torch.float32 else 1e-6, atol=1e-6)
    assert all(torch.equal(inv.sigmoid_invariant(x[:n]), full[:n]) for n in (1, 2, 3, 5, 7, 9, 33))
    if dtype == torch.float32:
        assert not all(torch.equal(torch.sigmoid(x[:n]), torch.sigmoid(x)[:n]) for n in (1, 2, 3, 5, 7, 9, 33))
