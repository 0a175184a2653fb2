"""deterministic=True on Inkling with routed experts (``inkling_text``'s ``"sparse"`` MLP layers, ``InklingMoE``),
issue 46.

The toy is test_deterministic.py's ``inkling_text-moe`` variant: Inkling's bank toy (attention with relative logits,
sliding and full, four float32 short convs per layer) with routed experts on two of its four layers (4 of 56, top 2,
route_scale 8) and two shared experts weighted by their gammas. A request's tokens and logits / logprobs are the same
bits cold and after hits of several lengths, with a reply replayed in a chat, decoded or prefilled, as a row of a
left-padded generate() batch, and among 1-8 concurrent engine requests at prefill chunks of 16, 48 and 512 tokens
(and in speculative verify groups) against generate() alone, in float32, bfloat16 and float16; the experts block is
upstream's within round-off, its router choosing upstream's experts under a correction bias and a global scale.

Power (each ingredient switched off alone through ``moe_deterministic._OFF``; measured on the 2-core AVX-512 CPU,
torch 2.13 with MKL, at 2 intra-op threads; docs/deterministic.md has the table): the routed experts as upstream's
experts module runs them (``"experts"``) make a float32 hit differ from cold, the shared experts as upstream's ``bmm``
stack (``"shared"``) a decoded token from the same token prefilled. The router's exp-only sigmoid and weights
(``"router"``) are kept without a case of this bank that differs: upstream's ``logsigmoid`` / ``logsumexp`` weights
gave a row its bits in any batch here, and its ``torch.sigmoid`` over the router's contiguous logits (which moves a
float32 element with its offset) only orders the choice, which a one-ulp move flips only at a near tie.
"""

import pytest
import test_deterministic
import torch
from deterministic_bank import (
    BASE,
    chat_with_the_reply_replayed,
    decode_vs_prefill_case,
    engine_case,
    engine_requests_equal_generate_alone,
    hit_case,
    hits_equal_cold,
    identical_prompt_and_decoded_tokens,
    ingredient_off_breaks,
    mode_is_the_model,
    mode_off_some_case_differs,
    padded_batch_rows_equal_each_alone,
    speculative_case,
)
from test_deterministic import VARIANTS

from hf_hybridcache.models import hybrid_deterministic, mamba1_deterministic, moe_deterministic
from hf_hybridcache.toy import build_model

INKLING_MOE = "inkling_text-moe"
DTYPES3 = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])


@DTYPES3
@pytest.mark.parametrize("length", [17, 40, 64, 89])
def test_hits_equal_cold_bit_for_bit(dtype, length):
    hits_equal_cold(INKLING_MOE, dtype, length)


@DTYPES3
def test_identical_prompt_decoded_tokens_and_padded_rows_equal_cold(dtype, monkeypatch):
    identical_prompt_and_decoded_tokens(INKLING_MOE, dtype)
    # Without the logarithmic query scaling, which counts a left-padded row's padding (test_deterministic_conv2.py).
    family, settings = VARIANTS[INKLING_MOE]
    monkeypatch.setitem(test_deterministic.VARIANTS, INKLING_MOE, (family, dict(settings, log_scaling_n_floor=None)))
    padded_batch_rows_equal_each_alone(INKLING_MOE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chat_turns_with_the_reply_replayed_equal_cold(dtype):
    """The bank's chat from another first turn: from BASE[:50] the bfloat16 toy replies with token 0, the pad token,
    which generate() masks (and the cache then does not reuse the turn)."""
    chat_with_the_reply_replayed(INKLING_MOE, dtype, turns=2, first=BASE[3:53])


@DTYPES3
@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_requests_equal_generate_alone_in_any_batch(dtype, max_batch_tokens):
    engine_requests_equal_generate_alone(INKLING_MOE, dtype, max_batch_tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_speculative_verify_groups_equal_generate_alone(dtype):
    speculative_case(INKLING_MOE, dtype)


def test_mode_is_the_model_within_round_off():
    mode_is_the_model(INKLING_MOE)


@pytest.mark.parametrize("global_scale", [1.0, 0.7])
def test_experts_block_is_upstreams_within_round_off(global_scale):
    """Under a correction bias that moves the choice and a global scale, the router chooses upstream's experts and
    the block's output is upstream's within float32 round-off."""
    family, settings = VARIANTS[INKLING_MOE]
    model = build_model(family, seed=0, **settings)
    block = next(m for m in model.modules() if type(m).__name__ == "InklingMoE")
    torch.manual_seed(1)
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.randn(block.gate.num_experts) * 0.05)
        block.gate.global_scale.fill_(global_scale)
        x = torch.randn(2, 9, block.experts.hidden_dim) * 2
        _, _, upstream_chosen, _ = block.gate(x)
        logits = x.reshape(-1, x.shape[-1]) @ block.gate.weight.T
        scores = torch.sigmoid(logits[:, :block.gate.num_experts]) + block.gate.e_score_correction_bias
        chosen = scores.topk(block.gate.top_k, dim=-1)[1]
        assert torch.equal(chosen.sort(-1).values, upstream_chosen.sort(-1).values)
        expected = type(block).forward(block, x)
        torch.testing.assert_close(moe_deterministic.inkling_moe_forward(block, None, x), expected, atol=1e-5, rtol=0)


def test_router_weights_hold_for_any_logits():
    """The weights of the k chosen and the shared experts, ``sigmoid(l) / sum sigmoid(l)``, are upstream's softmax of
    ``logsigmoid`` within round-off, finite where every logit is far below or above zero."""
    torch.manual_seed(2)
    for scale, shift in ((3.0, 0.0), (5.0, -200.0), (5.0, 200.0), (50.0, 0.0)):
        logits = torch.randn(64, 4) * scale + shift
        log_probs = torch.nn.functional.logsigmoid(logits)
        expected = torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))
        torch.testing.assert_close(moe_deterministic._sigmoid_shares(logits), expected, atol=1e-6, rtol=1e-5)


#: (module, ingredient, dtype, case), measured at 2 threads.
POWER = [
    (moe_deterministic, "experts", torch.float32, hit_case),
    (moe_deterministic, "shared", torch.float32, decode_vs_prefill_case),
    (hybrid_deterministic, "activation", torch.float32, engine_case),
    (mamba1_deterministic, "linear", torch.float32, engine_case),
]


@pytest.mark.parametrize("module, off, dtype, case", POWER,
                         ids=[f"{off}-{str(dtype)[6:]}-{case.__name__}" for _, off, dtype, case in POWER])
def test_each_ingredient_off_alone_breaks_a_case(monkeypatch, module, off, dtype, case):
    torch.set_num_threads(2)
    ingredient_off_breaks(monkeypatch, module, off, case, INKLING_MOE, dtype)


def test_with_the_mode_off_some_case_differs():
    mode_off_some_case_differs(INKLING_MOE, torch.float32)
