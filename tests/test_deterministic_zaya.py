"""deterministic=True on ZAYA (``zaya``: CCA attention in every layer, sliding-window and full, and routed experts with
a skip expert), issue 46.

The toy is test_deterministic.py's ``zaya`` entry: the family's toy (4 layers alternating a 24-token window and full
attention, 4 query heads and 2 key heads of 16, the q|k conv of widths 2 and 2, 4 experts and the skip expert, top
1) with its router MLP 20 wide and its experts 56 wide (off the vector width). A request's tokens and logits /
logprobs are the same bits cold and after hits of several lengths, with a reply replayed in a chat, decoded or
prefilled, as a row of a left-padded generate() batch, and among 1-8 concurrent engine requests at prefill chunks of
16, 48 and 512 tokens (and in speculative verify groups) against generate() alone, in float32, bfloat16 and float16;
the mode's forward is the model within float32 round-off and stores upstream's states.

Power (each ingredient switched off alone through its module's ``_OFF``; measured on the 2-core AVX-512 CPU, torch
2.13 with MKL, at 2 intra-op threads; docs/deterministic.md has the table): the routed experts as upstream's experts
module runs them (``moe_deterministic "experts"``), the attention as the model's own function (``"attention"``) and
the row-invariant linear (``mamba1_deterministic "linear"``) make a float32 hit differ from cold; the sliding layers'
attention anchored at position 0 (``"window"``) a decoded token from the same token prefilled. The CCA conv
(``zaya_deterministic "conv"``: upstream's two ``conv1d``) and the router's GELU (``"gelu"``: ``nn.GELU``) are kept
without a case of this bank that differs: upstream's conv pair gave every token the same bits in a 600-token prefill,
48-token chunks and token by token here (its reduction order is the conv library's choice by shape and CPU, which
nothing pins), and ``F.gelu`` moves an element with its offset in float16 and on a single float32 element
(tests/test_zaya_invariant.py), which the router's float16 softmax and top-1 choice absorbed on this bank.
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
    mode_is_the_model,
    mode_off_some_case_differs,
    padded_batch_rows_equal_each_alone,
    speculative_case,
)
from test_deterministic import toy

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.models import hybrid_deterministic, mamba1_deterministic, moe_deterministic, zaya_deterministic

ZAYA = "zaya"
DTYPES3 = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])


@DTYPES3
@pytest.mark.parametrize("length", [17, 40, 64, 89])
def test_hits_equal_cold_bit_for_bit(dtype, length):
    hits_equal_cold(ZAYA, dtype, length)


@DTYPES3
def test_identical_prompt_decoded_tokens_and_padded_rows_equal_cold(dtype):
    assert hit_case(ZAYA, dtype)
    assert decode_vs_prefill_case(ZAYA, dtype)
    padded_batch_rows_equal_each_alone(ZAYA, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chat_turns_with_the_reply_replayed_equal_cold(dtype):
    chat_with_the_reply_replayed(ZAYA, dtype, turns=2)


@DTYPES3
@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_requests_equal_generate_alone_in_any_batch(dtype, max_batch_tokens):
    engine_requests_equal_generate_alone(ZAYA, dtype, max_batch_tokens)


def test_engine_requests_hit_each_others_prefix():
    engine_requests_hit_each_others_prefix(ZAYA)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_speculative_verify_groups_equal_generate_alone(dtype):
    speculative_case(ZAYA, dtype)


def test_mode_is_the_model_within_round_off():
    mode_is_the_model(ZAYA)


def test_checkpoints_hold_upstream_states():
    checkpoints_hold_upstream_states(ZAYA)


def test_experts_are_upstreams_within_round_off():
    """The experts the router chose (the skip expert masked to expert 0 with weight 0, as upstream) give upstream's
    experts module's output within float32 round-off."""
    model = toy(ZAYA)
    block = model.model.layers[1].mlp
    torch.manual_seed(1)
    x = torch.randn(2, 9, model.config.hidden_size)
    with torch.no_grad():
        _, weights, chosen, _ = block.gate(x)
        flat = x.reshape(-1, x.shape[-1])
        expected = block.experts(flat, chosen, weights)
        got = moe_deterministic.zaya_experts_forward(block.experts, None, flat, chosen, weights)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


#: (module, ingredient, dtype, case), measured at 2 threads.
POWER = [
    (moe_deterministic, "experts", torch.float32, hit_case),
    (hybrid_deterministic, "attention", torch.float32, hit_case),
    (hybrid_deterministic, "window", torch.float32, decode_vs_prefill_case),
    (mamba1_deterministic, "linear", torch.float32, hit_case),
]


@pytest.mark.parametrize("module, off, dtype, case", POWER,
                         ids=[f"{off}-{str(dtype)[6:]}-{case.__name__}" for _, off, dtype, case in POWER])
def test_each_ingredient_off_alone_breaks_a_case(monkeypatch, module, off, dtype, case):
    torch.set_num_threads(2)
    assert case(ZAYA, dtype)
    monkeypatch.setattr(module, "_OFF", {off})
    assert not case(ZAYA, dtype)


def test_with_the_mode_off_some_case_differs():
    mode_off_some_case_differs(ZAYA, torch.float32, cases=(decode_vs_prefill_case, engine_case, hit_case))


def test_refused_where_the_gelu_probe_fails(monkeypatch):
    """Where ``torch.erf`` gives an element other bits alone than in a tensor, the router's GELU has no invariant
    form: the mode refuses ZAYA at construction, naming it."""
    monkeypatch.setattr(zaya_deterministic, "_GELU_FAILURES", [3])
    with pytest.raises(ValueError, match="(?s)torch.erf gives 3 of 64.*deterministic=False"):
        HybridPrefixCache(toy(ZAYA), deterministic=True)
