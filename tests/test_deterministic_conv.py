"""deterministic=True on LFM2 (``lfm2``, issue 46): short-conv layers (``in_proj -> B, C, x``, a depthwise causal conv
of 3 over ``B * x``, gated by ``C``) around a full-attention layer with q/k RMSNorms, SwiGLU MLPs; the toy with
widths off the CPU's vector width and every bias on (test_deterministic.py's ``OVERRIDES``: an MLP of 104, 3
attention heads of 16 over one key head, ``conv_bias=True`` with the biases drawn from a seed). A request's tokens
and logits / logprobs are the same bits cold and after hits of several lengths, with a reply replayed in a chat,
decoded or prefilled, as a row of a left-padded generate() batch, and among 1-8 concurrent engine requests at prefill
chunks of 16, 48 and 512 tokens (and in speculative verify groups) against generate() alone; float32 and bfloat16
throughout, float16 for hits, decode and the engine. LFM2-MoE (``lfm2_moe``: the same mixer and attention, a dense
first MLP, then routed experts behind a sigmoid router with ``expert_bias``) for hits, decode, the engine at
16/48/512 and power.

Power (each ingredient switched off alone through the private ``short_conv_deterministic._OFF`` or
``hybrid_deterministic._OFF``; measured on the 2-core AVX-512 CPU, torch 2.13 with MKL, at 2 intra-op threads;
docs/deterministic.md has the table): the row-invariant linear, the invariant conv, the invariant attention and the
MLP's SiLU each make some float32 case differ, the conv also in bfloat16. With the mode off, float32's decoded token
and engine differ, float16's padded batch does; bfloat16's bank happens to agree with the mode off on this CPU (the
conv has no activation, and the default conv update gives a decoded token its prefill's bits there), so the bfloat16
power is the conv ingredient's alone. On LFM2-MoE the router's sigmoid moves the float32 engine case, the MLPs' SiLU
a float32 decoded token, and the mode off every float32 case and the bfloat16 / float16 engine.
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
    fresh,
    hits_equal_cold,
    identical_prompt_and_decoded_tokens,
    ingredient_off_breaks,
    mode_is_the_model,
    mode_off_some_case_differs,
    padded_batch_rows,
    padded_batch_rows_equal_each_alone,
    speculative_case,
)
from test_deterministic import OVERRIDES

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.models import hybrid_deterministic, short_conv_deterministic
from hf_hybridcache.toy import build_model

FAMILY = "lfm2"
MOE = "lfm2_moe"
DTYPES3 = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    return request.param


def build_with_biases(family, **kwargs):
    """The toy with its biases (LFM2's init leaves them zero) drawn from a fixed seed, so that a bias dropped or
    added twice moves the logits."""
    model = build_model(family, **kwargs)
    generator = torch.Generator().manual_seed(4651)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):  # LFM2-MoE's routing bias (float32, zeros at init)
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.2)
    return model


@pytest.fixture(autouse=True)
def biases(monkeypatch):
    monkeypatch.setattr(test_deterministic, "build_model", build_with_biases)


@DTYPES3
@pytest.mark.parametrize("length", [17, 64, 89])
def test_hits_equal_cold_bit_for_bit(dtype, length):
    hits_equal_cold(FAMILY, dtype, length)


@DTYPES3
def test_identical_prompt_and_decoded_tokens_equal_cold_and_prefilled(dtype):
    identical_prompt_and_decoded_tokens(FAMILY, dtype)


def test_without_biases_hits_and_decoded_tokens_equal_cold_and_prefilled(monkeypatch, dtype):
    """``conv_bias=False`` (upstream's default, LFM2's checkpoints): no bias on the conv and the projections."""
    monkeypatch.setitem(OVERRIDES, FAMILY, {**OVERRIDES[FAMILY], "conv_bias": False})
    model, _ = fresh(FAMILY, dtype)
    assert model.model.layers[0].conv.conv.bias is None and model.model.layers[0].conv.in_proj.bias is None
    identical_prompt_and_decoded_tokens(FAMILY, dtype)


def test_chat_turns_with_the_reply_replayed_equal_cold(dtype):
    chat_with_the_reply_replayed(FAMILY, dtype, turns=2)


@DTYPES3
def test_padded_generate_batch_rows_equal_each_alone(dtype):
    """Left padding: a padded row's conv inputs are zero until its first token, its keys re-anchor there."""
    padded_batch_rows_equal_each_alone(FAMILY, dtype)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_requests_equal_generate_alone_in_any_batch(dtype, max_batch_tokens):
    engine_requests_equal_generate_alone(FAMILY, dtype, max_batch_tokens)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_in_float16_equals_generate_alone(max_batch_tokens):
    assert engine_case(FAMILY, torch.float16, max_batch_tokens=max_batch_tokens)


def test_engine_at_two_threads_equals_generate_alone():
    torch.set_num_threads(2)
    assert engine_case(FAMILY, torch.float32)


def test_speculative_verify_groups_equal_generate_alone(dtype):
    speculative_case(FAMILY, dtype)


def test_the_mode_is_the_model_within_round_off():
    """Within round-off of a plain forward: a mistake in the gates, the conv's window or bias, or the MLP would move
    the logits by far more."""
    mode_is_the_model(FAMILY)


def test_checkpoints_hold_the_states_of_an_upstream_cold_forward():
    """The conv window of ``B * x`` at a block boundary equals an unpatched model's within round-off."""
    checkpoints_hold_upstream_states(FAMILY)


#: (module, ingredient, dtype, a case it breaks when switched off alone), measured at 2 threads.
POWER = [
    (short_conv_deterministic, "linear", torch.float32, engine_case),
    (short_conv_deterministic, "conv", torch.float32, decode_vs_prefill_case),
    (short_conv_deterministic, "conv", torch.bfloat16, decode_vs_prefill_case),
    (hybrid_deterministic, "attention", torch.float32, engine_case),
    (hybrid_deterministic, "activation", torch.float32, decode_vs_prefill_case),
]


@pytest.mark.parametrize("module, off, dtype, case", POWER,
                         ids=[f"{off}-{str(dtype)[6:]}-{case.__name__}" for _, off, dtype, case in POWER])
def test_each_ingredient_off_alone_breaks_a_case(monkeypatch, module, off, dtype, case):
    torch.set_num_threads(2)  # MKL's float32 1-row product sums in another order at 2 threads (the suite runs 1)
    ingredient_off_breaks(monkeypatch, module, off, case, FAMILY, dtype)


def test_with_the_mode_off_some_case_differs():
    """float32: a decoded token and the engine's logprobs; float16: a left-padded generate() row."""
    mode_off_some_case_differs(FAMILY, torch.float32)
    assert not all(padded_batch_rows(FAMILY, torch.float16, deterministic=False))


def test_layers_it_cannot_hold_for_are_refused():
    model = build_model(FAMILY, seed=0, attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="(?s)attn_implementation='flex_attention'.*deterministic=False"):
        HybridPrefixCache(model, deterministic=True)
    HybridPrefixCache(model)  # nothing was patched: the default mode still builds


@DTYPES3
def test_moe_hit_and_decoded_tokens_equal_cold_and_prefilled(dtype):
    """LFM2-MoE (a dense first layer, then 4 routed experts of 56, top 2, behind a sigmoid router with a seeded
    ``expert_bias``)."""
    identical_prompt_and_decoded_tokens(MOE, dtype)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_moe_engine_requests_equal_generate_alone(dtype, max_batch_tokens):
    assert engine_case(MOE, dtype, max_batch_tokens=max_batch_tokens)


def test_moe_mode_is_the_model_within_round_off():
    mode_is_the_model(MOE)


#: LFM2-MoE's own ingredients (module, ingredient, dtype, case), measured at 2 threads: the router's sigmoid, and the
#: SiLU of the dense MLP and the experts together (the experts' alone, at their width of 56, moves no case here).
MOE_POWER = [
    (hybrid_deterministic, "gate", torch.float32, engine_case),
    (hybrid_deterministic, "activation", torch.float32, decode_vs_prefill_case),
]


@pytest.mark.parametrize("module, off, dtype, case", MOE_POWER,
                         ids=[f"{off}-{str(dtype)[6:]}-{case.__name__}" for _, off, dtype, case in MOE_POWER])
def test_moe_each_ingredient_off_alone_breaks_a_case(monkeypatch, module, off, dtype, case):
    torch.set_num_threads(2)
    ingredient_off_breaks(monkeypatch, module, off, case, MOE, dtype)


def test_moe_with_the_mode_off_some_case_differs(dtype):
    mode_off_some_case_differs(MOE, dtype)
