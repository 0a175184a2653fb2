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
from deterministic_bank import (
    BASE,
    chat_with_the_reply_replayed,
    decode_vs_prefill_case,
    engine_case,
    engine_requests_equal_generate_alone,
    fresh,
    hits_equal_cold,
    identical_prompt_and_decoded_tokens,
    ingredient_off_breaks,
    mode_is_the_model,
    mode_off_some_case_differs,
    padded_batch_rows_equal_each_alone,
    run,
    speculative_case,
)
from test_deterministic import OVERRIDES
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_hybridcache import HybridPrefixCache
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
    hits_equal_cold(family, dtype, length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_identical_prompt_and_decoded_tokens_equal_cold_and_prefilled(family, dtype):
    identical_prompt_and_decoded_tokens(family, dtype)


def test_chat_turns_with_the_reply_replayed_equal_cold(family, dtype):
    chat_with_the_reply_replayed(family, dtype, turns=2)


def test_padded_generate_batch_rows_equal_each_alone(family, dtype):
    """Left padding shifts a row's keys: the attention re-anchors them at the row's first token."""
    padded_batch_rows_equal_each_alone(family, dtype)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_requests_equal_generate_alone_in_any_batch(family, dtype, max_batch_tokens):
    engine_requests_equal_generate_alone(family, dtype, max_batch_tokens)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_in_float16_equals_generate_alone(family, max_batch_tokens):
    assert engine_case(family, torch.float16, max_batch_tokens=max_batch_tokens)


def test_engine_at_two_threads_equals_generate_alone():
    torch.set_num_threads(2)
    assert engine_case(FAMILY, torch.float32)


def test_speculative_verify_groups_equal_generate_alone(family, dtype):
    speculative_case(family, dtype, new_tokens=10)


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
    """Within round-off of a plain forward: a mistake in the experts' sum, the router, a head's products or the
    attention would move the logits by far more."""
    mode_is_the_model(family)


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
    ingredient_off_breaks(monkeypatch, hybrid_deterministic, off, case, family, dtype)


def test_with_the_mode_off_some_case_differs(family, dtype):
    mode_off_some_case_differs(family, dtype)


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
    monkeypatch.setattr(attention_invariant, "invariance_failures", lambda dtype, **kwargs: ["decode at 31"])
    with pytest.raises(ValueError, match=r"(?s)other bits in torch.float32.*decode at 31.*deterministic=False"):
        HybridPrefixCache(build_model(FAMILY, seed=0), deterministic=True)
