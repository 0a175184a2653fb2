"""deterministic=True on the Mamba-1 hybrids (issue 46): Jamba (attention and Mamba-1 layers, routed experts with 4
experts, top 2, and plain MLPs, on the long-memory toy with an MLP width (104) off the CPU's vector width) and Zamba
(per-head Mamba-1 mixers, a shared attention block with a GELU MLP). A request's tokens and logits / logprobs are the
same bits cold and after hits, decoded or prefilled, as a row of a left-padded generate() batch, and among 1-8
concurrent engine requests at prefill chunk sizes 16, 48 and 512 (and in speculative verify groups) against
generate() alone; float32 and bfloat16 throughout, float16 for hits, decode and the engine.

Power (each ingredient switched off alone through the private ``hybrid_deterministic._OFF``; measured on the 2-core
AVX-512 CPU, torch 2.13 with MKL, 1 and 2 threads alike; docs/deterministic.md has the table):

- the invariant attention (SDPA instead): a decoded token's logits differ from the same token prefilled in float32,
  and the engine's logprobs from generate()'s in float32 and bfloat16 (Jamba and Zamba);
- the invariant SiLU (``F.silu`` instead): the same two cases differ in float32 on Jamba (bfloat16's ``F.silu`` is
  row-invariant here, so no case can differ there). Zamba's GELU in float32 shows no case on this bank (float16's
  ``F.gelu`` moved with the element's offset in table 2b of benchmarks/batch_invariance.py, not in these models,
  also at an MLP width of 104): a precaution with no test of its own;
- the mode off: some case differs in float32 and bfloat16, on both families.
"""

import pytest
import torch
from engine_scenarios import finals, ids
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
    logprobs,
    run,
)
from transformers import AttentionInterface, ContinuousBatchingConfig, GenerationConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.engine import NgramDrafter, Speculation
from hf_hybridcache.kernels import attention_invariant
from hf_hybridcache.models import hybrid_deterministic
from hf_hybridcache.toy import build_model

FAMILY = "jamba"  # the power, eager and refusal tests' family


@pytest.fixture(params=["jamba", "zamba"])
def family(request):
    return request.param


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("length", [17, 64, 89])
def test_hits_equal_cold_bit_for_bit(family, dtype, length):
    model, cache = fresh(family, dtype)
    run(model, cache, BASE)
    prompt = BASE[:length] + ids(7, seed=4601)
    tokens, logits = run(model, cache, prompt)
    assert cache.last_hit_tokens == [min(length, 80) // 16 * 16]
    ref_tokens, ref_logits = cold(family, dtype, prompt)
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_identical_prompt_and_decoded_tokens_equal_cold_and_prefilled(family, dtype):
    assert hit_case(family, dtype)
    assert decode_vs_prefill_case(family, dtype)


def test_chat_turns_with_the_reply_replayed_equal_cold(family, dtype):
    model, cache = fresh(family, dtype, replay_replies=True)
    turn = BASE[:50]
    for n in range(2):
        reply, _ = run(model, cache, turn, new_tokens=9)
        turn = turn + reply + ids(5, seed=4630 + n)
        tokens, logits = run(model, cache, turn)
        assert cache.last_hit_tokens[0] >= len(turn) - 5 - 9 - 16
        ref_tokens, ref_logits = cold(family, dtype, turn)
        assert tokens == ref_tokens and torch.equal(logits, ref_logits), f"turn {n + 2}"


def test_padded_generate_batch_rows_equal_each_alone(family, dtype):
    """Left padding shifts a row's keys: the attention re-anchors them at the row's first token."""
    prompts = [PROMPTS[i] for i in (3, 1, 6)]
    width = max(map(len, prompts))
    batch = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    model, cache = fresh(family, dtype)
    with torch.no_grad():
        out = model.generate(batch, attention_mask=(batch != 0).long(), past_key_values=cache, max_new_tokens=5,
                             min_new_tokens=5, output_logits=True, return_dict_in_generate=True, **GREEDY)
    for row, prompt in enumerate(prompts):
        tokens, logits = cold(family, dtype, prompt, 5)
        assert out.sequences[row, width:].tolist() == tokens
        assert torch.equal(torch.stack([step[row] for step in out.logits]), logits), f"row {row}"


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_requests_equal_generate_alone_in_any_batch(family, dtype, max_batch_tokens):
    """The engine's tokens and logprobs for 1, 3 and 8 concurrent requests (two of them hit each other's prefix)
    equal each one alone in generate()."""
    for prompts in (PROMPTS[:1], PROMPTS[2:5], PROMPTS):
        assert engine_case(family, dtype, prompts, max_batch_tokens), f"{len(prompts)} requests"


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_in_float16_equals_generate_alone(family, max_batch_tokens):
    assert engine_case(family, torch.float16, PROMPTS, max_batch_tokens)


def test_engine_at_two_threads_equals_generate_alone():
    torch.set_num_threads(2)
    assert engine_case(FAMILY, torch.float32, PROMPTS, 48)


def test_speculative_verify_groups_equal_generate_alone(family, dtype):
    loop = ids(10, seed=4640)
    prompts = [loop * 4 + ids(3, seed=4641), ids(20, seed=4642) + loop * 3, ids(33, seed=4643)]
    _, cache = fresh(family, dtype)
    manager = cache.init_continuous_batching(GenerationConfig(max_new_tokens=10, **GREEDY),
                                             ContinuousBatchingConfig(return_logprobs=True),
                                             speculation=Speculation(NgramDrafter(), 4))
    manager.start()
    try:
        names = manager.add_requests(prompts, max_new_tokens=10)
        outputs = finals(manager, names)
    finally:
        manager.stop()
    assert manager.batch_processor.speculator.stats.verify_segments > 0
    for name, prompt in zip(names, prompts):
        tokens, logits = cold(family, dtype, prompt, 10, floor=False)
        assert outputs[name].generated_tokens == tokens
        assert list(outputs[name].logprobs) == logprobs(tokens, logits)


def test_eager_attention_takes_the_same_path():
    """An eager model's attention (additive masks) reaches the same kernel: its tokens and logits are the sdpa
    model's bits."""
    model, cache = fresh(FAMILY, torch.bfloat16)
    eager = build_model(FAMILY, seed=0, dtype=torch.bfloat16, **OVERRIDES[FAMILY])
    eager.set_attn_implementation("eager")
    prompt = BASE[:40]
    tokens, logits = run(eager, HybridPrefixCache(eager, deterministic=True), prompt)
    ref_tokens, ref_logits = run(model, cache, prompt)
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)


def test_the_mode_is_the_model_within_round_off(family):
    """The deterministic forward computes the model: its float32 logits are a plain forward's within round-off (a
    mistake in the experts' sum, the router, a head's products or the attention would move them by far more)."""
    model, _ = fresh(family, torch.float32)
    plain = build_model(family, seed=0, **OVERRIDES.get(family, {}))
    _, logits = run(model, HybridPrefixCache(model, deterministic=True), BASE[:40], new_tokens=1)
    with torch.no_grad():
        expected = plain(torch.tensor([BASE[:40]])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family, off, dtype, case", [
    ("jamba", "attention", torch.float32, decode_vs_prefill_case),
    ("jamba", "attention", torch.bfloat16, engine_case),
    ("jamba", "activation", torch.float32, decode_vs_prefill_case),
    ("jamba", "activation", torch.float32, engine_case),
    ("zamba", "attention", torch.float32, decode_vs_prefill_case),
    ("zamba", "attention", torch.bfloat16, engine_case),
], ids=["jamba-attention-fp32-decode", "jamba-attention-bf16-engine", "jamba-activation-fp32-decode",
        "jamba-activation-fp32-engine", "zamba-attention-fp32-decode", "zamba-attention-bf16-engine"])
def test_each_ingredient_off_alone_breaks_a_case(monkeypatch, family, off, dtype, case):
    assert case(family, dtype)
    monkeypatch.setattr(hybrid_deterministic, "_OFF", {off})
    assert not case(family, dtype)


def test_with_the_mode_off_some_case_differs(family, dtype):
    cases = (decode_vs_prefill_case, engine_case, hit_case)
    assert not all(case(family, dtype, deterministic=False) for case in cases)


def test_layers_it_cannot_hold_for_are_refused(monkeypatch):
    model = build_model(FAMILY, seed=0, hidden_act="relu")
    with pytest.raises(ValueError, match="(?s)hidden_act='relu'.*deterministic=False"):
        HybridPrefixCache(model, deterministic=True)
    HybridPrefixCache(model)  # nothing was patched: the default mode still builds
    AttentionInterface.register("test_custom_attention", sdpa_attention_forward)  # a name no other test uses
    model = build_model(FAMILY, seed=0)
    model.set_attn_implementation("test_custom_attention")
    with pytest.raises(ValueError, match="(?s)attn_implementation='test_custom_attention'.*'sdpa'"):
        HybridPrefixCache(model, deterministic=True)
    monkeypatch.setattr(attention_invariant, "_CHECKED", set())
    monkeypatch.setattr(attention_invariant, "invariance_failures", lambda dtype: ["decode at 31"])
    with pytest.raises(ValueError, match=r"(?s)other bits in torch.float32.*decode at 31.*deterministic=False"):
        HybridPrefixCache(build_model(FAMILY, seed=0), deterministic=True)
