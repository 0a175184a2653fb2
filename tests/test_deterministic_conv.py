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
from conftest import assert_restored_states_match
from engine_scenarios import ids
from test_deterministic import (
    BASE,
    GREEDY,
    OVERRIDES,
    PROMPTS,
    cold,
    decode_vs_prefill_case,
    engine_case,
    fresh,
    hit_case,
    run,
    speculative_case,
)

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
    model, cache = fresh(FAMILY, dtype)
    run(model, cache, BASE)
    prompt = BASE[:length] + ids(7, seed=4601)
    tokens, logits = run(model, cache, prompt)
    assert cache.last_hit_tokens == [min(length, 80) // 16 * 16]
    ref_tokens, ref_logits = cold(FAMILY, dtype, prompt)
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)


@DTYPES3
def test_identical_prompt_and_decoded_tokens_equal_cold_and_prefilled(dtype):
    assert hit_case(FAMILY, dtype)
    assert decode_vs_prefill_case(FAMILY, dtype)


def test_without_biases_hits_and_decoded_tokens_equal_cold_and_prefilled(monkeypatch, dtype):
    """``conv_bias=False`` (upstream's default, LFM2's checkpoints): no bias on the conv and the projections."""
    monkeypatch.setitem(OVERRIDES, FAMILY, {**OVERRIDES[FAMILY], "conv_bias": False})
    model, _ = fresh(FAMILY, dtype)
    assert model.model.layers[0].conv.conv.bias is None and model.model.layers[0].conv.in_proj.bias is None
    assert hit_case(FAMILY, dtype)
    assert decode_vs_prefill_case(FAMILY, dtype)


def test_chat_turns_with_the_reply_replayed_equal_cold(dtype):
    model, cache = fresh(FAMILY, dtype, replay_replies=True)
    turn = BASE[:50]
    for n in range(2):
        reply, _ = run(model, cache, turn, new_tokens=9)
        turn = turn + reply + ids(5, seed=4630 + n)
        tokens, logits = run(model, cache, turn)
        assert cache.last_hit_tokens[0] >= len(turn) - 5 - 9 - 16
        ref_tokens, ref_logits = cold(FAMILY, dtype, turn)
        assert tokens == ref_tokens and torch.equal(logits, ref_logits), f"turn {n + 2}"


@DTYPES3
def test_padded_generate_batch_rows_equal_each_alone(dtype):
    """Left padding: a padded row's conv inputs are zero until its first token, its keys re-anchor there."""
    prompts = [PROMPTS[i] for i in (3, 1, 6)]
    width = max(map(len, prompts))
    batch = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    model, cache = fresh(FAMILY, dtype)
    with torch.no_grad():
        out = model.generate(batch, attention_mask=(batch != 0).long(), past_key_values=cache, max_new_tokens=5,
                             min_new_tokens=5, output_logits=True, return_dict_in_generate=True, **GREEDY)
    for row, prompt in enumerate(prompts):
        tokens, logits = cold(FAMILY, dtype, prompt, 5)
        assert out.sequences[row, width:].tolist() == tokens
        assert torch.equal(torch.stack([step[row] for step in out.logits]), logits), f"row {row}"


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_requests_equal_generate_alone_in_any_batch(dtype, max_batch_tokens):
    """The engine's tokens and logprobs for 1, 3 and 8 concurrent requests (two of them hit each other's prefix)
    equal each one alone in generate()."""
    for prompts in (PROMPTS[:1], PROMPTS[2:5], PROMPTS):
        assert engine_case(FAMILY, dtype, prompts, max_batch_tokens), f"{len(prompts)} requests"


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_in_float16_equals_generate_alone(max_batch_tokens):
    assert engine_case(FAMILY, torch.float16, PROMPTS, max_batch_tokens)


def test_engine_at_two_threads_equals_generate_alone():
    torch.set_num_threads(2)
    assert engine_case(FAMILY, torch.float32, PROMPTS, 48)


def test_speculative_verify_groups_equal_generate_alone(dtype):
    speculative_case(FAMILY, dtype)


def test_the_mode_is_the_model_within_round_off():
    """The deterministic forward computes the model: its float32 logits are a plain forward's within round-off (a
    mistake in the gates, the conv's window or bias, or the MLP would move them by far more)."""
    model, cache = fresh(FAMILY, torch.float32)
    plain = build_with_biases(FAMILY, seed=0, **OVERRIDES[FAMILY])
    _, logits = run(model, cache, BASE[:40], new_tokens=1)
    with torch.no_grad():
        expected = plain(torch.tensor([BASE[:40]])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


def test_checkpoints_hold_the_states_of_an_upstream_cold_forward():
    """What the mode stores is what the default path stores: the conv window of ``B * x`` at a block boundary
    equals an unpatched model's within round-off."""
    model, cache = fresh(FAMILY, torch.float32)
    run(model, cache, BASE)
    plain = build_with_biases(FAMILY, seed=0, **OVERRIDES[FAMILY])
    assert_restored_states_match(cache, plain, torch.tensor([BASE[:70]]), expected_hit=64)


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
    assert case(FAMILY, dtype)
    monkeypatch.setattr(module, "_OFF", {off})
    assert not case(FAMILY, dtype)


def test_with_the_mode_off_some_case_differs():
    """float32: a decoded token and the engine's logprobs; float16: a left-padded generate() row."""
    cases = (decode_vs_prefill_case, engine_case, hit_case)
    assert not all(case(FAMILY, torch.float32, deterministic=False) for case in cases)
    prompts = [PROMPTS[i] for i in (3, 1, 6)]
    width = max(map(len, prompts))
    batch = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    model, cache = fresh(FAMILY, torch.float16, deterministic=False)
    with torch.no_grad():
        out = model.generate(batch, attention_mask=(batch != 0).long(), past_key_values=cache, max_new_tokens=5,
                             min_new_tokens=5, output_logits=True, return_dict_in_generate=True, **GREEDY)
    rows = [torch.equal(torch.stack([step[row] for step in out.logits]),
                        cold(FAMILY, torch.float16, prompt, 5, deterministic=False)[1])
            for row, prompt in enumerate(prompts)]
    assert not all(rows)


def test_layers_it_cannot_hold_for_are_refused():
    model = build_model(FAMILY, seed=0, attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="(?s)attn_implementation='flex_attention'.*deterministic=False"):
        HybridPrefixCache(model, deterministic=True)
    HybridPrefixCache(model)  # nothing was patched: the default mode still builds
    with pytest.raises(ValueError, match="(?s)short convs wired to the invariant conv.*deterministic=False"):
        HybridPrefixCache(build_model("inkling2_text", seed=0), deterministic=True)


@DTYPES3
def test_moe_hit_and_decoded_tokens_equal_cold_and_prefilled(dtype):
    """LFM2-MoE (a dense first layer, then 4 routed experts of 56, top 2, behind a sigmoid router with a seeded
    ``expert_bias``)."""
    assert hit_case(MOE, dtype)
    assert decode_vs_prefill_case(MOE, dtype)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_moe_engine_requests_equal_generate_alone(dtype, max_batch_tokens):
    assert engine_case(MOE, dtype, PROMPTS, max_batch_tokens)


def test_moe_mode_is_the_model_within_round_off():
    model, cache = fresh(MOE, torch.float32)
    plain = build_with_biases(MOE, seed=0, **OVERRIDES[MOE])
    _, logits = run(model, cache, BASE[:40], new_tokens=1)
    with torch.no_grad():
        expected = plain(torch.tensor([BASE[:40]])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


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
    assert case(MOE, dtype)
    monkeypatch.setattr(module, "_OFF", {off})
    assert not case(MOE, dtype)


def test_moe_with_the_mode_off_some_case_differs(dtype):
    cases = (decode_vs_prefill_case, engine_case, hit_case)
    assert not all(case(MOE, dtype, deterministic=False) for case in cases)
