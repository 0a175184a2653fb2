"""kernels/attention_invariant.py (deterministic mode's attention, issue 46): a query's output is the same bits alone
in a decode step, inside a causal prefill of any length, inside a prefill chunk starting anywhere, and as a
left-padded row of a batch beside other requests; in float32, bfloat16 and float16, with grouped-query heads.
Power: F.scaled_dot_product_attention fails the same check (table 3 of benchmarks/batch_invariance.py: a decode step
and a prefill differ in every dtype here). And it is attention: within round-off of SDPA.

With a sliding window (Lara Mini's sliding layers), the same cases over all past keys and over only the keys a sliding
cache layer keeps, and as a left-padded row; power: the form anchored at position 0 with the window in the mask only
(what the kernel ran before it took a window) gives a query other bits once the keys before its window are dropped.
"""

import pytest
import torch
import torch.nn.functional as F

from hf_hybridcache.kernels.attention_invariant import (
    KV_BLOCK,
    attention_invariant,
    causal_visible,
    invariance_failures,
)

HEADS, KV_HEADS, HEAD_DIM, LENGTH, SCALE = 4, 2, 16, 90, 0.25
#: Positions at and around the block edges, and the last one.
POSITIONS = (0, 5, KV_BLOCK - 1, KV_BLOCK, KV_BLOCK + 1, 2 * KV_BLOCK, LENGTH - 1)


@pytest.fixture(params=[torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def dtype(request):
    return request.param


def tensors(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return draw(1, HEADS, LENGTH, HEAD_DIM), draw(1, KV_HEADS, LENGTH, HEAD_DIM), draw(1, KV_HEADS, LENGTH, HEAD_DIM)


def invariant(query, key, value, visible):
    return attention_invariant(query, key, value, visible, SCALE)


def sdpa(query, key, value, visible):
    groups = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                          attn_mask=visible, scale=SCALE)


def differing_cases(attention, dtype) -> list[str]:
    """The cases in which the query at a position gets other bits than in one causal prefill of all positions."""
    q, k, v = tensors(dtype)
    full = attention(q, k, v, causal_visible(LENGTH, LENGTH))
    pad = 7  # a decode row left-padded beside two longer rows (generate()'s batch, an engine decode group)
    gen = torch.Generator().manual_seed(1)
    other_q, other_k, other_v = (torch.randn(2, heads, LENGTH + pad, HEAD_DIM, generator=gen).to(dtype)
                                 for heads in (HEADS, KV_HEADS, KV_HEADS))
    failed = []
    for p in POSITIONS:
        cases = {"decode": attention(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1], causal_visible(1, p + 1))}
        for start in sorted({0, min(16, p), p}):  # prefill chunks over the cached past, ending after p
            end = min(p + 3, LENGTH)
            out = attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end], causal_visible(end - start, end))
            cases[f"chunk {start}:{end}"] = out[:, :, p - start : p - start + 1]
        keys = torch.cat([torch.cat([other_k[:1, :, :pad], k[:, :, : p + 1]], 2), other_k[:, :, : p + 1 + pad]])
        values = torch.cat([torch.cat([other_v[:1, :, :pad], v[:, :, : p + 1]], 2), other_v[:, :, : p + 1 + pad]])
        visible = torch.ones(3, 1, 1, p + 1 + pad, dtype=torch.bool)
        visible[0, ..., :pad] = False
        queries = torch.cat([q[:, :, p : p + 1], other_q[:, :, p : p + 1]])
        cases["padded row"] = attention(queries, keys, values, visible)[:1]
        failed += [f"{name} at {p}" for name, out in cases.items() if not torch.equal(out, full[:, :, p : p + 1])]
    return failed


def test_a_query_gets_the_same_bits_in_every_call(dtype):
    assert differing_cases(invariant, dtype) == []


def test_sdpa_fails_the_same_check(dtype):
    assert differing_cases(sdpa, dtype)


def test_the_construction_probe_passes_here_and_catches_sdpa(dtype):
    """What deterministic mode runs when a cache is built (it refuses where the probe finds a case)."""
    assert invariance_failures(dtype) == []
    assert invariance_failures(dtype, attention=lambda q, k, v, visible, scale: sdpa(q, k, v, visible))


def test_it_is_attention_within_round_off(dtype):
    q, k, v = tensors(dtype)
    visible = causal_visible(LENGTH, LENGTH)
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    expected = sdpa(q.float(), k.float(), v.float(), visible)
    torch.testing.assert_close(invariant(q, k, v, visible).float(), expected, atol=tolerance, rtol=0)


def test_a_query_that_sees_no_key_gets_zeros_and_bad_shapes_are_refused():
    q, k, v = tensors(torch.float32)
    visible = torch.zeros(1, 1, 1, LENGTH, dtype=torch.bool)
    assert torch.equal(invariant(q[:, :, :1], k, v, visible), torch.zeros(1, HEADS, 1, HEAD_DIM))
    with pytest.raises(ValueError, match="multiple of the key heads"):
        invariant(q[:, :3], k, v, causal_visible(LENGTH, LENGTH))
    with pytest.raises(ValueError, match="visible must be"):
        invariant(q, k, v, causal_visible(LENGTH, LENGTH)[..., :-1])


WINDOW = 24  # shorter than a block of keys, so a query's window straddles block edges anchored at 0


def test_a_windowed_query_gets_the_same_bits_whatever_keys_the_cache_holds(dtype):
    """Decode steps and prefill chunks over every past key and over the window only, at and around block edges."""
    assert invariance_failures(dtype, window=WINDOW) == []
    assert invariance_failures(dtype, window=2 * KV_BLOCK + 3) == []


def test_a_windowed_padded_row_equals_the_row_alone(dtype):
    q, k, v = tensors(dtype)
    full = attention_invariant(q, k, v, causal_visible(LENGTH, LENGTH, window=WINDOW), SCALE, window=WINDOW)
    pad, p = 7, 50
    keys, values = (torch.cat([torch.zeros(1, KV_HEADS, pad, HEAD_DIM, dtype=dtype), x[:, :, : p + 1]], 2)
                    for x in (k, v))
    visible = causal_visible(1, p + 1 + pad, window=WINDOW).clone()
    visible[..., :pad] = False
    out = attention_invariant(q[:, :, p : p + 1], keys, values, visible, SCALE, window=WINDOW)
    assert torch.equal(out, full[:, :, p : p + 1])


def test_the_form_anchored_at_zero_fails_the_windowed_check(dtype):
    def at_zero(query, key, value, visible, scaling, window):
        return attention_invariant(query, key, value, visible, scaling)

    assert invariance_failures(dtype, attention=at_zero, window=WINDOW)


def test_windowed_attention_is_attention_within_round_off(dtype):
    q, k, v = tensors(dtype)
    visible = causal_visible(LENGTH, LENGTH, window=WINDOW)
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    expected = sdpa(q.float(), k.float(), v.float(), visible)
    torch.testing.assert_close(attention_invariant(q, k, v, visible, SCALE, window=WINDOW).float(), expected,
                               atol=tolerance, rtol=0)
