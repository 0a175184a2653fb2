"""deterministic=True on Inkling 2 (``inkling2_text``) and Inkling 2 Loop (``inkling2_loop_text``, transformers >=
5.24; skipped on older releases), issue 46.

The toys are the tiny configs (sliding-window, window 24, and full attention layers; four float32 short convs per
layer, the full layers' key and value convs dynamic; routed experts in every layer, 4 of them, top 2, softcapped
SwiGLUs of 56; the Loop's six layers with layers 2-3 run three times, message gates of rank 8) with
test_deterministic.py's ``OVERRIDES``: block attention residuals every 2 layers, the logarithmic scaling from position
8 on, 3 query heads of 24 over one key head in both layer kinds and relative states of 6 (widths off the CPU's vector
width). A request's tokens and logits / logprobs are the same bits cold and after hits of several lengths, with a
reply replayed in a chat, decoded or prefilled, as a row of a left-padded generate() batch, and among 1-8 concurrent
engine requests at prefill chunks of 16, 48 and 512 tokens (and in speculative verify groups) against generate()
alone, in float32, bfloat16 and float16; the mode computes the model (upstream's logits within round-off) and stores
upstream's states.

Power (each ingredient switched off alone through the private ``_OFF`` sets; measured on the 2-core AVX-512 CPU,
torch 2.13 with MKL, at 2 intra-op threads, the same on both families; docs/deterministic.md has the table): the
relative bias's row-invariant product (``inkling2_deterministic`` ``"relative"``: upstream's ``relative_states @
proj``) and the output gate's invariant sigmoid (``"gate"``) make a decoded token differ from the same token
prefilled; the experts through the row-invariant linear (``moe_deterministic`` ``"experts"``) a float32 hit from
cold; the router's exp-only sigmoid (``"router"``) the engine's logprobs from generate()'s; so do the invariant
attention (with the sink logits), its window anchored at the query and the row-invariant linear. The l2 clips, the
softcaps (the final logits', the Loop's message gates' ``tanh``), the softcapped SwiGLU and the block attention
residuals are kept without a case of this bank that differs: upstream's ``vector_norm`` over a head vector,
``torch.tanh``, the SwiGLU on a row of a chunked view and scaled-dot-product attention with the positions as heads
gave a row its bits in any call here (tests/test_deterministic_conv3.py tests the invariant forms themselves).
"""

import pytest
import test_deterministic
import torch
from deterministic_bank import (
    BASE,
    PROMPTS,
    checkpoints_hold_upstream_states,
    cold,
    decode_vs_prefill_case,
    engine_case,
    fresh,
    hit_case,
    hits_equal_cold,
    mode_is_the_model,
    mode_off_some_case_differs,
    padded_batch_rows_equal_each_alone,
    run,
    speculative_case,
)
from engine_scenarios import ids

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.models import (
    hybrid_deterministic,
    inkling2_deterministic,
    mamba1_deterministic,
    moe_deterministic,
)
from hf_hybridcache.toy import build_model

INKLING2 = "inkling2_text"
LOOP = "inkling2_loop_text"
DTYPES3 = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])


@pytest.fixture(params=[INKLING2, LOOP])
def family(request):
    """Both families (conftest.py skips the Loop's tests on a transformers without it)."""
    return request.param


@DTYPES3
@pytest.mark.parametrize("length", [17, 40, 64, 89])
def test_hits_equal_cold_bit_for_bit(family, dtype, length):
    hits_equal_cold(family, dtype, length)


@DTYPES3
def test_identical_prompt_decoded_tokens_and_padded_rows_equal_cold(family, dtype):
    assert hit_case(family, dtype)
    assert decode_vs_prefill_case(family, dtype)
    padded_batch_rows_equal_each_alone(family, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chat_turns_with_the_reply_replayed_equal_cold(family, dtype):
    model, cache = fresh(family, dtype, replay_replies=True)
    turn = BASE[:50]
    for n in range(2):
        reply, _ = run(model, cache, turn, new_tokens=9)
        turn = turn + reply + ids(5, seed=4630 + n)
        tokens, logits = run(model, cache, turn)
        assert cache.last_hit_tokens[0] >= len(turn) - 5 - 9 - 16  # the reply's blocks hit
        ref_tokens, ref_logits = cold(family, dtype, turn)
        assert tokens == ref_tokens and torch.equal(logits, ref_logits), f"turn {n + 2}"


@DTYPES3
@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_requests_equal_generate_alone_in_any_batch(family, dtype, max_batch_tokens):
    for prompts in (PROMPTS[:1], PROMPTS[2:5], PROMPTS):
        assert engine_case(family, dtype, prompts, max_batch_tokens), f"{len(prompts)} requests"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_speculative_verify_groups_equal_generate_alone(family, dtype):
    speculative_case(family, dtype)


def test_mode_is_the_model_within_round_off(family):
    mode_is_the_model(family)


def test_checkpoints_hold_the_states_of_an_upstream_cold_forward(family):
    """The four windows of every layer (the dynamic convs' raw inputs included) and the keys and values at a block
    boundary equal an unpatched model's within round-off."""
    checkpoints_hold_upstream_states(family)


@pytest.mark.parametrize("bias", [0.0, 0.05])
def test_experts_block_is_upstreams_within_round_off(bias):
    """Under a correction bias that moves the choice, the router chooses upstream's experts and the block's output is
    upstream's within float32 round-off."""
    model = test_deterministic.toy(INKLING2)
    block = next(m for m in model.modules() if type(m).__name__ == "Inkling2SparseMoeBlock")
    torch.manual_seed(1)
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.randn(block.gate.num_experts) * bias)
        x = torch.randn(2, 9, block.experts.hidden_dim) * 2
        _, _, upstream_chosen = block.gate(x.reshape(-1, x.shape[-1]))
        expected = type(block).forward(block, x)
        out = moe_deterministic.inkling2_moe_forward(block, None, x)
        scores = torch.sigmoid(x.reshape(-1, x.shape[-1]) @ block.gate.weight.T) + block.gate.e_score_correction_bias
    chosen = scores.topk(block.gate.top_k, dim=-1)[1]
    assert torch.equal(chosen.sort(-1).values, upstream_chosen.sort(-1).values)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_a_router_scoring_other_than_sigmoid_is_refused():
    model = build_model(INKLING2, seed=0, scoring_func="tanh")
    with pytest.raises(ValueError, match="(?s)scoring_func='tanh'.*deterministic=False"):
        HybridPrefixCache(model, deterministic=True)
    HybridPrefixCache(model)  # nothing was patched: the default mode still builds


#: (module, ingredient, dtype, a case it breaks when switched off alone), measured at 2 threads on both families.
POWER = [
    (inkling2_deterministic, "relative", torch.float32, decode_vs_prefill_case),
    (inkling2_deterministic, "gate", torch.float32, decode_vs_prefill_case),
    (moe_deterministic, "experts", torch.float32, hit_case),
    (moe_deterministic, "router", torch.float32, engine_case),
    (hybrid_deterministic, "attention", torch.float32, engine_case),
    (hybrid_deterministic, "window", torch.float32, engine_case),
    (hybrid_deterministic, "window", torch.bfloat16, decode_vs_prefill_case),
    (mamba1_deterministic, "linear", torch.float32, hit_case),
]


@pytest.mark.parametrize("module, off, dtype, case", POWER,
                         ids=[f"{off}-{str(dtype)[6:]}-{case.__name__}" for _, off, dtype, case in POWER])
def test_each_ingredient_off_alone_breaks_a_case(monkeypatch, family, module, off, dtype, case):
    torch.set_num_threads(2)  # MKL's float32 1-row product sums in another order at 2 threads (the suite runs 1)
    assert case(family, dtype)
    monkeypatch.setattr(module, "_OFF", {off})
    assert not case(family, dtype)


def test_with_the_mode_off_some_case_differs(family):
    mode_off_some_case_differs(family, torch.float32)
