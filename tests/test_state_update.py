"""Single-token state updates (hf_hybridcache/kernels/state_update.py): each fast path against its reference (a copy
of transformers' torch fallback) on random inputs, in place on the states; the dispatch; and Jamba's patched decode
step against the unpatched mixer's.

Power: dropping the ``D * x`` skip from ``selective_state_update_fast``, or summing the conv window over the old
window (before the new input rolls in), fails the agreement tests; a decode step that leaves the SSM state untouched
fails the Jamba test; dropping beta from gated_delta_step_fast fails 7 tests; a decode step that leaves the routed
functions unrouted fails the Qwen3.5 and LFM2 counts (each checked by hand when this test was written)."""

import pytest
import torch
from conftest import random_ids

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache, kernels
from hf_hybridcache.kernels import state_update
from hf_hybridcache.models import jamba
from hf_hybridcache.toy import build_model

# fp32 round-off of a few products and a sum over N <= 16 terms.
FP32 = {"rtol": 1e-5, "atol": 1e-6}


def _randn(g, *shape):
    return torch.randn(*shape, generator=g)


@pytest.mark.parametrize("rows, channels, width", [(1, 8, 4), (3, 5, 2), (2, 17, 3)], ids=lambda v: str(v))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_conv_update_fast_equals_reference(rows, channels, width, bias):
    g = torch.Generator().manual_seed(rows * 100 + channels)
    x, state = _randn(g, rows, channels), _randn(g, rows, channels, width)
    weight, b = _randn(g, channels, width), _randn(g, channels) if bias else None
    ref_state, fast_state = state.clone(), state.clone()
    ref = state_update.causal_conv1d_update_ref(x, ref_state, weight, b, "silu")
    fast = state_update.causal_conv1d_update_fast(x, fast_state, weight, b, "silu")
    torch.testing.assert_close(fast, ref, **FP32)
    assert torch.equal(fast_state, ref_state)  # the roll moves values, no arithmetic
    assert torch.equal(fast_state[..., -1], x) and torch.equal(fast_state[..., :-1], state[..., 1:])


@pytest.mark.parametrize("rows, channels, state_size", [(1, 8, 4), (3, 5, 16), (2, 33, 7)], ids=lambda v: str(v))
def test_selective_state_update_fast_equals_reference(rows, channels, state_size):
    g = torch.Generator().manual_seed(rows * 1000 + channels)
    state = _randn(g, rows, channels, state_size)
    args = (
        _randn(g, rows, channels),  # x
        0.5 * _randn(g, rows, channels),  # dt
        -torch.exp(_randn(g, channels, state_size)),  # A
        _randn(g, rows, state_size),  # B
        _randn(g, rows, state_size),  # C
        _randn(g, channels),  # D
        _randn(g, rows, channels),  # z
        0.1 * _randn(g, channels),  # dt_bias
        True,  # dt_softplus
    )
    ref_state, fast_state = state.clone(), state.clone()
    ref = state_update.selective_state_update_ref(ref_state, *args)
    fast = state_update.selective_state_update_fast(fast_state, *args)
    torch.testing.assert_close(fast, ref, **FP32)
    torch.testing.assert_close(fast_state, ref_state, **FP32)
    assert not torch.allclose(ref_state, state)  # the update moved the state


def test_dispatch_picks_the_fast_path_and_the_reference_when_asked(monkeypatch):
    calls = []
    for name in ("causal_conv1d_update_ref", "causal_conv1d_update_fast"):
        original = getattr(state_update, name)
        monkeypatch.setattr(state_update, name, lambda *a, _n=name, _o=original: calls.append(_n) or _o(*a))
    x, state, weight = torch.randn(1, 4), torch.randn(1, 4, 3), torch.randn(4, 3)
    state_update.causal_conv1d_update(x, state, weight)
    with kernels.use_backend("reference"):
        state_update.causal_conv1d_update(x, state, weight)
    assert calls == ["causal_conv1d_update_fast", "causal_conv1d_update_ref"]


@pytest.mark.parametrize("heads", [(2, 2), (2, 4), (1, 3)], ids=["Hk2-Hv2", "Hk2-Hv4", "Hk1-Hv3"])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "raw"])
def test_gated_delta_step_fast_equals_the_token_by_token_rule(heads, l2norm):
    num_k_heads, num_v_heads = heads
    g = torch.Generator().manual_seed(num_k_heads * 10 + num_v_heads)
    query, key = _randn(g, 3, 1, num_k_heads, 8), _randn(g, 3, 1, num_k_heads, 8)
    value = _randn(g, 3, 1, num_v_heads, 5)
    decay, beta = -torch.rand(3, 1, num_v_heads, generator=g), torch.rand(3, 1, num_v_heads, generator=g)
    state = _randn(g, 3, num_v_heads, 8, 5)
    before = state.clone()
    ref, ref_state, _ = kernels.recurrent_gated_delta_rule(query, key, value, decay, beta, state, True, l2norm)
    fast, fast_state = state_update.gated_delta_step_fast(query, key, value, decay, beta, state, l2norm)
    torch.testing.assert_close(fast, ref, **FP32)
    torch.testing.assert_close(fast_state, ref_state, **FP32)
    assert torch.equal(state, before)  # the cached state is left as it was


@pytest.mark.parametrize("shape", [(1, 4, 3, 1, 5), (2, 4, 3, 2, 5), (3, 6, 2, 3, 4)], ids=lambda v: str(v))
def test_mamba2_state_update_fast_equals_reference(shape):
    """Arguments as the Mamba-2 mixers pass them (dt, A, D and dt_bias expanded over the head's channels)."""
    rows, heads, head_dim, groups, state_size = shape
    g = torch.Generator().manual_seed(sum(shape))
    state, x = _randn(g, rows, heads, head_dim, state_size), _randn(g, rows, heads, head_dim)
    dt = _randn(g, rows, heads, 1).expand(-1, -1, head_dim)
    A = (-torch.exp(_randn(g, heads)))[:, None, None].expand(-1, head_dim, state_size)
    B, C = _randn(g, rows, groups, state_size), _randn(g, rows, groups, state_size)
    D, dt_bias = (_randn(g, heads)[:, None].expand(-1, head_dim) for _ in range(2))
    z = _randn(g, rows, heads, head_dim)
    ref_state, fast_state = state.clone(), state.clone()
    ref = state_update.mamba2_state_update_ref(ref_state, x, dt, A, B, C, D, dt_bias, True, z)
    fast = state_update.mamba2_state_update_fast(fast_state, x, dt, A, B, C, D, dt_bias, True, z)
    torch.testing.assert_close(fast, ref, **FP32)
    torch.testing.assert_close(fast_state, ref_state, **FP32)
    assert not torch.allclose(ref_state, state)


#: family -> (module holding the fused function it calls, that function's name, decode calls per step and layer).
DECODE_PATHS = {
    "jamba": (jamba, "selective_state_update"),
    "bamba": (state_update, "mamba2_state_update_fast"),
    "granitemoehybrid": (state_update, "mamba2_state_update_fast"),
    "qwen3_5_text": (state_update, "gated_delta_step_fast"),
    "lfm2": (state_update, "causal_conv1d_update_fast"),
}


@pytest.mark.parametrize("family", list(DECODE_PATHS))
def test_decode_steps_follow_the_unpatched_model(family, monkeypatch):
    """generate() through the cache runs the fused decode step (counted: once per decode step and recurrent layer);
    every step's logits follow the unpatched model's (transformers' own single-token branch) within 1e-4 and the
    tokens are equal. The patched model without the cache runs upstream's decode, bit-identical."""
    cold = build_model(family, seed=0)
    model = build_model(family, seed=0)
    cache = HybridPrefixCache(model)
    module, name = DECODE_PATHS[family]
    calls = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    ids = random_ids(21, seed=5)
    kwargs = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "output_logits": True,
              "return_dict_in_generate": True}
    out = model.generate(ids, **{CACHE_KWARG: cache}, **kwargs)
    ref = cold.generate(ids, **kwargs)
    assert len(calls) == 7 * len(cache.spec.mamba)  # every decode step of every recurrent layer
    plain = model.generate(ids, **kwargs)  # the patched model with transformers' own cache: upstream's decode
    assert len(calls) == 7 * len(cache.spec.mamba)
    for got, want in zip(plain.logits, ref.logits):
        assert torch.equal(got, want)
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.logits, ref.logits):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
