"""deterministic=True on the pure Mamba-1 families (issue 46): a request's tokens and logits / logprobs are the same
bits cold and after hits of several lengths (block boundaries, dense checkpoints), with a reply replayed in a chat,
decoded or prefilled, alone in generate() or among 1-8 other requests in the engine at several prefill chunk sizes
(and in speculative steps); in float32, bfloat16 and float16, on long-memory models (DESIGN.md's test doctrine). Every other family and every machine or
model the guarantee cannot hold for is refused at construction.

Power (each ingredient switched off alone through the private ``mamba1_deterministic._OFF``, or the mode off; measured
on the 2-core AVX-512 CPU, torch 2.13 with MKL; docs/deterministic.md has the table):

- the row-invariant linear: float32 hits differ from cold at 2 intra-op threads (a 1-row decode product against a
  multi-row prefill; at the suite's 1 thread MKL happened to sum both alike at these sizes);
- the invariant conv: a decoded token's logits differ from the same token prefilled, in float32 and bfloat16;
- the per-token scan: the same in float32 (bfloat16: no case of this bank differs);
- the mode off: the engine's logprobs differ from generate()'s in float32 and bfloat16.
"""

import pytest
import torch
from deterministic_bank import (  # noqa: F401 (family files written before the bank import these from here)
    BASE,
    GREEDY,
    PROMPTS,
    chat_with_the_reply_replayed,
    cold,
    decode_vs_prefill_case,
    engine_case,
    engine_outputs,
    engine_requests_equal_generate_alone,
    engine_requests_hit_each_others_prefix,
    hit_case,
    hits_equal_cold,
    identical_prompt_and_decoded_tokens,
    ingredient_off_breaks,
    logprobs,
    mode_off_some_case_differs,
    padded_batch_rows_equal_each_alone,
    run,
    speculative_case,
)

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.kernels import batch_invariant
from hf_hybridcache.models import mamba1_deterministic
from hf_hybridcache.toy import build_model


@pytest.fixture(params=["mamba", "falcon_mamba"])
def family(request):
    return request.param


@pytest.fixture(params=[torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def dtype(request):
    return request.param


#: Config overrides of a family's toy in this bank: Jamba with routed experts (its toy has one MLP per layer); Qwen3.5,
#: Bamba, Granite 4.0-H and Nemotron-H with widths off the CPU's vector width (an MLP of 104, 3 attention heads of 16,
#: value heads of 20), so that F.silu and torch.sigmoid meet a vectorized loop's scalar tail and the power tests can
#: see them; Granite with its checkpoints' kind of multipliers (its toy's are 1.0), so one lost on a path moves bits;
#: LFM2 and LFM2-MoE likewise, with their conv, in_proj and out_proj biases on (``conv_bias``).
OVERRIDES = {"jamba": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=104),
             "qwen3_5_text": dict(intermediate_size=104, num_attention_heads=3, num_key_value_heads=1,
                                  linear_value_head_dim=20),
             "qwen3_5_moe_text": dict(moe_intermediate_size=56, shared_expert_intermediate_size=104,
                                      num_attention_heads=3, num_key_value_heads=1, linear_value_head_dim=20),
             "lfm2": dict(intermediate_size=104, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                          conv_bias=True),
             "lfm2_moe": dict(intermediate_size=104, moe_intermediate_size=56, num_attention_heads=3,
                              num_key_value_heads=1, head_dim=16, conv_bias=True),
             "lfm3": dict(intermediate_size=104, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                          conv_bias=True, attention_bias=True),
             "inkling_text": dict(intermediate_size=104, log_scaling_n_floor=8),
             # Inkling 2 (test_deterministic_inkling2.py): experts of 56, block residuals every 2 layers
             "inkling2_text": dict(moe_intermediate_size=56, log_scaling_n_floor=8, n_layers_per_attn_res_block=2,
                                   num_attention_heads=3, num_key_value_heads=1, head_dim=24,
                                   swa_num_attention_heads=3, swa_num_key_value_heads=1, swa_head_dim=24, d_rel=6),
             "inkling2_loop_text": dict(moe_intermediate_size=56, log_scaling_n_floor=8, num_attention_heads=3,
                                        num_key_value_heads=1, head_dim=24, swa_num_attention_heads=3,
                                        swa_num_key_value_heads=1, swa_head_dim=24, d_rel=6),
             "qwen3_next": dict(moe_intermediate_size=56, shared_expert_intermediate_size=104,
                                num_attention_heads=3, num_key_value_heads=1, linear_value_head_dim=20),
             "bamba": dict(intermediate_size=104),
             "granitemoehybrid": dict(shared_intermediate_size=104, embedding_multiplier=12.0,
                                      residual_multiplier=0.22, attention_multiplier=0.125, logits_scaling=4.0),
             "nemotron_h": dict(intermediate_size=104),  # Zamba2's own toy: its GELU's strided input is the case
             "olmo_hybrid": dict(intermediate_size=104, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                                 linear_value_head_dim=20),
             "lara_mini": dict(moe_intermediate_size=56, shared_expert_intermediate_size=104, num_attention_heads=3,
                               num_key_value_heads=1, linear_value_head_dim=20),
             # Kimi Linear / Ling (test_deterministic_kda.py): 3 MLA heads, KDA heads of 20, Ling's SwiGLUs clipped
             "kimi_linear": dict(intermediate_size=104, moe_intermediate_size=56, num_attention_heads=3,
                                 num_key_value_heads=3, linear_head_dim=20),
             "bailing_hybrid": dict(intermediate_size=104, moe_intermediate_size=56, num_attention_heads=3,
                                    num_key_value_heads=3, head_dim=20, swiglu_limits=[0, 2.0, 2.0, 2.0],
                                    swiglu_limits_shared=[0, 2.0, 2.0, 2.0]),
             "falcon_h1": dict(intermediate_size=104, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                               key_multiplier=0.7, attention_in_multiplier=1.3, attention_out_multiplier=0.9,
                               ssm_out_multiplier=1.1, mlp_multipliers=[0.8, 1.2], embedding_multiplier=3.0,
                               lm_head_multiplier=0.5),
             # ZAYA (test_deterministic_zaya.py): a router and experts off the vector width
             "zaya": dict(router_hidden_size=20, moe_intermediate_size=56)}
#: Bank names of a family's toy with other settings: name -> (family, config overrides). Granite 4.0-H and Nemotron-H
#: with routed experts (4 of 56, top 2; Nemotron-H's 12 in 2 groups, the best group chosen, scaled by 2.5); Inkling with
#: routed experts on two layers (4 of 56, top 2, two shared experts weighted by their gammas, its route_scale 8).
VARIANTS = {"granitemoehybrid-moe": ("granitemoehybrid", dict(OVERRIDES["granitemoehybrid"], num_local_experts=4,
                                                              num_experts_per_tok=2, intermediate_size=56)),
            "nemotron_h-moe": ("nemotron_h", dict(
                OVERRIDES["nemotron_h"], layers_block_type=["linear_attention", "moe", "full_attention",
                                                            "linear_attention"],
                n_routed_experts=12, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=56,
                moe_shared_expert_intermediate_size=104, routed_scaling_factor=2.5)),
            "inkling_text-moe": ("inkling_text", dict(OVERRIDES["inkling_text"], moe_intermediate_size=56,
                                                      mlp_layer_types=["dense", "sparse", "dense", "sparse"]))}


def toy(name, dtype=torch.float32):
    """The bank's toy of ``name`` (a family, or one of :data:`VARIANTS`)."""
    family, overrides = VARIANTS.get(name, (name, OVERRIDES.get(name, {})))
    return build_model(family, seed=0, dtype=dtype, **overrides)


def fresh(family, dtype, deterministic=True, **kwargs):
    model = toy(family, dtype)
    return model, HybridPrefixCache(model, deterministic=deterministic, retention_interval="dense", **kwargs)


@pytest.mark.parametrize("length", [16, 17, 47, 64, 89])
def test_hits_of_several_lengths_equal_cold_bit_for_bit(family, dtype, length):
    hits_equal_cold(family, dtype, length)


def test_identical_prompt_and_decoded_tokens_equal_cold_and_prefilled(family, dtype):
    identical_prompt_and_decoded_tokens(family, dtype)


def test_chat_turn_with_the_reply_replayed_equals_cold(family, dtype):
    chat_with_the_reply_replayed(family, dtype, turns=3)


def test_padded_generate_batch_rows_equal_each_alone(family, dtype):
    """Each row of a left-padded generate() batch of 3 prompts equals that prompt alone."""
    padded_batch_rows_equal_each_alone(family, dtype)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
@pytest.mark.parametrize("threads", [1, 2])
def test_engine_requests_equal_generate_alone_in_any_batch(family, dtype, max_batch_tokens, threads):
    """The engine's tokens and logprobs for 1, 3 and 8 concurrent requests equal each one alone in generate()."""
    torch.set_num_threads(threads)
    engine_requests_equal_generate_alone(family, dtype, max_batch_tokens)


def test_speculative_engine_steps_equal_generate_alone(dtype):
    speculative_case("mamba", dtype)


def test_engine_requests_hit_each_others_prefix(family):
    engine_requests_hit_each_others_prefix(family)


@pytest.mark.parametrize("off, dtype, case", [
    ("linear", torch.float32, hit_case),
    ("conv", torch.float32, decode_vs_prefill_case),
    ("conv", torch.bfloat16, decode_vs_prefill_case),
    ("scan", torch.float32, decode_vs_prefill_case),
], ids=["linear-fp32-hit", "conv-fp32-decode", "conv-bf16-decode", "scan-fp32-decode"])
def test_each_ingredient_off_alone_breaks_a_case(monkeypatch, off, dtype, case):
    torch.set_num_threads(2)  # MKL's float32 1-row product sums in another order at 2 threads (the suite runs 1)
    ingredient_off_breaks(monkeypatch, mamba1_deterministic, off, case, "mamba", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_with_the_mode_off_some_case_differs(dtype):
    """The bank has power against the default mode in each dtype. Which case shows it depends on the release: on
    transformers 5.23 the bf16 engine and generate() happen to agree on this bank, a decode step and a prefill do
    not."""
    mode_off_some_case_differs("mamba", dtype, cases=(engine_case, decode_vs_prefill_case, hit_case))


def test_invalid_combinations_are_refused(monkeypatch):
    model = build_model("mamba", seed=0)
    model.backbone.norm_f._kernel_repo = "kernels-community/rmsnorm"  # what `kernels` leaves on a swapped module
    with pytest.raises(ValueError, match="Hub kernels are swapped in"):
        HybridPrefixCache(model, deterministic=True)
    with pytest.raises(ValueError, match="on CPU in float32, bfloat16 and float16 only"):
        HybridPrefixCache(build_model("mamba", seed=0, dtype=torch.float64), deterministic=True)
    monkeypatch.setattr(batch_invariant, "_CHECKED", set())
    monkeypatch.setattr(batch_invariant, "row_invariance_failures", lambda weight, bias=None: [1, 2, 3])
    with pytest.raises(ValueError, match=r"sums a row differently at \[1, 2, 3\] rows"):
        HybridPrefixCache(build_model("mamba", seed=0), deterministic=True)
    monkeypatch.undo()
    model = build_model("mamba", seed=0)
    HybridPrefixCache(model)
    with pytest.raises(ValueError, match="one model instance runs one mode"):
        HybridPrefixCache(model, deterministic=True)


def test_deterministic_takes_a_bool_and_a_deepcopy_carries_the_mode():
    """``deterministic="no"`` turned the mode on for Mamba (a truthy string) and was refused on Jamba as if True was
    asked for; the refusal of a second mode no longer suggests a deepcopy, which carries the instance's mode."""
    import copy

    for value in ("no", 1, None):
        with pytest.raises(TypeError, match="deterministic must be True or False"):
            HybridPrefixCache(build_model("mamba", seed=0), deterministic=value)
    model = build_model("mamba", seed=0)
    HybridPrefixCache(model, deterministic=True)
    with pytest.raises(ValueError, match="a copy.deepcopy of this one carries its mode"):
        HybridPrefixCache(copy.deepcopy(model))
