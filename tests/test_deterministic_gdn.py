"""deterministic=True on Qwen3.5's text models (``qwen3_5_text``, issue 46; ``qwen3_5_moe_text`` and ``qwen3_next`` for
hits, decode and the engine): gated delta net layers around a gated full-attention layer, dense MLPs (routed + shared
experts); the long-memory toy with widths off the CPU's vector width (test_deterministic.py's ``OVERRIDES``: an MLP
of 104, 3 attention heads, value heads of 20 over grouped key heads). A request's tokens and logits / logprobs are
the same bits cold and after hits of several lengths, with a reply replayed in a chat, decoded or prefilled, as a row
of a left-padded generate() batch, and among 1-8 concurrent engine requests at prefill chunks of 16, 48 and 512
tokens (and in speculative verify groups) against generate() alone; float32 and bfloat16 throughout, float16 for
hits, decode and the engine.

Power (each ingredient switched off alone through the private ``gated_delta_deterministic._OFF`` or
``hybrid_deterministic._OFF``; measured on the 2-core AVX-512 CPU, torch 2.13 with MKL, at 2 intra-op threads;
docs/deterministic.md has the table): the row-invariant linear, the invariant conv, the per-token rule, the gated
RMSNorm's SiLU, the sigmoid / softplus gates, the invariant attention, the MLP's SiLU and the attention's output gate
each make some float32 case differ (:data:`POWER` names one per ingredient; the rule also in float16, the conv and
the attention in every dtype); on Qwen3.5-MoE the shared expert's sigmoid gate and the experts' SiLU too.
"""

import pytest
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
    engine_outputs,
    fresh,
    hit_case,
    run,
    speculative_case,
)

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.models import gated_delta_deterministic, hybrid_deterministic
from hf_hybridcache.toy import build_model
from hf_hybridcache.toy.vision import build_vlm

FAMILY = "qwen3_5_text"
MOE = "qwen3_5_moe_text"
NEXT = "qwen3_next"
DTYPES3 = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    return request.param


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


def test_padded_generate_batch_rows_equal_each_alone(dtype):
    """Left padding: a padded row's recurrent state stays zero until its first token, its keys re-anchor there."""
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


def test_engine_requests_hit_each_others_prefix():
    outputs = engine_outputs(FAMILY, torch.bfloat16, PROMPTS, 48)
    assert sorted(o.hit_tokens for o in outputs[:2]) == [0, 32]


def test_speculative_verify_groups_equal_generate_alone(dtype):
    speculative_case(FAMILY, dtype)


def test_the_mode_is_the_model_within_round_off():
    """The deterministic forward computes the model: its float32 logits are a plain forward's within round-off (a
    mistake in the gates, the rule, the norm or the attention's gate would move them by far more)."""
    model, cache = fresh(FAMILY, torch.float32)
    plain = build_model(FAMILY, seed=0, **OVERRIDES[FAMILY])
    _, logits = run(model, cache, BASE[:40], new_tokens=1)
    with torch.no_grad():
        expected = plain(torch.tensor([BASE[:40]])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


def test_checkpoints_hold_the_states_of_an_upstream_cold_forward():
    """What the mode stores is what the default path stores: the conv window and the float32 state
    ``[Hv, Dk, Dv]`` at a block boundary equal an unpatched model's (transformers' chunked rule) within round-off."""
    model, cache = fresh(FAMILY, torch.float32)
    run(model, cache, BASE)
    plain = build_model(FAMILY, seed=0, **OVERRIDES[FAMILY])
    assert_restored_states_match(cache, plain, torch.tensor([BASE[:70]]), expected_hit=64)


@pytest.fixture(params=[MOE, NEXT])
def moe_family(request):
    return request.param


@DTYPES3
def test_moe_hit_and_decoded_tokens_equal_cold_and_prefilled(moe_family, dtype):
    """Qwen3.5-MoE and Qwen3-Next (4 routed experts of 56, top 2, a shared expert of 104 behind its sigmoid gate;
    Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba``)."""
    assert hit_case(moe_family, dtype)
    assert decode_vs_prefill_case(moe_family, dtype)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_moe_engine_requests_equal_generate_alone(moe_family, dtype, max_batch_tokens):
    assert engine_case(moe_family, dtype, PROMPTS, max_batch_tokens)


def test_moe_mode_is_the_model_within_round_off(moe_family):
    model, cache = fresh(moe_family, torch.float32)
    plain = build_model(moe_family, seed=0, **OVERRIDES[moe_family])
    _, logits = run(model, cache, BASE[:40], new_tokens=1)
    with torch.no_grad():
        expected = plain(torch.tensor([BASE[:40]])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


#: (family, module, ingredient, dtype, a case it breaks when switched off alone), measured at 2 threads.
POWER = [
    (FAMILY, gated_delta_deterministic, "linear", torch.float32, hit_case),
    (FAMILY, gated_delta_deterministic, "conv", torch.bfloat16, decode_vs_prefill_case),
    (FAMILY, gated_delta_deterministic, "rule", torch.float32, hit_case),
    (FAMILY, gated_delta_deterministic, "rule", torch.float16, engine_case),
    (FAMILY, gated_delta_deterministic, "norm", torch.float32, engine_case),
    (FAMILY, gated_delta_deterministic, "gates", torch.float32, engine_case),
    (FAMILY, hybrid_deterministic, "attention", torch.bfloat16, engine_case),
    (FAMILY, hybrid_deterministic, "activation", torch.float32, decode_vs_prefill_case),
    (FAMILY, hybrid_deterministic, "gate", torch.float32, decode_vs_prefill_case),
    (MOE, hybrid_deterministic, "shared_gate", torch.float32, engine_case),
    (MOE, hybrid_deterministic, "activation", torch.float32, decode_vs_prefill_case),
    (NEXT, hybrid_deterministic, "shared_gate", torch.float32, engine_case),
    (NEXT, gated_delta_deterministic, "rule", torch.float32, hit_case),
]


@pytest.mark.parametrize("family, module, off, dtype, case", POWER,
                         ids=[f"{family}-{off}-{str(dtype)[6:]}-{case.__name__}"
                              for family, _, off, dtype, case in POWER])
def test_each_ingredient_off_alone_breaks_a_case(monkeypatch, family, module, off, dtype, case):
    torch.set_num_threads(2)  # MKL's float32 1-row product sums in another order at 2 threads (the suite runs 1)
    assert case(family, dtype)
    monkeypatch.setattr(module, "_OFF", {off})
    assert not case(family, dtype)


@pytest.mark.parametrize("family", [FAMILY, MOE, NEXT])
def test_with_the_mode_off_some_case_differs(family, dtype):
    cases = (decode_vs_prefill_case, engine_case, hit_case)
    assert not all(case(family, dtype, deterministic=False) for case in cases)


def test_layers_it_cannot_hold_for_are_refused():
    model = build_model(FAMILY, seed=0, hidden_act="gelu")
    with pytest.raises(ValueError, match="(?s)hidden_act='gelu'.*deterministic=False"):
        HybridPrefixCache(model, deterministic=True)
    HybridPrefixCache(model)  # nothing was patched: the default mode still builds
    with pytest.raises(ValueError, match="(?s)vision tower.*Qwen3_5ForCausalLM.*deterministic=False"):
        HybridPrefixCache(build_vlm("qwen3_5", seed=0), deterministic=True)
