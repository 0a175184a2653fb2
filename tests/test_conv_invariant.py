"""The depthwise causal conv of deterministic mode (hf_hybridcache/kernels/conv_invariant.py, issue 46): a token's
output is the same bits in a prefill, at any split, or in a one-token decode call, whatever rows share it; it agrees
with transformers' prefill conv and with the package's decode update within round-off, and leaves the window they
leave. Power: transformers' prefill conv (``F.conv1d`` then ``F.silu``) against the package's decode update differs
on this CPU."""

import pytest
import torch
import torch.nn.functional as F

from hf_hybridcache.kernels.conv_invariant import causal_conv_invariant
from hf_hybridcache.kernels.state_update import causal_conv1d_update

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CLOSE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-5},
         torch.float16: {"rtol": 1e-3, "atol": 1e-5}}
T, WIDTH = 29, 4


def _inputs(dtype, rows=2, channels=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, channels, T, generator=g) * 2).to(dtype)
    return x, torch.randn(channels, WIDTH, generator=g).to(dtype), torch.randn(channels, generator=g).to(dtype)


def _conv1d_prefill(x, weight, bias):
    """transformers' torch prefill (``causal_conv1d_fn``'s fallback): conv1d padded by W - 1, then silu."""
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=WIDTH - 1, groups=x.shape[1])[..., : x.shape[-1]]
    return F.silu(out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_any_split_and_decode_calls_give_the_same_bits(dtype):
    x, weight, bias = _inputs(dtype)
    y, state = causal_conv_invariant(x, weight, bias)
    torch.testing.assert_close(y, _conv1d_prefill(x.float(), weight.float(), bias.float()).to(dtype), **CLOSE[dtype])
    assert torch.equal(state, x[..., -WIDTH:])
    for split in (1, 3, 4, 17, 28):
        head, head_state = causal_conv_invariant(x[..., :split], weight, bias)
        tail, tail_state = causal_conv_invariant(x[..., split:], weight, bias, conv_state=head_state)
        assert torch.equal(torch.cat([head, tail], dim=-1), y), split
        assert torch.equal(tail_state, state), split
    steps, window = [], None
    for t in range(T):
        out, window = causal_conv_invariant(x[..., t : t + 1], weight, bias, conv_state=window)
        steps.append(out)
    assert torch.equal(torch.cat(steps, dim=-1), y)


@pytest.mark.parametrize("channels", [40, 4096])  # 4096: the elementwise ops run on two threads
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_is_the_same_bits_whatever_rows_share_the_call(dtype, channels):
    x, weight, bias = _inputs(dtype, rows=5, channels=channels, seed=1)
    y, state = causal_conv_invariant(x, weight, bias)
    y_one, state_one = causal_conv_invariant(x[3:4], weight, bias)
    assert torch.equal(y[3:4], y_one) and torch.equal(state[3:4], state_one)
    step, _ = causal_conv_invariant(x[..., 5:6], weight, bias, conv_state=x[..., 1:5])
    step_one, _ = causal_conv_invariant(x[3:4, :, 5:6], weight, bias, conv_state=x[3:4, :, 1:5])
    assert torch.equal(step[3:4], step_one)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_decode_call_matches_the_packages_update_and_its_window(dtype):
    x, weight, bias = _inputs(dtype, seed=2)
    window = x[..., 10:14].clone()
    causal_conv1d_update(x[..., 14], window, weight, bias, "silu")
    # The update in float32 (in bf16 / fp16 it rounds each product to the dtype; this conv rounds once).
    expected = causal_conv1d_update(x[..., 14].float(), x[..., 10:14].float().clone(), weight.float(), bias.float(),
                                    "silu")
    out, new_window = causal_conv_invariant(x[..., 14:15], weight, bias, conv_state=x[..., 10:14])
    torch.testing.assert_close(out[..., 0], expected.to(dtype), **CLOSE[dtype])
    assert torch.equal(new_window, window)


def test_refuses_another_activation_or_a_state_of_another_width():
    x, weight, bias = _inputs(torch.float32)
    with pytest.raises(ValueError, match="activations"):
        causal_conv_invariant(x, weight, bias, activation="gelu")
    with pytest.raises(ValueError, match="3 inputs; the weight is 4 wide"):
        causal_conv_invariant(x, weight, bias, conv_state=x[..., :3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_power_the_prefill_conv_and_the_decode_update_give_a_token_other_bits(dtype):
    """The paths the package runs without the ingredient (measured: 9.5e-7 in float32, 3.1e-2 in bf16)."""
    x, weight, bias = _inputs(dtype, seed=3)
    prefill = _conv1d_prefill(x, weight, bias)
    steps = [causal_conv1d_update(x[..., t], x[..., t - WIDTH : t].clone(), weight, bias, "silu")
             for t in range(WIDTH, T)]
    assert not torch.equal(torch.stack(steps, dim=-1), prefill[..., WIDTH:])
