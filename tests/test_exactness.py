"""Cached generation equals cold generation (tokens, first-step logits, restored states) in every scenario."""

import pytest
import torch
from conftest import assert_matches_cold, assert_restored_states_match, random_ids

from hf_hybridcache import HybridPrefixCache


@pytest.fixture(autouse=True, params=["flop_aware", "lru"])
def eviction(request, monkeypatch):
    """Every scenario runs under both eviction policies: the default a cache is built with is switched."""
    monkeypatch.setitem(HybridPrefixCache.__init__.__kwdefaults__, "eviction", request.param)
    return request.param


@pytest.mark.parametrize("length,expected_hit", [(100, 96), (96, 80), (17, 16), (16, 0)])
def test_same_prompt_twice(model, cold_model, length, expected_hit):
    cache = HybridPrefixCache(model)
    ids = random_ids(length, seed=1)
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [0]
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [expected_hit]
    if expected_hit:
        assert_restored_states_match(cache, cold_model, ids, expected_hit)


@pytest.mark.parametrize("shared,expected_hit", [(63, 48), (64, 64), (65, 64)])
def test_shared_prefix_with_different_suffixes(model, cold_model, shared, expected_hit):
    """Prefixes ending one before, exactly on and one after a block boundary."""
    cache = HybridPrefixCache(model, retention_interval="dense")
    trunk = random_ids(shared, seed=2)
    first = torch.cat([trunk, random_ids(20, seed=3)], dim=1)
    second = torch.cat([trunk, random_ids(20, seed=4)], dim=1)
    assert_matches_cold(model, cold_model, cache, first)
    assert_restored_states_match(cache, cold_model, second, expected_hit)
    assert_matches_cold(model, cold_model, cache, second)
    assert cache.last_hit_tokens == [expected_hit]


@pytest.mark.parametrize("suffix", [1, 2, 3])
def test_suffix_shorter_than_the_conv_width(model, cold_model, suffix):
    cache = HybridPrefixCache(model)
    trunk = random_ids(96, seed=5)
    assert_matches_cold(model, cold_model, cache, trunk)
    ids = torch.cat([trunk, random_ids(suffix, seed=6)], dim=1)
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [96]


@pytest.mark.parametrize("retention,expected_hit", [("dense", 80), (32, 64), (48, 48), (0, 0)])
def test_retention_interval(model, cold_model, retention, expected_hit):
    cache = HybridPrefixCache(model, retention_interval=retention)
    trunk = random_ids(90, seed=7)
    assert_matches_cold(model, cold_model, cache, torch.cat([trunk, random_ids(60, seed=8)], dim=1))
    second = torch.cat([trunk, random_ids(30, seed=9)], dim=1)
    if expected_hit:
        assert_restored_states_match(cache, cold_model, second, expected_hit)
    assert_matches_cold(model, cold_model, cache, second)
    assert cache.last_hit_tokens == [expected_hit]


def test_dropped_checkpoint_backs_off_while_its_kv_stays(model, cold_model):
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(130, seed=10)
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
    store = cache.store
    chain = store.lookup(ids[0].tolist()).block_ids  # 128 tokens: 8 blocks, checkpoint at 128
    kv_blocks = store.num_kv_blocks
    store.drop_checkpoint(chain[-1])
    store.drop_checkpoint(chain[-2])
    assert store.num_kv_blocks == kv_blocks
    assert_restored_states_match(cache, cold_model, ids, 96)
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [96]


CHURN_HITS = {
    # LRU under a budget of four checkpoints: dense retention of one trunk evicts the other trunk.
    "lru": [0, 32, 0, 0, 32, 0, 64, 0, 0, 0],
    # FLOP-aware keeps the deep checkpoints (64 and 32 tokens saved) over the newer shallow ones.
    "flop_aware": [0, 32, 0, 0, 32, 64, 64, 32, 64, 32],
}
#: LFM3's tiny model has two attention layers, so a KV block is 5.3x a checkpoint (LFM2: 1.8x) and the budget keeps
#: the first trunk's 32-token checkpoint through the fourth request (the same hits with both its attention layers
#: full, so the sliding window plays no part in it); ZAYA's KV block is 4.9x its checkpoint, with the same hits.
CHURN_HITS_BY_FAMILY = {
    ("flop_aware", "lfm3"): [0, 32, 0, 32, 32, 64, 64, 32, 64, 32],
    ("flop_aware", "zaya"): [0, 32, 0, 32, 32, 64, 64, 32, 64, 32],
}


def test_tiny_budget_with_eviction_churn(model, cold_model, eviction, family):
    expected_hits = CHURN_HITS_BY_FAMILY.get((eviction, family), CHURN_HITS[eviction])
    probe = HybridPrefixCache(model)
    budget = 8 * probe.spec.kv_block_bytes + 4 * probe.spec.checkpoint_bytes
    cache = HybridPrefixCache(model, retention_interval="dense", max_cache_bytes=budget)
    trunks = [random_ids(40, seed=20), random_ids(70, seed=21)]
    hits = []
    for i, which in enumerate([0, 0, 1, 0, 0, 1, 1, 0, 1, 0]):
        ids = torch.cat([trunks[which], random_ids(5 + i, seed=30 + i)], dim=1)
        assert_matches_cold(model, cold_model, cache, ids, new_tokens=8)
        hits.append(cache.last_hit_tokens[0])
        assert cache.stored_bytes <= budget
        assert cache.stats.stored_bytes == cache.stored_bytes
    stats = cache.stats
    assert stats.evicted_kv_blocks > 0 and stats.evicted_checkpoints > 0
    assert hits == expected_hits


@pytest.mark.parametrize("admit_divergence,expected_hits", [(True, [0, 0, 288]), (False, [0, 0, 0])])
def test_divergence_admission_makes_a_shared_trunk_reusable(model, cold_model, admit_divergence, expected_hits):
    """Three prompts trunk(300) + different 30-token suffixes, no retention: the second request leaves the first
    one's stored path at 288 (the last block boundary of the shared part) and keeps a checkpoint there."""
    cache = HybridPrefixCache(model, retention_interval=0, admit_divergence=admit_divergence)
    trunk = random_ids(300, seed=70)
    prompts = [torch.cat([trunk, random_ids(30, seed=71 + i)], dim=1) for i in range(3)]
    hits = []
    for ids in prompts:
        assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
        hits.append(cache.last_hit_tokens[0])
    assert hits == expected_hits
    assert cache.stats.divergence_checkpoints == (1 if admit_divergence else 0)
    if admit_divergence:
        assert_restored_states_match(cache, cold_model, torch.cat([trunk, random_ids(30, seed=74)], dim=1), 288)


def test_two_turn_chat_hits_inside_the_reply(model, cold_model):
    cache = HybridPrefixCache(model)
    first = random_ids(70, seed=40)
    reply = assert_matches_cold(model, cold_model, cache, first, new_tokens=20)  # 89 tokens went through: 80
    second = torch.cat([reply, random_ids(10, seed=41)], dim=1)
    assert_matches_cold(model, cold_model, cache, second)
    assert cache.last_hit_tokens == [80]
    assert cache.last_hit_tokens[0] > first.shape[1]
    assert cache.stats.divergence_checkpoints == 0  # the second turn extends the stored path: no divergence


def test_miss_after_many_hits_starts_from_a_fresh_state(model, cold_model):
    cache = HybridPrefixCache(model)
    ids = random_ids(50, seed=50)
    for _ in range(3):
        assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [48]
    other = random_ids(50, seed=51)
    cache.restore(other)
    assert cache.last_hit_tokens == [0]
    assert cache.get_seq_length() == 0
    assert not any(cache.has_previous_state(m.layer_idx) for m in cache.spec.mamba)
    cache.reset()
    assert_matches_cold(model, cold_model, cache, other)
    assert cache.last_hit_tokens == [0]


def test_stats_count_tokens_and_entries(model, cold_model):
    cache = HybridPrefixCache(model)
    ids = random_ids(100, seed=60)
    assert_matches_cold(model, cold_model, cache, ids)
    assert_matches_cold(model, cold_model, cache, ids)
    stats = cache.stats
    assert (stats.requests, stats.prompt_tokens, stats.hit_tokens, stats.computed_prompt_tokens) == (2, 200, 96, 104)
    assert stats.kv_blocks == 7  # 100 + 15 tokens went through the model: 7 full blocks
    assert stats.checkpoints == 2  # prompt-end 96 and decode-end 112
    spec = cache.spec
    assert stats.stored_bytes == 7 * spec.kv_block_bytes + 2 * spec.checkpoint_bytes
    assert stats.token_hit_rate == pytest.approx(0.48)
    cache.clear()
    assert (cache.stats.kv_blocks, cache.stats.checkpoints, cache.stats.stored_bytes) == (0, 0, 0)
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [0]
