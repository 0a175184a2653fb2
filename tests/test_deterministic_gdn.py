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
from deterministic_bank import (
    chat_with_the_reply_replayed,
    checkpoints_hold_upstream_states,
    decode_vs_prefill_case,
    engine_case,
    engine_requests_equal_generate_alone,
    engine_requests_hit_each_others_prefix,
    hit_case,
    hits_equal_cold,
    identical_prompt_and_decoded_tokens,
    ingredient_off_breaks,
    mode_is_the_model,
    mode_off_some_case_differs,
    padded_batch_rows_equal_each_alone,
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
    hits_equal_cold(FAMILY, dtype, length)


@DTYPES3
def test_identical_prompt_and_decoded_tokens_equal_cold_and_prefilled(dtype):
    identical_prompt_and_decoded_tokens(FAMILY, dtype)


def test_chat_turns_with_the_reply_replayed_equal_cold(dtype):
    chat_with_the_reply_replayed(FAMILY, dtype, turns=2)


def test_padded_generate_batch_rows_equal_each_alone(dtype):
    """Left padding: a padded row's recurrent state stays zero until its first token, its keys re-anchor there."""
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


def test_engine_requests_hit_each_others_prefix():
    engine_requests_hit_each_others_prefix(FAMILY)


def test_speculative_verify_groups_equal_generate_alone(dtype):
    speculative_case(FAMILY, dtype)


def test_the_mode_is_the_model_within_round_off():
    """Within round-off of a plain forward: a mistake in the gates, the rule, the norm or the attention's gate would
    move the logits by far more."""
    mode_is_the_model(FAMILY)


def test_checkpoints_hold_the_states_of_an_upstream_cold_forward():
    """The conv window and the float32 state ``[Hv, Dk, Dv]`` at a block boundary equal an unpatched model's
    (transformers' chunked rule) within round-off."""
    checkpoints_hold_upstream_states(FAMILY)


@pytest.fixture(params=[MOE, NEXT])
def moe_family(request):
    return request.param


@DTYPES3
def test_moe_hit_and_decoded_tokens_equal_cold_and_prefilled(moe_family, dtype):
    """Qwen3.5-MoE and Qwen3-Next (4 routed experts of 56, top 2, a shared expert of 104 behind its sigmoid gate;
    Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba``)."""
    identical_prompt_and_decoded_tokens(moe_family, dtype)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_moe_engine_requests_equal_generate_alone(moe_family, dtype, max_batch_tokens):
    assert engine_case(moe_family, dtype, max_batch_tokens=max_batch_tokens)


def test_moe_mode_is_the_model_within_round_off(moe_family):
    mode_is_the_model(moe_family)


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
    ingredient_off_breaks(monkeypatch, module, off, case, family, dtype)


@pytest.mark.parametrize("family", [FAMILY, MOE, NEXT])
def test_with_the_mode_off_some_case_differs(family, dtype):
    mode_off_some_case_differs(family, dtype)


def test_layers_it_cannot_hold_for_are_refused():
    model = build_model(FAMILY, seed=0, hidden_act="gelu")
    with pytest.raises(ValueError, match="(?s)hidden_act='gelu'.*deterministic=False"):
        HybridPrefixCache(model, deterministic=True)
    HybridPrefixCache(model)  # nothing was patched: the default mode still builds
    with pytest.raises(ValueError, match="(?s)vision tower.*Qwen3_5ForCausalLM.*deterministic=False"):
        HybridPrefixCache(build_vlm("qwen3_5", seed=0), deterministic=True)
