"""deterministic=True on the Kimi delta attention (KDA) hybrids, Kimi Linear (``kimi_linear``) and Ling
(``bailing_hybrid``), issue 46: KDA layers around an MLA attention layer (Kimi's NoPE, Ling's with interleaved rotary
and a head gate), a dense MLP then routed + shared experts behind a grouped sigmoid router with a correction bias
(Ling's SwiGLUs clipped); the long-memory toys with widths off the CPU's vector width (test_deterministic.py's
``OVERRIDES``: an MLP of 104, experts of 56, 3 MLA heads, KDA heads of 20). A request's tokens and logits / logprobs
are the same bits cold and after hits of several lengths, with a reply replayed in a chat, decoded or prefilled, as a
row of a left-padded generate() batch, and among 1-8 concurrent engine requests at prefill chunks of 16, 48 and 512
tokens (and in speculative verify groups) against generate() alone (the server's completions:
test_deterministic_serve.py, on every accepted family); float32 and bfloat16 throughout, float16 for hits, decode and
the engine.

Power (each ingredient switched off alone through the private ``kda_deterministic._OFF`` or
``hybrid_deterministic._OFF``; measured on the 2-core AVX-512 CPU, torch 2.13 with MKL, at 2 intra-op threads;
docs/deterministic.md has the table): the row-invariant linear, the invariant conv, the per-token KDA rule, the
sigmoid-gated output norm, the mixer's gates, the invariant attention, the MLPs' and experts' SiLU and the router's
sigmoid each make some float32 case differ on both families, Ling's attention head gate too (:data:`POWER` names one
case per ingredient; the conv also in bf16 / fp16 on Kimi, the rule in bf16 and fp16).
"""

import pytest
import torch
from deterministic_bank import (
    BASE,
    chat_with_the_reply_replayed,
    checkpoints_hold_upstream_states,
    cold,
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
    run,
    speculative_case,
)
from test_deterministic import OVERRIDES

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.models import hybrid_deterministic, kda_deterministic
from hf_hybridcache.toy import build_model

KIMI = "kimi_linear"
LING = "bailing_hybrid"
DTYPES3 = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    return request.param


@pytest.fixture(params=[KIMI, LING])
def family(request):
    return request.param


@DTYPES3
@pytest.mark.parametrize("length", [17, 64, 89])
def test_hits_equal_cold_bit_for_bit(family, dtype, length):
    hits_equal_cold(family, dtype, length)


@DTYPES3
def test_identical_prompt_and_decoded_tokens_equal_cold_and_prefilled(family, dtype):
    identical_prompt_and_decoded_tokens(family, dtype)


def test_chat_turns_with_the_reply_replayed_equal_cold(family, dtype):
    chat_with_the_reply_replayed(family, dtype, turns=2)


def test_padded_generate_batch_rows_equal_each_alone(family, dtype):
    """Left padding: a padded row's recurrent state stays zero until its first token, its keys re-anchor there."""
    padded_batch_rows_equal_each_alone(family, dtype)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_requests_equal_generate_alone_in_any_batch(family, dtype, max_batch_tokens):
    """The engine's tokens and logprobs for 1, 3 and 8 concurrent requests (two of them hit each other's prefix)
    equal each one alone in generate()."""
    engine_requests_equal_generate_alone(family, dtype, max_batch_tokens)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_in_float16_equals_generate_alone(family, max_batch_tokens):
    assert engine_case(family, torch.float16, max_batch_tokens=max_batch_tokens)


def test_engine_at_two_threads_equals_generate_alone(family):
    torch.set_num_threads(2)
    assert engine_case(family, torch.float32)


def test_engine_requests_hit_each_others_prefix(family):
    engine_requests_hit_each_others_prefix(family)


def test_speculative_verify_groups_equal_generate_alone(family, dtype):
    speculative_case(family, dtype)


def test_eager_attention_gives_the_bits_of_sdpa(family):
    """Both attention implementations are routed to the invariant attention (the MLA keys ``[nope | rope]`` of
    width 24 or 32, values of 16)."""
    prompt = BASE[:45]
    expected = cold(family, torch.float32, prompt)
    model = build_model(family, seed=0, attn_implementation="eager", **OVERRIDES[family])
    cache = HybridPrefixCache(model, deterministic=True, retention_interval="dense")
    tokens, logits = run(model, cache, prompt)
    assert tokens == expected[0] and torch.equal(logits, expected[1])


def test_the_mode_is_the_model_within_round_off(family):
    """The deterministic forward computes the model: its float32 logits are a plain forward's within round-off (a
    mistake in the gates, the rule, the norm, the router or Ling's clipping would move them by far more)."""
    mode_is_the_model(family)


def test_checkpoints_hold_the_states_of_an_upstream_cold_forward(family):
    """What the mode stores is what the default path stores: the conv window and the float32 state ``[H, Dk, Dv]``
    at a block boundary equal an unpatched model's (transformers' chunked KDA) within round-off."""
    checkpoints_hold_upstream_states(family)


#: (family, module, ingredient, dtype, a case it breaks when switched off alone), measured at 2 threads.
POWER = [
    (KIMI, kda_deterministic, "linear", torch.float32, hit_case),
    (KIMI, kda_deterministic, "conv", torch.bfloat16, decode_vs_prefill_case),
    (KIMI, kda_deterministic, "rule", torch.float32, hit_case),
    (KIMI, kda_deterministic, "rule", torch.bfloat16, hit_case),
    (KIMI, kda_deterministic, "norm", torch.float32, decode_vs_prefill_case),
    (KIMI, kda_deterministic, "gates", torch.float32, decode_vs_prefill_case),
    (KIMI, hybrid_deterministic, "attention", torch.float32, decode_vs_prefill_case),
    (KIMI, hybrid_deterministic, "activation", torch.float32, decode_vs_prefill_case),
    (KIMI, hybrid_deterministic, "gate", torch.float32, engine_case),
    (LING, kda_deterministic, "linear", torch.float32, hit_case),
    (LING, kda_deterministic, "conv", torch.float32, decode_vs_prefill_case),
    (LING, kda_deterministic, "rule", torch.float16, engine_case),
    (LING, kda_deterministic, "norm", torch.float32, decode_vs_prefill_case),
    (LING, kda_deterministic, "gates", torch.float32, hit_case),
    (LING, kda_deterministic, "attention_gate", torch.float32, hit_case),
    (LING, hybrid_deterministic, "attention", torch.float32, decode_vs_prefill_case),
    (LING, hybrid_deterministic, "activation", torch.float32, decode_vs_prefill_case),
    (LING, hybrid_deterministic, "gate", torch.float32, engine_case),
]


@pytest.mark.parametrize("family, module, off, dtype, case", POWER,
                         ids=[f"{family}-{off}-{str(dtype)[6:]}-{case.__name__}"
                              for family, _, off, dtype, case in POWER])
def test_each_ingredient_off_alone_breaks_a_case(monkeypatch, family, module, off, dtype, case):
    torch.set_num_threads(2)  # MKL's float32 1-row product sums in another order at 2 threads (the suite runs 1)
    ingredient_off_breaks(monkeypatch, module, off, case, family, dtype)


def test_with_the_mode_off_some_case_differs(family, dtype):
    mode_off_some_case_differs(family, dtype)


def test_layers_it_cannot_hold_for_are_refused(family):
    model = build_model(family, seed=0, hidden_act="gelu")
    with pytest.raises(ValueError, match="(?s)hidden_act='gelu'.*deterministic=False"):
        HybridPrefixCache(model, deterministic=True)
    HybridPrefixCache(model)  # nothing was patched: the default mode still builds
