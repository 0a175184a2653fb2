"""Deterministic mode's ingredients for Inkling 2 (``inkling2_text``) and Inkling 2 Loop (``inkling2_loop_text``),
issue 46: the forms the two families run in deterministic mode (their banks: tests/test_deterministic_inkling2.py).

- The dynamic short conv's per-token taps (``Inkling2DynamicShortConvolution``, on the keys and values of the
  full-attention layers): :func:`~hf_hybridcache.kernels.conv_invariant.dynamic_conv_invariant` forms each tap
  ``static[k] + dynamic[t, h, k]`` elementwise and adds the ``W`` products in the order ``k = 0 .. W-1``: a token's
  output is the same bits in one prefill, in a chunk from any offset, token by token as decode steps over the window
  it leaves, and as a row among others; it is upstream's module output within round-off (with the module's own
  residual and scale around it).
- Sink logits (one extra logit per query and head with no value): the invariant attention's ``sinks`` put them in a
  fixed first slot of its online softmax, so a decode step over the keys a cache layer keeps (a sliding layer's
  window) and a prefill chunk give a query its bits in one prefill, full or windowed, with a relative bias or not; the
  result is upstream's eager attention with sinks within round-off.
- The experts' softcapped SwiGLU and the l2 clip of the queries, keys and relative states
  (:mod:`hf_hybridcache.kernels.inkling2_invariant`): an element's (a head vector's) bits at any offset and among other
  rows, and upstream's modules within round-off.
- The block attention residual (learned queries over the earlier blocks' states at each position): a position's bits
  alone, in any chunk and among other rows, and upstream's scaled-dot-product attention within round-off.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_hybridcache.kernels.attention_invariant import attention_invariant, causal_visible
from hf_hybridcache.kernels.conv_invariant import dynamic_conv_invariant
from hf_hybridcache.kernels.inkling2_invariant import (
    block_residual_invariant,
    l2_clip_invariant,
    softcapped_swiglu_invariant,
)

DTYPES3 = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])


def _dynamic_inputs(dtype, batch=3, length=29, channels=24, heads=3, width=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, length, generator=gen).to(dtype)
    static = torch.randn(width, channels, generator=gen)
    dynamic = torch.randn(batch, length, heads, width, generator=gen)
    return x, static, dynamic


@DTYPES3
def test_dynamic_conv_gives_a_token_its_bits_in_any_call(dtype):
    """One prefill; a chunk from every offset continued from the window the prefix left; decode steps token by token;
    a row alone against the batch: the same bits, and the same window left."""
    x, static, dynamic = _dynamic_inputs(dtype)
    full, window = dynamic_conv_invariant(x, static, dynamic)
    for split in (1, 3, 4, 5, 17, 28):
        head, state = dynamic_conv_invariant(x[..., :split], static, dynamic[:, :split])
        tail, state = dynamic_conv_invariant(x[..., split:], static, dynamic[:, split:], state)
        assert torch.equal(torch.cat([head, tail], -1), full) and torch.equal(state, window), split
    state, steps = None, []
    for t in range(x.shape[-1]):
        step, state = dynamic_conv_invariant(x[..., t : t + 1], static, dynamic[:, t : t + 1], state)
        steps.append(step)
    assert torch.equal(torch.cat(steps, -1), full) and torch.equal(state, window)
    for row in range(x.shape[0]):
        alone, _ = dynamic_conv_invariant(x[row : row + 1], static, dynamic[row : row + 1])
        assert torch.equal(alone[0], full[row]), row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dynamic_conv_is_upstreams_module_within_round_off(dtype):
    modeling = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
    torch.manual_seed(0)
    module = modeling.Inkling2DynamicShortConvolution(24, 20, 3, 4, layer_idx=0, conv_idx=0)
    torch.nn.init.normal_(module.static_weight)
    module = module.to(dtype)
    hidden, layer_input = torch.randn(2, 13, 24).to(dtype), torch.randn(2, 13, 20).to(dtype)
    with torch.no_grad():
        expected = module(hidden, layer_input)
        dynamic = module.weight_proj(layer_input).float().view(2, 13, 3, 4)
        out, _ = dynamic_conv_invariant(hidden.float().transpose(1, 2), module.static_weight, dynamic)
    out = ((out.transpose(1, 2) + hidden.float()) / math.sqrt(2 * 4 + 1)).to(dtype)
    torch.testing.assert_close(out, expected, atol=0 if dtype == torch.float32 else 1e-2, rtol=1e-6)


def test_dynamic_conv_refuses_a_state_of_another_width_or_heads_off_the_channels():
    x, static, dynamic = _dynamic_inputs(torch.float32)
    with pytest.raises(ValueError, match="holds 3 inputs"):
        dynamic_conv_invariant(x, static, dynamic, torch.zeros(3, 24, 3))
    with pytest.raises(ValueError, match="multiple of the heads"):
        dynamic_conv_invariant(x, static[:, :23], dynamic)


@DTYPES3
@pytest.mark.parametrize("window", [None, 24, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_attention_with_sinks_gives_a_query_its_bits_in_any_call(dtype, window, with_bias):
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, heads, 70, 16, generator=gen).to(dtype) for heads in (4, 2, 2))
    sinks = torch.randn(1, 4, 70, generator=gen).to(dtype)
    bias = torch.randn(1, 4, 70, 70, generator=gen).to(dtype) if with_bias else None
    full = attention_invariant(q, k, v, causal_visible(70, 70, window=window), 0.25, window=window, bias=bias,
                               sinks=sinks)
    for p in (0, 23, 24, 31, 32, 33, 69):
        first = 0 if window is None else max(0, p + 1 - window)
        step = attention_invariant(q[:, :, p : p + 1], k[:, :, first : p + 1], v[:, :, first : p + 1],
                                   causal_visible(1, p + 1 - first), 0.25, window=window,
                                   bias=None if bias is None else bias[:, :, p : p + 1, first : p + 1],
                                   sinks=sinks[:, :, p : p + 1])
        chunk = attention_invariant(q[:, :, p:], k, v, causal_visible(70 - p, 70, window=window), 0.25,
                                    window=window, bias=None if bias is None else bias[:, :, p:],
                                    sinks=sinks[:, :, p:])
        assert torch.equal(step[:, :, 0], full[:, :, p]) and torch.equal(chunk[:, :, 0], full[:, :, p]), p


@pytest.mark.parametrize("window", [None, 5, 24])
def test_attention_with_sinks_is_upstreams_eager_attention_within_round_off(window):
    """Upstream's eager attention appends the sink as a last logit with no value; the invariant attention merges it
    first. A padded row's queries and a query that sees few keys (most of its mass on the sink) included."""
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(2, heads, 50, 16, generator=gen) for heads in (4, 2, 2))
    sinks = 3 * torch.randn(2, 4, 50, generator=gen)
    bias = torch.randn(2, 4, 50, 50, generator=gen)
    visible = causal_visible(50, 50, window=window)
    visible = visible & torch.tensor([[True] * 50, [False] * 9 + [True] * 41])[:, None, None, :]
    out = attention_invariant(q, k, v, visible, 0.25, window=window, bias=bias, sinks=sinks)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.25 + bias
    scores = torch.cat([scores.masked_fill(~visible, float("-inf")), sinks[..., None]], -1)
    expected = torch.softmax(scores, -1)[..., :-1] @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out[1, :, 9:], expected[1, :, 9:], atol=2e-6, rtol=0)
    torch.testing.assert_close(out[0], expected[0], atol=2e-6, rtol=0)
    # Without the sink the same call is plain softmax attention, which differs from upstream's here.
    plain = attention_invariant(q, k, v, visible, 0.25, window=window, bias=bias)
    assert not torch.allclose(plain[0], expected[0], atol=1e-3)


@DTYPES3
def test_softcapped_swiglu_and_l2_clip_give_an_element_its_bits_at_any_offset(dtype):
    """An element (a head vector, for the clip) alone, at every offset of a longer tensor and among other rows: the
    same bits."""
    gen = torch.Generator().manual_seed(17)
    gate, up = ((4 * torch.randn(3, 37, 40, generator=gen)).to(dtype) for _ in range(2))
    full = softcapped_swiglu_invariant(gate, up, 3.0, 5.0)
    flat_gate, flat_up = gate.reshape(-1), up.reshape(-1)
    flat = full.reshape(-1)
    for start in range(0, flat.shape[0] - 20, 13):
        part = softcapped_swiglu_invariant(flat_gate[start:], flat_up[start:], 3.0, 5.0)
        alone = softcapped_swiglu_invariant(flat_gate[start : start + 1], flat_up[start : start + 1], 3.0, 5.0)
        assert torch.equal(part[:1], flat[start : start + 1]) and torch.equal(alone, flat[start : start + 1]), start
    heads = (3 * torch.randn(5, 29, 4, 24, generator=gen)).to(dtype)
    scale = torch.rand(4, 24, generator=gen) + 0.5
    clipped = l2_clip_invariant(heads, 2.0, scale)
    for row in range(5):
        for t in (0, 7, 28):
            assert torch.equal(l2_clip_invariant(heads[row, t : t + 1], 2.0, scale), clipped[row, t : t + 1])
        assert torch.equal(l2_clip_invariant(heads[row : row + 1, 3:], 2.0, scale), clipped[row : row + 1, 3:])


def test_softcapped_swiglu_and_l2_clip_are_upstreams_within_round_off():
    modeling = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
    gen = torch.Generator().manual_seed(19)
    gate, up = 6 * torch.randn(4, 50, generator=gen), 6 * torch.randn(4, 50, generator=gen)
    config = type("Config", (), {"mlp_gate_softcap": 3.0, "mlp_up_softcap": 5.0})()
    expected = modeling.Inkling2SoftcappedSwiGLU(config)(gate, up)
    torch.testing.assert_close(softcapped_swiglu_invariant(gate, up, 3.0, 5.0), expected, atol=3e-6, rtol=1e-6)
    heads = 3 * torch.randn(2, 9, 4, 24, generator=gen)
    torch.testing.assert_close(l2_clip_invariant(heads, 2.0), modeling.Inkling2L2Clip(2.0)(heads), atol=1e-6, rtol=1e-6)
    scaled = modeling.Inkling2ScaledL2Clip(4, 24, 2.0)
    with torch.no_grad():
        scaled.scale.uniform_(0.5, 1.5)
        torch.testing.assert_close(l2_clip_invariant(heads, 2.0, scaled.scale), scaled(heads), atol=1e-6, rtol=1e-6)


@DTYPES3
def test_block_residual_gives_a_position_its_bits_in_any_call(dtype):
    """A position's block residual alone, in a chunk from any offset and as a row among others: the same bits; and
    the scaled-dot-product attention upstream runs (positions as heads) within round-off."""
    gen = torch.Generator().manual_seed(23)
    stacked = torch.randn(3, 41, 5, 48, generator=gen).to(dtype).float()
    query = torch.randn(3, 48, generator=gen)
    full = block_residual_invariant(query, stacked, 48**-0.5)
    for t in (0, 1, 17, 40):
        assert torch.equal(block_residual_invariant(query, stacked[:, t : t + 1], 48**-0.5), full[:, t : t + 1])
        assert torch.equal(block_residual_invariant(query, stacked[:, t:], 48**-0.5), full[:, t:])
    for row in range(3):
        assert torch.equal(block_residual_invariant(query, stacked[row : row + 1], 48**-0.5), full[row : row + 1])
    expected = torch.nn.functional.scaled_dot_product_attention(query.expand(3, 41, 3, 48), stacked, stacked,
                                                                scale=48**-0.5)
    torch.testing.assert_close(full, expected, atol=2e-6, rtol=1e-6)
