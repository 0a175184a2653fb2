"""deterministic=True on LFM3 (``lfm3``) and Inkling (``inkling_text``, dense MLPs), issue 46.

LFM3: LFM2's short-conv layers (``in_proj -> B, C, x``, a depthwise causal conv of 3 over ``B * x``, gated by ``C``)
around a sliding-window attention layer (window of 24 tokens, shorter than the prompts) and a full one, both with q/k
RMSNorms, rotary embeddings in float32 and a sigmoid output gate per head (``g_proj``), sandwich norms and SwiGLU
MLPs; the toy with widths off the CPU's vector width and every bias on (test_deterministic.py's ``OVERRIDES``: an MLP
of 104, 3 attention heads of 16 over one key head, ``conv_bias`` and ``attention_bias`` with the biases drawn from a
seed). Inkling: attention (sliding, window 24, and full) with relative logits and four float32 short convs per layer,
dense MLPs of 104 and ``log_scaling_n_floor=8``. For each, a request's tokens and logits / logprobs are the same bits
cold and after hits of several lengths, with a reply replayed in a chat, decoded or prefilled, as a row of a
left-padded generate() batch, and among 1-8 concurrent engine requests at prefill chunks of 16, 48 and 512 tokens
(and in speculative verify groups) against generate() alone; float32 and bfloat16 throughout, float16 for hits,
decode, the padded batch and the engine.

Power (each ingredient switched off alone through the private ``_OFF`` sets; measured on the 2-core AVX-512 CPU,
torch 2.13 with MKL, at 2 intra-op threads; docs/deterministic.md has the tables): LFM3's new ingredients, the
invariant attention's window anchored at the query (``hybrid_deterministic`` ``"window"``: anchored at position 0, a
query's keys move once the sliding cache layer drops the keys before its window) and the head gate's sigmoid
(``short_conv_deterministic`` ``"gate"``), and Inkling's, its convs' invariant conv and contiguous output, the window,
each make some case differ, as do the ingredients they share with LFM2 (the power tables below).
"""

import pytest
import test_deterministic
import torch
from deterministic_bank import (
    chat_with_the_reply_replayed,
    checkpoints_hold_upstream_states,
    decode_vs_prefill_case,
    engine_case,
    engine_requests_equal_generate_alone,
    hits_equal_cold,
    identical_prompt_and_decoded_tokens,
    ingredient_off_breaks,
    mode_is_the_model,
    mode_off_some_case_differs,
    padded_batch_rows_equal_each_alone,
    speculative_case,
)
from test_deterministic import OVERRIDES
from test_deterministic_conv import build_with_biases

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.kernels.attention_invariant import attention_invariant, causal_visible
from hf_hybridcache.models import (
    hybrid_deterministic,
    inkling_deterministic,
    mamba1_deterministic,
    short_conv_deterministic,
)
from hf_hybridcache.toy import build_model

LFM3 = "lfm3"
INKLING = "inkling_text"
DTYPES3 = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    return request.param


@pytest.fixture(autouse=True)
def biases(monkeypatch):
    monkeypatch.setattr(test_deterministic, "build_model", build_with_biases)


@DTYPES3
@pytest.mark.parametrize("window", [None, 24, 40])
def test_attention_with_a_bias_gives_a_query_its_bits_in_any_call(dtype, window):
    """A score bias (Inkling's relative logits) laid out with the keys: a decode step over the keys a cache layer
    keeps (a sliding layer's window) and a prefill chunk give a query its bits in one prefill."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, heads, 70, 16, generator=gen).to(dtype) for heads in (4, 2, 2))
    bias = torch.randn(1, 4, 70, 70, generator=gen).to(dtype)
    full = attention_invariant(q, k, v, causal_visible(70, 70, window=window), 0.25, window=window, bias=bias)
    for p in (0, 23, 24, 31, 32, 33, 69):
        first = 0 if window is None else max(0, p + 1 - window)
        step = attention_invariant(q[:, :, p : p + 1], k[:, :, first : p + 1], v[:, :, first : p + 1],
                                   causal_visible(1, p + 1 - first), 0.25, window=window,
                                   bias=bias[:, :, p : p + 1, first : p + 1])
        chunk = attention_invariant(q[:, :, p:], k, v, causal_visible(70 - p, 70, window=window), 0.25,
                                    window=window, bias=bias[:, :, p:])
        assert torch.equal(step[:, :, 0], full[:, :, p]) and torch.equal(chunk[:, :, 0], full[:, :, p]), p


@pytest.mark.parametrize("window", [None, 5, 24, 40])
def test_attention_with_a_bias_is_sdpa_within_round_off(window):
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, heads, 70, 16, generator=gen) for heads in (4, 2, 2))
    bias = torch.randn(2, 4, 70, 70, generator=gen)
    visible = causal_visible(70, 70, window=window)
    visible = visible & torch.tensor([[True] * 70, [False] * 9 + [True] * 61])[:, None, None, :]  # a padded row
    out = attention_invariant(q, k, v, visible, 0.25, window=window, bias=bias)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=bias.masked_fill(~visible, float("-inf")),
        scale=0.25)
    torch.testing.assert_close(out[1, :, 9:], expected[1, :, 9:], atol=2e-6, rtol=0)
    torch.testing.assert_close(out[0], expected[0], atol=2e-6, rtol=0)


@DTYPES3
@pytest.mark.parametrize("length", [17, 40, 64, 89])
def test_lfm3_hits_equal_cold_bit_for_bit(dtype, length):
    hits_equal_cold(LFM3, dtype, length)


@DTYPES3
def test_lfm3_identical_prompt_decoded_tokens_and_padded_rows_equal_cold(dtype):
    identical_prompt_and_decoded_tokens(LFM3, dtype)
    padded_batch_rows_equal_each_alone(LFM3, dtype)


def test_lfm3_chat_turns_with_the_reply_replayed_equal_cold(dtype):
    chat_with_the_reply_replayed(LFM3, dtype, turns=2)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_lfm3_engine_requests_equal_generate_alone_in_any_batch(dtype, max_batch_tokens):
    """The engine's tokens and logprobs for 1, 3 and 8 concurrent requests (two of them hit each other's prefix)
    equal each one alone in generate()."""
    engine_requests_equal_generate_alone(LFM3, dtype, max_batch_tokens)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_lfm3_engine_in_float16_equals_generate_alone(max_batch_tokens):
    assert engine_case(LFM3, torch.float16, max_batch_tokens=max_batch_tokens)


def test_lfm3_speculative_verify_groups_equal_generate_alone(dtype):
    speculative_case(LFM3, dtype)


def test_lfm3_mode_is_the_model_within_round_off():
    """Over 60 tokens, past the window: a mistake in a window, a gate, the conv or the MLP would move the logits by far
    more than round-off."""
    mode_is_the_model(LFM3, prompt_tokens=60)


#: (module, ingredient, dtype, a case it breaks when switched off alone), measured at 2 threads.
POWER = [
    (hybrid_deterministic, "window", torch.float32, engine_case),
    (short_conv_deterministic, "gate", torch.float32, engine_case),
    (hybrid_deterministic, "attention", torch.float32, engine_case),
    (hybrid_deterministic, "activation", torch.float32, decode_vs_prefill_case),
    (short_conv_deterministic, "linear", torch.float32, engine_case),
    (short_conv_deterministic, "conv", torch.float32, decode_vs_prefill_case),
]


@pytest.mark.parametrize("module, off, dtype, case", POWER,
                         ids=[f"{off}-{str(dtype)[6:]}-{case.__name__}" for _, off, dtype, case in POWER])
def test_lfm3_each_ingredient_off_alone_breaks_a_case(monkeypatch, module, off, dtype, case):
    torch.set_num_threads(2)  # MKL's float32 1-row product sums in another order at 2 threads (the suite runs 1)
    ingredient_off_breaks(monkeypatch, module, off, case, LFM3, dtype)


def test_lfm3_with_the_mode_off_some_case_differs():
    mode_off_some_case_differs(LFM3, torch.float32)


def test_lfm3_layers_it_cannot_hold_for_are_refused():
    model = build_model(LFM3, seed=0, attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="(?s)attn_implementation='flex_attention'.*deterministic=False"):
        HybridPrefixCache(model, deterministic=True)
    HybridPrefixCache(model)  # nothing was patched: the default mode still builds


@DTYPES3
@pytest.mark.parametrize("length", [17, 40, 64, 89])
def test_inkling_hits_equal_cold_bit_for_bit(dtype, length):
    hits_equal_cold(INKLING, dtype, length)


@DTYPES3
def test_inkling_identical_prompt_decoded_tokens_and_padded_rows_equal_cold(dtype, monkeypatch):
    identical_prompt_and_decoded_tokens(INKLING, dtype)
    # The padded rows without the logarithmic query scaling: upstream scales a query by its position in the cache
    # (``get_query_offset``), which counts a left-padded row's padding, so with the scaling on a padded row is another
    # computation than the prompt alone (in exact arithmetic too).
    monkeypatch.setitem(OVERRIDES, INKLING, dict(OVERRIDES[INKLING], log_scaling_n_floor=None))
    padded_batch_rows_equal_each_alone(INKLING, dtype)


def test_inkling_chat_turns_with_the_reply_replayed_equal_cold(dtype):
    chat_with_the_reply_replayed(INKLING, dtype, turns=2)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_inkling_engine_requests_equal_generate_alone_in_any_batch(dtype, max_batch_tokens):
    engine_requests_equal_generate_alone(INKLING, dtype, max_batch_tokens)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_inkling_engine_in_float16_equals_generate_alone(max_batch_tokens):
    assert engine_case(INKLING, torch.float16, max_batch_tokens=max_batch_tokens)


def test_inkling_speculative_verify_groups_equal_generate_alone(dtype):
    speculative_case(INKLING, dtype)


def test_inkling_mode_is_the_model_within_round_off():
    mode_is_the_model(INKLING, prompt_tokens=60)


def test_inkling_checkpoints_hold_the_states_of_an_upstream_cold_forward():
    """The four windows of every layer and the convolved keys and values at a block boundary equal an unpatched
    model's within round-off."""
    checkpoints_hold_upstream_states(INKLING)


#: Inkling's ingredients (module, ingredient, dtype, case), measured at 2 threads.
INKLING_POWER = [
    (hybrid_deterministic, "window", torch.float32, engine_case),
    (inkling_deterministic, "contiguous", torch.float32, decode_vs_prefill_case),
    (inkling_deterministic, "conv", torch.float32, decode_vs_prefill_case),
    (hybrid_deterministic, "attention", torch.float32, engine_case),
    (hybrid_deterministic, "activation", torch.float32, engine_case),
    (mamba1_deterministic, "linear", torch.float32, engine_case),
]


@pytest.mark.parametrize("module, off, dtype, case", INKLING_POWER,
                         ids=[f"{off}-{str(dtype)[6:]}-{case.__name__}" for _, off, dtype, case in INKLING_POWER])
def test_inkling_each_ingredient_off_alone_breaks_a_case(monkeypatch, module, off, dtype, case):
    torch.set_num_threads(2)
    ingredient_off_breaks(monkeypatch, module, off, case, INKLING, dtype)


def test_inkling_with_the_mode_off_some_case_differs():
    mode_off_some_case_differs(INKLING, torch.float32)
