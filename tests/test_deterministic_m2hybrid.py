"""deterministic=True on the Mamba-2 hybrids (issue 46): Bamba, GraniteMoeHybrid (Granite 4.0-H, dense MLPs, with its
embedding / residual / attention / logits multipliers off 1.0), Nemotron-H (Mamba-2, attention and relu2-MLP
layers) and Zamba2 (a shared attention + GELU MLP block with LoRA adapters, RoPE). Their mixers are upstream Zamba2's plain Mamba-2 mixer, run by models/mamba2_deterministic.py; attention
and MLPs go through models/hybrid_deterministic.py. deterministic_bank.py's cases, in float32 and bfloat16: a
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
- the mode off: every case differs in float32; decoded tokens and the engine in bfloat16.
"""

import pytest
import torch
import torch.nn.functional as F
from deterministic_bank import (
    decode_vs_prefill_case,
    engine_case,
    engine_requests_equal_generate_alone,
    hit_case,
    hits_equal_cold,
    identical_prompt_and_decoded_tokens,
    ingredient_off_breaks,
    mode_is_the_model,
    mode_off_some_case_differs,
)
from transformers.activations import ACT2FN

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.models import hybrid_deterministic, mamba2_deterministic
from hf_hybridcache.toy import build_model


@pytest.fixture(params=["bamba", "granitemoehybrid", "nemotron_h", "zamba2"])
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
    """Within round-off of a plain forward, Granite's multipliers included."""
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


@pytest.mark.parametrize("family, off", [("bamba", "activation"), ("zamba2", "activation"), ("zamba2", "contiguous")])
def test_the_mlp_activation_off_breaks_decoded_tokens(monkeypatch, family, off):
    """Bamba's SiLU as F.silu, Zamba2's GELU as upstream's, or Zamba2's float32 GELU on its strided input: a decoded
    token's float32 logits differ from the same position prefilled."""
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


@pytest.mark.parametrize("family, overrides", [
    ("granitemoehybrid", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("nemotron_h", dict(layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention"])),
], ids=["granite-experts", "nemotron-moe"])
def test_routed_experts_are_refused(family, overrides):
    model = build_model(family, seed=0, **overrides)
    with pytest.raises(ValueError, match="(?s)routed experts.*deterministic=False"):
        HybridPrefixCache(model, deterministic=True)
    HybridPrefixCache(model)  # nothing was patched: the default mode still builds
