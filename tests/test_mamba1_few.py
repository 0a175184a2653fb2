"""The few-token Mamba-1 scan (hf_hybridcache/kernels/mamba1_few.py): against the token-by-token reference on odd
sizes, its states against decode steps', what it returns owning no memory the caller updates, and the
dispatch.

Power: summing ``dt * B * x`` before the decay (``h = (h + dBx) * dA``) fails the reference test; returning the last
emitted view as the final state fails the aliasing test (checked by hand when this test was written)."""

import pytest
import torch

from hf_hybridcache import kernels
from hf_hybridcache.kernels import mamba1_few, mamba1_scan, selective_scan_ref
from hf_hybridcache.kernels.state_update import selective_state_update_fast

# fp32 round-off of a few products and a sum over N <= 16 terms, compounded over at most 8 tokens.
FP32 = {"rtol": 1e-5, "atol": 1e-5}


def _inputs(batch, channels, tokens, state_size, seed):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    return dict(u=randn(batch, channels, tokens), delta=randn(batch, channels, tokens),
                A=-torch.rand(channels, state_size, generator=g) - 0.1, B=randn(batch, state_size, tokens),
                C=randn(batch, state_size, tokens), D=randn(channels), z=randn(batch, channels, tokens),
                delta_bias=randn(channels), delta_softplus=True, initial_state=randn(batch, channels, state_size))


@pytest.mark.parametrize("batch, channels, tokens, state_size", [(1, 8, 5, 4), (3, 17, 8, 16), (2, 5, 1, 3)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("initial", [True, False], ids=["from-state", "from-zeros"])
def test_few_equals_reference(batch, channels, tokens, state_size, initial):
    inputs = _inputs(batch, channels, tokens, state_size, seed=batch * 100 + tokens)
    if not initial:
        inputs["initial_state"] = None
    positions = tuple(range(1, tokens + 1))
    y_ref, final_ref, emitted_ref = selective_scan_ref(**inputs, emit_positions=positions)
    y, final, emitted = mamba1_few.selective_scan_few(**inputs, emit_positions=positions)
    torch.testing.assert_close(y, y_ref, **FP32)
    torch.testing.assert_close(final, final_ref, **FP32)
    assert len(emitted) == len(emitted_ref)
    for state, state_ref in zip(emitted, emitted_ref):
        assert state.shape == state_ref.shape and state.is_contiguous()
        torch.testing.assert_close(state, state_ref, **FP32)


def test_states_follow_decode_steps():
    """Each emitted state is the state decode steps reach (the same ops; a vectorized exp or softplus may round the
    last bit differently from the scalar one at another memory layout)."""
    inputs = _inputs(2, 12, 6, 8, seed=7)
    _, final, emitted = mamba1_few.selective_scan_few(**inputs, emit_positions=(1, 2, 3, 4, 5))
    state = inputs["initial_state"].clone()
    for t in range(6):
        selective_state_update_fast(state, inputs["u"][..., t], inputs["delta"][..., t], inputs["A"],
                                    inputs["B"][..., t], inputs["C"][..., t], inputs["D"], inputs["z"][..., t],
                                    inputs["delta_bias"], True)
        torch.testing.assert_close(emitted[t] if t < 5 else final, state, rtol=1e-6, atol=1e-6)


def test_final_state_owns_its_memory():
    """The caller updates the final state in place (a decode step's live state); no emitted checkpoint may change."""
    inputs = _inputs(1, 8, 4, 4, seed=3)
    initial = inputs["initial_state"].clone()
    _, final, emitted = mamba1_few.selective_scan_few(**inputs, emit_positions=(1, 2, 3, 4))
    kept = [state.clone() for state in emitted]
    final.mul_(2.0)
    assert all(torch.equal(state, copy) for state, copy in zip(emitted, kept))
    assert torch.equal(inputs["initial_state"], initial)  # the initial state is read, never written


def test_dispatch_takes_few_tokens_only(monkeypatch):
    calls = []
    monkeypatch.setattr(mamba1_scan, "selective_scan_few", lambda *a, **k: calls.append("few"))
    monkeypatch.setattr(mamba1_scan, "selective_scan_chunked", lambda *a, **k: calls.append("chunked"))
    previous = kernels.set_backend("torch")
    try:
        for tokens in (mamba1_few.FEW_SCAN_TOKENS, mamba1_few.FEW_SCAN_TOKENS + 1):
            inputs = _inputs(1, 4, tokens, 2, seed=tokens)
            kernels.selective_scan(**inputs)
    finally:
        kernels.set_backend(previous)
    assert calls == ["few", "chunked"]
