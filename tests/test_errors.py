"""Bad input gets a clear ValueError, and the cache keeps working afterwards."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import assert_matches_cold, greedy, random_ids
from hf_hybridcache import DEFAULT_MAX_CACHE_BYTES, HybridPrefixCache
from hf_hybridcache.toy import build_model


def test_unsupported_model_names_the_supported_families():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="Supported families: .*jamba"):
        HybridPrefixCache(llama)
    with pytest.raises(ValueError, match="Supported families"):
        HybridPrefixCache(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=0), "block_size"),
        (dict(block_size=-16), "block_size"),
        (dict(block_size=8.0), "block_size"),
        (dict(block_size=True), "block_size"),
        (dict(retention_interval=7), "multiple of block_size=16"),
        (dict(retention_interval=-16), "retention_interval"),
        (dict(retention_interval="sparse"), "retention_interval"),
        (dict(retention_interval=1.5), "retention_interval"),
        (dict(max_cache_bytes=0), "max_cache_bytes"),
        (dict(max_cache_bytes=-1), "max_cache_bytes"),
        (dict(max_cache_bytes=1.5e9), "max_cache_bytes"),
        (dict(max_cache_bytes=1000), "cannot hold one KV block plus one checkpoint"),
    ],
)
def test_invalid_options(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        HybridPrefixCache(model, **kwargs)


def test_defaults(model):
    cache = HybridPrefixCache(model)
    assert (cache.block_size, cache.options.retention_interval, cache.max_cache_bytes) == (16, 0, DEFAULT_MAX_CACHE_BYTES)
    assert HybridPrefixCache(model, block_size=4, retention_interval=8).options.retention_tokens == 8


def test_cache_passed_to_another_model_raises_and_keeps_working(model, cold_model, family):
    cache = HybridPrefixCache(model)
    ids = random_ids(60, seed=90)
    assert_matches_cold(model, cold_model, cache, ids)
    other = build_model(family, seed=0)
    with pytest.raises(ValueError, match="one HybridPrefixCache per model"):
        other.generate(ids, past_key_values=cache, max_new_tokens=4)  # an unpatched model
    HybridPrefixCache(other)
    with pytest.raises(ValueError, match="one HybridPrefixCache per model"):
        other.generate(ids, past_key_values=cache, max_new_tokens=4)  # a model patched by its own cache
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [48]


def test_inputs_embeds_only_runs_without_reuse(model, cold_model):
    cache = HybridPrefixCache(model)
    ids = random_ids(60, seed=91)
    assert_matches_cold(model, cold_model, cache, ids)
    embeds = model.get_input_embeddings()(ids).detach()
    kwargs = dict(inputs_embeds=embeds, max_new_tokens=8, do_sample=False)
    try:
        ref = cold_model.generate(**kwargs)
    except ValueError as refusal:  # Zamba, Zamba2, Falcon-H1, Bamba, NemotronH: generate() refuses inputs_embeds
        with pytest.raises(ValueError, match="inputs_embeds"):
            model.generate(past_key_values=cache, **kwargs)
        assert "inputs_embeds" in str(refusal)
    else:
        assert torch.equal(model.generate(past_key_values=cache, **kwargs), ref)
        assert cache.last_hit_tokens == [0]
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [48]


def test_padding_in_the_middle_runs_without_reuse(model, cold_model):
    cache = HybridPrefixCache(model)
    ids = random_ids(60, seed=92)
    assert_matches_cold(model, cold_model, cache, ids)
    batch = torch.cat([ids, random_ids(60, seed=93)])
    mask = torch.ones_like(batch)
    mask[1, 20:25] = 0  # not left padding: no exact reuse is possible
    out, logits = greedy(model, batch, cache, attention_mask=mask)
    ref, ref_logits = greedy(cold_model, batch, attention_mask=mask)
    assert torch.equal(out, ref)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    assert cache.last_hit_tokens == [0, 0]
    assert cache.stats.prompt_tokens == 60 + 60 + 55
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [48]
