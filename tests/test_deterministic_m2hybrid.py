"""deterministic=True on the Mamba-2 hybrids (issue 46): Bamba, GraniteMoeHybrid (Granite 4.0-H, dense MLPs, with its
embedding / residual / attention / logits multipliers off 1.0; and with routed experts), Nemotron-H (Mamba-2,
attention and relu2-MLP layers; and with a "moe" layer: a grouped sigmoid router, relu2 experts, shared experts),
Zamba2 (a shared attention + GELU MLP block with LoRA adapters, RoPE) and Falcon-H1 (attention and a Mamba-2 mixer
side by side in every layer, with µP multipliers off 1.0). Their mixers are upstream Zamba2's plain Mamba-2 mixer
(Falcon-H1's with its projection multipliers and gate as hooks), run by models/mamba2_deterministic.py; attention
and MLPs go through models/hybrid_deterministic.py, routed experts through models/moe_deterministic.py.
deterministic_bank.py's cases, in float32 and bfloat16: a
request's tokens and logits / logprobs are the same bits cold and after hits of several lengths, decoded or
prefilled, and among 1-8 other requests in the engine at prefill chunks of 16, 48 and 512 tokens vs generate() alone
(float16: hits, decoded tokens and the engine at chunks of 48).

Power (each ingredient switched off alone through the private ``_OFF`` sets, or the mode off; the toys' MLPs are
104 wide, off the CPU's vector width; measured at the suite's thread count on the 2-core AVX-512 CPU, torch 2.13):

- the invariant attention: decoded tokens (fp32) and the engine (fp32, bf16) differ, every family;
- the per-token scan: fp32 hits, decoded tokens differ (every family); bf16 decoded tokens;
- the row-invariant linear: fp32 decoded tokens and the engine differ;
- the invariant SiLU: Bamba's fp32 decoded tokens and engine differ (Granite's MLP shows nothing on this bank);
- Zamba2's GELU: upstream's, or float32 F.gelu on the strided chunk of gate_up_proj's output it gets, moves an fp32
  decoded token (the mode makes it contiguous first);
- Nemotron-H's relu2 runs as upstream: relu is exact and its square one correctly rounded product, the same bits at
  any offset in every dtype (measured below, with F.silu's float32 offset dependence as the probe's power);
- the routed experts as upstream's experts module (F.linear per expert's rows, summed in expert order): every fp32
  case differs, Granite's and Nemotron-H's; Nemotron-H's router's sigmoid as torch.sigmoid (its 12 expert scores per
  token off the vector width): the fp32 engine (Granite's softmax over its k chosen logits moves no case: torch's
  last-dim softmax runs each row alone);
- Falcon-H1's SiLU in the MLPs: an fp32 decoded token and the engine; its gate's F.silu (with or without the gated
  norm) moves no case of this bank;
- the mode off: every case differs in float32; decoded tokens and the engine in bfloat16.
"""

import pytest
import torch
import torch.nn.functional as F
from deterministic_bank import (
    BASE,
    decode_vs_prefill_case,
    engine_case,
    engine_requests_equal_generate_alone,
    hit_case,
    hits_equal_cold,
    identical_prompt_and_decoded_tokens,
    ingredient_off_breaks,
    mode_is_the_model,
    mode_off_some_case_differs,
    run,
)
from test_deterministic import OVERRIDES, VARIANTS
from transformers.activations import ACT2FN

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.models import hybrid_deterministic, mamba2_deterministic, moe_deterministic
from hf_hybridcache.toy import build_model

FAMILIES = ["bamba", "granitemoehybrid", "nemotron_h", "zamba2", "granitemoehybrid-moe", "nemotron_h-moe", "falcon_h1"]


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    return request.param


@pytest.mark.parametrize("length", [17, 64, 89])
def test_hits_of_several_lengths_equal_cold_bit_for_bit(family, dtype, length):
    hits_equal_cold(family, dtype, length)


def test_identical_prompt_and_decoded_tokens_equal_cold_and_prefilled(family, dtype):
    identical_prompt_and_decoded_tokens(family, dtype)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_engine_requests_equal_generate_alone_in_any_batch(family, dtype, max_batch_tokens):
    engine_requests_equal_generate_alone(family, dtype, max_batch_tokens)


def test_float16_hits_decoded_tokens_and_engine_equal_cold_and_alone(family):
    identical_prompt_and_decoded_tokens(family, torch.float16)
    assert engine_case(family, torch.float16, max_batch_tokens=48)


def test_the_mode_is_the_model_within_round_off(family):
    """Within round-off of a plain forward, Granite's and Falcon-H1's multipliers and the routed experts included."""
    mode_is_the_model(family)


@pytest.mark.parametrize("module, off, dtype, case", [
    (hybrid_deterministic, "attention", torch.float32, decode_vs_prefill_case),
    (hybrid_deterministic, "attention", torch.bfloat16, engine_case),
    (mamba2_deterministic, "scan", torch.float32, hit_case),
    (mamba2_deterministic, "scan", torch.bfloat16, decode_vs_prefill_case),
    (mamba2_deterministic, "linear", torch.float32, engine_case),
], ids=["attention-fp32-decode", "attention-bf16-engine", "scan-fp32-hit", "scan-bf16-decode", "linear-fp32-engine"])
def test_each_ingredient_off_alone_breaks_a_case(monkeypatch, family, module, off, dtype, case):
    ingredient_off_breaks(monkeypatch, module, off, case, family, dtype)


@pytest.mark.parametrize("family, off", [("bamba", "activation"), ("zamba2", "activation"), ("zamba2", "contiguous"),
                                         ("falcon_h1", "activation")])
def test_the_mlp_activation_off_breaks_decoded_tokens(monkeypatch, family, off):
    """Bamba's and Falcon-H1's SiLU as F.silu, Zamba2's GELU as upstream's, or Zamba2's float32 GELU on its strided
    input: a decoded token's float32 logits differ from the same position prefilled."""
    ingredient_off_breaks(monkeypatch, hybrid_deterministic, off, decode_vs_prefill_case, family, torch.float32)


def test_with_the_mode_off_some_case_differs(family, dtype):
    mode_off_some_case_differs(family, dtype)


def _offset_differences(activation, dtype) -> int:
    torch.manual_seed(0)
    x = (torch.randn(4099) * 3).to(dtype)
    full = activation(x)
    return sum(not torch.equal(activation(x[o:o + 37]), full[o:o + 37]) for o in range(1, 40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_relu2_gives_an_element_the_same_bits_at_any_offset(dtype):
    """Nemotron-H's MLP activation runs unpatched: ACT2FN["relu2"] gives an element the same bits wherever it sits
    in the tensor, where the same probe sees float32 F.silu move (its vectorized body and scalar tail differ)."""
    assert _offset_differences(ACT2FN["relu2"], dtype) == 0
    assert _offset_differences(F.silu, torch.float32) > 0


@pytest.mark.parametrize("family, off, case", [
    ("granitemoehybrid-moe", "experts", hit_case),
    ("nemotron_h-moe", "experts", hit_case),
    ("nemotron_h-moe", "router", engine_case),
], ids=["granite-experts-hit", "nemotron-experts-hit", "nemotron-router-engine"])
def test_the_routed_experts_or_router_off_breaks_a_case(monkeypatch, family, off, case):
    """The routed experts as upstream's experts module runs them, or Nemotron-H's router's sigmoid as torch.sigmoid:
    a float32 case differs."""
    assert case(family, torch.float32)
    monkeypatch.setattr(moe_deterministic, "_OFF", {off})
    assert not case(family, torch.float32)


def _block(family, name, **overrides):
    base, settings = VARIANTS[family]
    model = build_model(base, seed=0, **{**settings, **overrides})
    block = next(m for m in model.modules() if type(m).__name__ == name)
    torch.manual_seed(1)
    if hasattr(block, "gate"):  # Nemotron-H: a correction bias that moves the choice
        block.gate.e_score_correction_bias.copy_(torch.randn(block.gate.num_experts) * 0.05)
    return block, (torch.randn(2, 9, block.experts.hidden_dim) * 2)


@pytest.mark.parametrize("overrides", [
    dict(), dict(n_group=1, topk_group=1), dict(n_group=4, topk_group=2, num_experts_per_tok=3),
    dict(norm_topk_prob=False), dict(moe_latent_size=24),
], ids=["2-groups", "1-group", "4-groups-top-2", "unnormalized", "latent"])
def test_nemotron_experts_block_is_upstreams_within_round_off(overrides):
    """Nemotron-H's router chooses the experts upstream's does (groups, correction bias) and the block's output is
    upstream's within float32 round-off."""
    block, x = _block("nemotron_h-moe", "NemotronHMoE", **overrides)
    with torch.no_grad():
        _, _, upstream_chosen = block.gate(x)
        weights, chosen = moe_deterministic.nemotron_route(block.gate, x.reshape(-1, x.shape[-1]))
        assert torch.equal(chosen.sort(-1).values, upstream_chosen.sort(-1).values)
        expected = type(block).forward(block, x)
        torch.testing.assert_close(moe_deterministic.nemotron_moe_forward(block, None, x), expected, atol=1e-5, rtol=0)


def test_granite_experts_block_is_upstreams_within_round_off():
    block, x = _block("granitemoehybrid-moe", "GraniteMoeHybridMoE")
    with torch.no_grad():
        expected = type(block).forward(block, x)
        torch.testing.assert_close(moe_deterministic.granite_moe_forward(block, None, x), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides", [dict(mamba_rms_norm=True), dict(mamba_rms_norm=True,
                                                                       mamba_norm_before_gate=False)],
                         ids=["norm-after-gate", "norm-before-gate"])
def test_falcon_h1_gated_norm_is_upstreams_within_round_off(overrides):
    """Falcon-H1's gated RMS norm (per group, gate before or after the norm) through the invariant forms: the float32
    logits are a plain forward's within round-off (the bank's toy gates with silu(gate), no norm)."""
    settings = dict(OVERRIDES["falcon_h1"], **overrides)
    model, plain = (build_model("falcon_h1", seed=0, **settings) for _ in range(2))
    _, logits = run(model, HybridPrefixCache(model, deterministic=True), BASE[:40], new_tokens=1)
    with torch.no_grad():
        expected = plain(torch.tensor([BASE[:40]])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_falcon_h1_multipliers_give_an_element_the_same_bits_at_any_offset(dtype):
    """Falcon-H1's µP multipliers run as upstream: a scalar or an elementwise vector product is one correctly rounded
    product per element, the same bits wherever the element sits in the tensor."""
    assert _offset_differences(lambda x: x * 1.3, dtype) == 0
    torch.manual_seed(0)
    x, vector = (torch.randn(4099) * 3).to(dtype), (torch.rand(4099) + 0.5).to(dtype)
    full = x * vector
    assert all(torch.equal(x[o:o + 37] * vector[o:o + 37], full[o:o + 37]) for o in range(1, 40))


def test_falcon_h1_with_another_conv_activation_is_refused():
    """Falcon-H1's mixer conv runs hidden_act, which has an invariant form there for SiLU only."""
    model = build_model("falcon_h1", seed=0, hidden_act="gelu")
    with pytest.raises(ValueError, match="(?s)hidden_act='gelu'.*mixer's conv.*deterministic=False"):
        HybridPrefixCache(model, deterministic=True)


@pytest.mark.parametrize("family, overrides", [("bamba", dict(hidden_act="gelu")),
                                               ("nemotron_h", dict(mamba_hidden_act="gelu"))])
def test_a_mamba_conv_activation_other_than_silu_is_refused_at_construction(family, overrides):
    """Regression: these configs were accepted and their first forward raised from the invariant conv; they are
    refused when the cache is built, before anything is patched."""
    model = build_model(family, seed=0, **overrides)
    with pytest.raises(ValueError, match="(?s)conv runs 'gelu'.*deterministic=False"):
        HybridPrefixCache(model, deterministic=True)
    HybridPrefixCache(model)  # nothing was patched: the default mode still builds
