"""deterministic=True on OLMo-Hybrid (``olmo_hybrid``) and Lara Mini (``lara_mini``, transformers >= 5.24), issue 46:
the gated delta net families beside Qwen3.5's (tests/test_deterministic_gdn.py), each with its own mixer layout.

- OLMo-Hybrid: separate q/k/v/g/b/a projections, beta doubled (``linear_allow_neg_eigval``), ``o_norm`` / ``o_proj``;
  attention decoder layers with q/k RMSNorms over the whole projection and rotary (or none: ``rope_theta=None``).
- Lara Mini: Qwen3.5's projections with a gated norm that weights in float32; a sliding-window attention layer (window
  24, rotary) and a full attention layer without position encoding; routed experts (router logits in float32) and an
  ungated shared expert in every layer.

The toys have widths off the CPU's vector width (test_deterministic.py's ``OVERRIDES``: 3 attention heads of 16, value
heads of 20, an MLP / shared expert of 104, experts of 56). A request's tokens and logits / logprobs are the same bits
cold and after hits of several lengths, with a reply replayed in a chat, decoded or prefilled, as a row of a
left-padded generate() batch, and among 1-8 concurrent engine requests at prefill chunks of 16, 48 and 512 tokens (and
in speculative verify groups) against generate() alone; float32 and bfloat16 throughout, float16 for hits, decode and
the engine. Prompts of up to 90 tokens run past Lara Mini's window, so its sliding layer's cache drops keys (generate()
keeps the last 23, an engine step reads the window).

Power (each ingredient switched off alone through the private ``gated_delta_deterministic._OFF`` or
``hybrid_deterministic._OFF``; 2 intra-op threads; docs/deterministic.md has the table): :data:`POWER` names a case per
ingredient, among them ``"window"`` (Lara Mini's sliding layer in the attention's form anchored at position 0, the
window in the mask only). What is no invariance but the model's arithmetic (beta doubled, Lara Mini's float32 norm
weight and router, its ungated shared expert) is held by the mode's logits within round-off of an upstream forward.
"""

import pytest
import torch
from conftest import NEEDS_NEWER_TRANSFORMERS
from deterministic_bank import (
    BASE,
    GREEDY,
    chat_with_the_reply_replayed,
    checkpoints_hold_upstream_states,
    decode_vs_prefill_case,
    engine_case,
    engine_requests_equal_generate_alone,
    fresh,
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
from hf_hybridcache.kernels.gated_delta_invariant import gated_rms_norm_after_invariant
from hf_hybridcache.models import gated_delta_deterministic, hybrid_deterministic
from hf_hybridcache.toy import TINY_CONFIGS, build_model

OLMO = "olmo_hybrid"
LARA = "lara_mini"
FAMILIES = [OLMO, LARA]
DTYPES3 = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
needs_lara = pytest.mark.skipif(LARA not in TINY_CONFIGS, reason=NEEDS_NEWER_TRANSFORMERS[LARA])


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    return request.param


@pytest.fixture
def nope(monkeypatch):
    """OLMo-Hybrid without position encoding (its released checkpoints' ``rope_theta=None``)."""
    monkeypatch.setitem(OVERRIDES, OLMO, dict(OVERRIDES[OLMO], rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": None}))
    assert build_model(OLMO, seed=0, **OVERRIDES[OLMO]).model.rotary_emb is None


@DTYPES3
@pytest.mark.parametrize("length", [17, 64, 89])
def test_hits_equal_cold_bit_for_bit(family, dtype, length):
    hits_equal_cold(family, dtype, length)


@DTYPES3
def test_identical_prompt_and_decoded_tokens_equal_cold_and_prefilled(family, dtype):
    identical_prompt_and_decoded_tokens(family, dtype)


@DTYPES3
def test_position_free_olmo_hybrid_hits_and_decodes_equal_cold(nope, dtype):
    identical_prompt_and_decoded_tokens(OLMO, dtype)


def unmasked_run(model, cache, prompt, new_tokens=6):
    """generate() with an all-ones attention mask: Lara Mini's toy replies with its pad token id (0), which generate()
    would mask without one (no prefix reuse then)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             past_key_values=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             output_logits=True, return_dict_in_generate=True, **GREEDY)
    return out.sequences[0, len(prompt):].tolist(), torch.stack([step[0] for step in out.logits])


def test_chat_turns_with_the_reply_replayed_equal_cold(family, dtype):
    chat_with_the_reply_replayed(family, dtype, turns=2, runner=unmasked_run)


def test_padded_generate_batch_rows_equal_each_alone(family, dtype):
    """Left padding: a padded row's recurrent state stays zero until its first token, its keys re-anchor there (a
    sliding layer's at each query)."""
    padded_batch_rows_equal_each_alone(family, dtype)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_requests_equal_generate_alone_in_any_batch(family, dtype, max_batch_tokens):
    """The engine's tokens and logprobs for 1, 3 and 8 concurrent requests (two of them hit each other's prefix)
    equal each one alone in generate()."""
    engine_requests_equal_generate_alone(family, dtype, max_batch_tokens)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_in_float16_equals_generate_alone(family, max_batch_tokens):
    assert engine_case(family, torch.float16, max_batch_tokens=max_batch_tokens)


def test_speculative_verify_groups_equal_generate_alone(family, dtype):
    speculative_case(family, dtype)


def test_eager_attention_takes_the_same_path(family):
    """An eager model's attention (additive masks; Lara Mini's sliding layer's mask cut to its window) reaches the
    same kernel: its tokens and logits over a prompt past the window are the sdpa model's bits."""
    eager = build_model(family, seed=0, dtype=torch.bfloat16, **OVERRIDES[family])
    eager.set_attn_implementation("eager")
    tokens, logits = run(eager, HybridPrefixCache(eager, deterministic=True), BASE[:60])
    ref_tokens, ref_logits = run(*fresh(family, torch.bfloat16), BASE[:60])
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)


def test_the_mode_is_the_model_within_round_off(family):
    """The deterministic forward computes the model: its float32 logits are a plain forward's within round-off (beta
    left undoubled, Lara Mini's router or shared expert gated as Qwen3.5-MoE's, would move them by far more)."""
    mode_is_the_model(family)


def test_checkpoints_hold_the_states_of_an_upstream_cold_forward(family):
    """What the mode stores is what the default path stores: the conv window and the float32 state at a block
    boundary equal an unpatched model's (transformers' chunked rule) within round-off."""
    checkpoints_hold_upstream_states(family)


@needs_lara
def test_lara_minis_gated_norm_weights_in_float32():
    """``LaraMiniRMSNormGated`` applies its weight to the float32 row before rounding (Qwen3.5's rounds first): in
    bfloat16 the invariant norm's float32-weight form is upstream's within its silu's round-off, and the other form is
    not the same bits."""
    from transformers.models.lara_mini.modeling_lara_mini import LaraMiniRMSNormGated

    gen = torch.Generator().manual_seed(0)
    norm = LaraMiniRMSNormGated(20).to(torch.bfloat16)
    norm.weight.data = (1 + torch.randn(20, generator=gen)).to(torch.bfloat16)
    y, gate = (torch.randn(64, 20, generator=gen).to(torch.bfloat16) for _ in range(2))
    ours = gated_rms_norm_after_invariant(y, gate, norm.weight, norm.variance_epsilon, float32_weight=True)
    torch.testing.assert_close(ours.float(), norm(y, gate).float(), atol=1e-2, rtol=0)
    rounded_first = gated_rms_norm_after_invariant(y, gate, norm.weight, norm.variance_epsilon)
    assert not torch.equal(ours, rounded_first)


#: (family, module, ingredient, dtype, a case it breaks when switched off alone), measured at 2 threads.
POWER = [
    (OLMO, gated_delta_deterministic, "linear", torch.float32, hit_case),
    (OLMO, gated_delta_deterministic, "conv", torch.bfloat16, decode_vs_prefill_case),
    (OLMO, gated_delta_deterministic, "rule", torch.float32, hit_case),
    (OLMO, gated_delta_deterministic, "norm", torch.float32, engine_case),
    (OLMO, gated_delta_deterministic, "gates", torch.float32, engine_case),
    (OLMO, hybrid_deterministic, "attention", torch.bfloat16, engine_case),
    (OLMO, hybrid_deterministic, "activation", torch.float32, decode_vs_prefill_case),
    (LARA, gated_delta_deterministic, "linear", torch.float32, hit_case),
    (LARA, gated_delta_deterministic, "conv", torch.bfloat16, decode_vs_prefill_case),
    (LARA, gated_delta_deterministic, "rule", torch.float32, hit_case),
    (LARA, gated_delta_deterministic, "gates", torch.float32, engine_case),
    (LARA, gated_delta_deterministic, "norm", torch.float32, engine_case),
    (LARA, hybrid_deterministic, "attention", torch.bfloat16, engine_case),
    (LARA, hybrid_deterministic, "activation", torch.float32, decode_vs_prefill_case),
    (LARA, hybrid_deterministic, "window", torch.float32, decode_vs_prefill_case),
    (LARA, hybrid_deterministic, "window", torch.bfloat16, engine_case),
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
    """The gated delta net's conv runs ``hidden_act``, which has an invariant form for SiLU only."""
    model = build_model(family, seed=0, hidden_act="gelu")
    with pytest.raises(ValueError, match="(?s)hidden_act='gelu'.*deterministic=False"):
        HybridPrefixCache(model, deterministic=True)
    HybridPrefixCache(model)  # nothing was patched: the default mode still builds
