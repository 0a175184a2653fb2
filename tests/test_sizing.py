"""hf_hybridcache.sizes: the bytes of one KV block, one checkpoint and one cached token, and a budget suggestion."""

import pytest
import torch
from conftest import greedy, random_ids
from transformers import AutoModelForCausalLM

import hf_hybridcache
from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.toy import build_model, tiny_config


def test_sizes_of_the_tiny_jamba_by_hand():
    # One attention layer (2 kv heads of 16 dims) and three Mamba-1 layers (128 channels, conv width 4, state 16).
    sizes = hf_hybridcache.sizes(build_model("jamba"))
    assert (sizes.num_attention_layers, sizes.num_state_layers, sizes.block_size) == (1, 3, 16)
    assert sizes.kv_block_bytes == 2 * 16 * (16 + 16) * 4  # kv heads x tokens x (key + value dims) x fp32 bytes
    assert sizes.kv_bytes_per_token == 256
    assert sizes.checkpoint_bytes == 3 * (128 * 4 * 4 + 128 * 16 * 4)  # conv [128, 4] + SSM [128, 16], fp32
    # 10 prefixes of 100 tokens: 6 full blocks and 3 checkpoints each.
    assert sizes.suggest_budget(10, 100) == 10 * (6 * 4096 + 3 * 30720) == 1_167_360
    assert sizes.suggest_budget(10, 100, checkpoints_per_prefix=100 // 16) == 10 * 6 * (4096 + 30720)
    assert str(sizes) == (
        "KV block of 16 tokens: 4.00 KiB over 1 attention layers (256 bytes per token); checkpoint: 30.00 KiB over 3 "
        "state layers; the default budget of 2.00 GiB holds 69,905 checkpoints"
    )


def test_bf16_keeps_the_ssm_state_in_fp32_and_a_meta_model_needs_no_weights():
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("jamba"), dtype=torch.bfloat16)
    sizes = hf_hybridcache.sizes(model, block_size=32)
    assert sizes.kv_block_bytes == 2 * 32 * (16 + 16) * 2
    assert sizes.kv_bytes_per_token == 128
    assert sizes.checkpoint_bytes == 3 * (128 * 4 * 2 + 128 * 16 * 4)  # bf16 conv window, fp32 SSM state


def test_sizes_are_the_bytes_the_cache_stores():
    model = build_model("jamba")
    cache = HybridPrefixCache(model, retention_interval="dense")
    greedy(model, random_ids(70, seed=500), cache, new_tokens=2)
    sizes, stats = hf_hybridcache.sizes(model), cache.stats
    assert (stats.kv_blocks, stats.checkpoints) == (4, 4)
    assert stats.kv_bytes == 4 * sizes.kv_block_bytes and stats.checkpoint_bytes == 4 * sizes.checkpoint_bytes


def test_a_budget_too_small_names_the_sizing_helper():
    with pytest.raises(ValueError, match=r"hf_hybridcache.sizes\(model\).suggest_budget"):
        HybridPrefixCache(build_model("jamba"), max_cache_bytes=1000)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda model: hf_hybridcache.sizes(model, block_size=0), "block_size"),
        (lambda model: hf_hybridcache.sizes(torch.nn.Linear(2, 2)), "does not support Linear"),
        (lambda model: hf_hybridcache.sizes(model).suggest_budget(-1, 100), "num_prefixes"),
        (lambda model: hf_hybridcache.sizes(model).suggest_budget(1, 1.5), "prefix_tokens"),
        (lambda model: hf_hybridcache.sizes(model).suggest_budget(0, 2_000), "holds nothing"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call(build_model("jamba"))
