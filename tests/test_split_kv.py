"""KV blocks whose keys and values differ in width (MLA layers: a latent as keys, a rope key as values), through the
public API: exact restores, byte accounting under a budget, and cache files (keys and values as two tensors)."""

import pytest
import torch
from conftest import KDA_FAMILIES, assert_matches_cold, assert_restored_states_match, random_ids
from safetensors import safe_open

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.config import AttentionLayerSpec
from hf_hybridcache.core import check_store, entry_digests
from hf_hybridcache.store.kv_store import KVStore
from hf_hybridcache.toy import build_model

#: family -> (latent width = keys, rope-key width = values) of the tiny configs.
WIDTHS = {"kimi_linear": (32, 8), "bailing_hybrid": (32, 16)}

MLA = pytest.mark.parametrize("family", KDA_FAMILIES)


def _warm(model, cold_model, **options):
    cache = HybridPrefixCache(model, retention_interval="dense", **options)
    for seed in (500, 501):
        assert_matches_cold(model, cold_model, cache, random_ids(70, seed=seed), new_tokens=4)
    return cache


@MLA
def test_spec_reads_the_mla_widths(family, model):
    spec = HybridPrefixCache(model).spec
    [attn] = spec.attention
    config = model.config
    assert (attn.num_kv_heads, attn.head_dim, attn.value_head_dim) == (1, config.kv_lora_rank, config.qk_rope_head_dim)
    assert (attn.head_dim, attn.value_head_dim) == WIDTHS[family]
    assert spec.kv_block_bytes == 16 * (attn.head_dim + attn.value_head_dim) * 4  # float32, block_size 16
    same_width = AttentionLayerSpec(0, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    assert same_width.value_head_dim == 8 and same_width.block_bytes(16) == 2 * 2 * 16 * 8 * 4


@MLA
def test_hit_restores_the_exact_latent_and_rope_key(family, model, cold_model):
    cache = _warm(model, cold_model)
    ids = torch.cat([random_ids(70, seed=500), random_ids(9, seed=502)], dim=1)
    assert_restored_states_match(cache, cold_model, ids, expected_hit=64)
    cache.restore(ids)
    [attn] = cache.spec.attention
    layer = cache.layers[attn.layer_idx]
    assert tuple(layer.keys.shape) == (1, 1, 64, WIDTHS[family][0])
    assert tuple(layer.values.shape) == (1, 1, 64, WIDTHS[family][1])
    cache.reset()
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [64]


@MLA
@pytest.mark.parametrize("half", ["keys", "values"])
def test_a_corrupted_latent_or_rope_key_fails_the_check(family, model, cold_model, monkeypatch, half):
    """Power: both halves of an MLA block reach the logits."""
    cache = _warm(model, cold_model)
    original = KVStore.gather

    def broken(self, layer_idx, block_ids, *args):
        keys, values = original(self, layer_idx, block_ids, *args)
        (keys if half == "keys" else values).zero_()  # in place: the restore keeps its room for the prompt's tail
        return keys, values

    monkeypatch.setattr(KVStore, "gather", broken)
    with pytest.raises(AssertionError):
        assert_matches_cold(model, cold_model, cache, random_ids(70, seed=500), new_tokens=4)
    assert cache.last_hit_tokens == [64]


@MLA
def test_stored_bytes_count_both_widths_and_stay_under_a_budget(family, model, cold_model):
    cache = _warm(model, cold_model)
    stats, spec = cache.stats, cache.spec
    assert stats.kv_bytes == stats.kv_blocks * spec.kv_block_bytes
    assert stats.checkpoint_bytes == stats.checkpoints * spec.checkpoint_bytes
    assert stats.stored_bytes == stats.kv_bytes + stats.checkpoint_bytes
    check_store(cache)  # stored_bytes equals the bytes of the stored tensors
    budget = 6 * spec.kv_block_bytes + 2 * spec.checkpoint_bytes
    cache.max_cache_bytes = budget
    for seed in (503, 504):
        assert_matches_cold(model, cold_model, cache, random_ids(70, seed=seed), new_tokens=4)
        check_store(cache)
        assert cache.stored_bytes <= budget
    assert cache.stats.evicted_kv_blocks > 0


@MLA
def test_cache_file_round_trip(family, model, cold_model, tmp_path):
    cache = _warm(model, cold_model)
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    [attn] = cache.spec.attention
    num_blocks = cache.stats.kv_blocks
    with safe_open(path, framework="pt") as f:
        keys, values = f.get_tensor(f"keys.{attn.layer_idx}"), f.get_tensor(f"values.{attn.layer_idx}")
    assert tuple(keys.shape) == (num_blocks, 1, 16, WIDTHS[family][0])
    assert tuple(values.shape) == (num_blocks, 1, 16, WIDTHS[family][1])

    fresh = build_model(family, seed=0)
    loaded = HybridPrefixCache.load(path, fresh)
    assert entry_digests(loaded) == entry_digests(cache)
    assert loaded.stored_bytes == cache.stored_bytes
    check_store(loaded)
    ids = torch.cat([random_ids(70, seed=501), random_ids(9, seed=505)], dim=1)
    assert_restored_states_match(loaded, cold_model, ids, expected_hit=64)
    assert_matches_cold(fresh, cold_model, loaded, ids)
    assert loaded.last_hit_tokens == [64]
