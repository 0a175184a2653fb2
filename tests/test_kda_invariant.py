"""Kimi delta attention (KDA) with one arithmetic per token (hf_hybridcache/kernels/kda_invariant.py, issue 46): a
token's output and state are the same bits in a prefill, at any offset of a split prompt, or in a decode step, and a
row's the same alone or among others (1 to 9 rows, one and two threads); the scan agrees with the chunked KDA and its
recurrence within round-off. Power: the same checks on the package's default paths (``chunk_kimi_delta_attention``
for a prefill, ``recurrent_kimi_delta_attention`` for decode steps, ``kimi_delta_steps`` for a verify step's few
tokens) fail on this CPU.

The sigmoid-gated output norm (``sigmoid_gated_rms_norm_invariant``) is upstream's ``KimiLinearRMSNormGated`` within
round-off and gives a row the same bits alone or among others at two threads; upstream's does not at a width of 1000
(``torch.sigmoid``'s scalar tail inside a row)."""

import pytest
import torch

from hf_hybridcache.kernels import chunk_kimi_delta_attention, kimi_delta_steps
from hf_hybridcache.kernels import kda_invariant as inv
from hf_hybridcache.kernels.kda import recurrent_kimi_delta_attention
from hf_hybridcache.toy import build_model

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
T = 37
SPLITS = [1, 5, 16, 17, 30, 36]
HEADS, K_DIM, V_DIM = 3, 20, 12


def _inputs(dtype, rows=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        query=torch.randn(rows, T, HEADS, K_DIM, generator=g).to(dtype),
        key=torch.randn(rows, T, HEADS, K_DIM, generator=g).to(dtype),
        value=torch.randn(rows, T, HEADS, V_DIM, generator=g).to(dtype),
        g=(-torch.rand(rows, T, HEADS, K_DIM, generator=g) * 0.3).to(dtype),
        beta=torch.rand(rows, T, HEADS, generator=g).to(dtype),
    )


def _cut(p, lo, hi, rows=slice(None)):
    return {name: x[rows, lo:hi] for name, x in p.items()}


def _scan(p, lo, hi, state=None, emit=(), rows=slice(None)):
    return inv.kda_scan_invariant(**_cut(p, lo, hi, rows), initial_state=state, emit_positions=emit)


def _steps(p, lo, hi, state):
    """Tokens ``[lo, hi)`` as decode steps in place on ``state``; their outputs ``[B, hi - lo, H, Dv]``."""
    return torch.stack([inv.kda_step_invariant(state, *(x[:, t] for x in p.values())) for t in range(lo, hi)], dim=1)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_equals_decode_steps_bit_for_bit(dtype, rows):
    p = _inputs(dtype, rows)
    out, final, emitted = _scan(p, 0, T, emit=SPLITS)
    state = torch.zeros(rows, HEADS, K_DIM, V_DIM)
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
def test_a_row_alone_equals_the_row_in_batches_of_several_sizes(dtype, threads):
    torch.set_num_threads(threads)
    p = _inputs(dtype, 9, seed=1)
    out, final, _ = _scan(p, 0, T)
    for rows in (slice(0, 1), slice(4, 5), slice(8, 9), slice(2, 4), slice(3, 8)):
        part, state, _ = _scan(p, 0, T, rows=rows)
        assert torch.equal(part, out[rows]) and torch.equal(state, final[rows]), f"rows {rows}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_scan_is_the_chunked_kda_and_its_recurrence_within_round_off(dtype):
    p = _inputs(dtype, 2)
    state0 = torch.randn(2, HEADS, K_DIM, V_DIM, generator=torch.Generator().manual_seed(3)) * 0.1
    out, final, emitted = _scan(p, 0, T, state0, emit=[16, 21])
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype != torch.float32 else {"rtol": 1e-5, "atol": 1e-5}
    kwargs = dict(initial_state=state0, output_final_state=True, use_qk_l2norm_in_kernel=True, emit_positions=[16, 21])
    for name, reference in (("chunked", lambda: chunk_kimi_delta_attention(**p, chunk_size=16, **kwargs)),
                            ("recurrent", lambda: recurrent_kimi_delta_attention(**p, **kwargs))):
        ref_out, ref_final, ref_emitted = reference()
        torch.testing.assert_close(out, ref_out, **tol, msg=name)
        torch.testing.assert_close(final, ref_final, rtol=1e-4, atol=tol["atol"], msg=name)
        for mine, theirs in zip(emitted, ref_emitted, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=tol["atol"], msg=name)


def test_power_the_default_paths_move_a_token_with_its_path():
    """The package's default KDA: a prefill (chunked) and the same tokens as decode steps (the recurrence) differ, a
    split prompt differs from one prefill, and the few-token form of a verify step (``kimi_delta_steps``,
    ``matmul``) differs from the recurrence, in float32 at two threads."""
    torch.set_num_threads(2)
    p = _inputs(torch.float32, 9, seed=1)
    kwargs = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    out, _, _ = chunk_kimi_delta_attention(**p, **kwargs)
    state, steps = None, []
    for t in range(T):
        step, state, _ = recurrent_kimi_delta_attention(**_cut(p, t, t + 1), initial_state=state, **kwargs)
        steps.append(step)
    assert not torch.equal(torch.cat(steps, dim=1), out)
    head, mid, _ = chunk_kimi_delta_attention(**_cut(p, 0, 17), **kwargs)
    tail, _, _ = chunk_kimi_delta_attention(**_cut(p, 17, T), initial_state=mid, **kwargs)
    assert not torch.equal(torch.cat([head, tail], dim=1), out)
    stepped, _, _ = kimi_delta_steps(**p, **kwargs)
    assert not torch.equal(stepped, torch.cat(steps, dim=1))


def test_emit_positions_and_heads_are_checked():
    with pytest.raises(ValueError):
        _scan(_inputs(torch.float32), 0, T, emit=[0])
    p = _inputs(torch.float32)
    with pytest.raises(ValueError, match="as many query and key heads"):
        inv.kda_scan_invariant(p["query"][:, :, :1], p["key"], p["value"], p["g"], p["beta"])
    with pytest.raises(ValueError, match="float32"):
        inv.kda_step_invariant(torch.zeros(1, HEADS, K_DIM, V_DIM, dtype=torch.bfloat16),
                               *(x[:, 0] for x in p.values()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_output_norm_rows_alone_equal_rows_in_a_batch_where_upstreams_move(dtype):
    torch.set_num_threads(2)
    width = 1000
    norm = build_model("kimi_linear", seed=0, linear_head_dim=width).model.layers[0].self_attn.o_norm.to(dtype)
    g = torch.Generator().manual_seed(0)
    y, gate = (torch.randn(7, width, generator=g).to(dtype) for _ in range(2))

    def moved(fn):
        full = fn(y, gate)
        return [r for r in range(7) if not torch.equal(fn(y[r:r + 1], gate[r:r + 1])[0], full[r])]

    def mine(a, b):
        return inv.sigmoid_gated_rms_norm_invariant(a, b, norm.weight, norm.variance_epsilon)

    assert moved(mine) == []
    with torch.no_grad():
        torch.testing.assert_close(mine(y, gate), norm(y, gate), rtol=1.6e-2, atol=1e-5)
        if dtype == torch.float32:
            assert moved(norm) != []
