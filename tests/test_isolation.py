"""Cache salts: requests with different salts never share a stored entry; seeds make hashes reproducible."""

import pytest
import torch
from conftest import assert_matches_cold, random_ids

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.core import check_store
from hf_hybridcache.hashing import chain_hashes

pytestmark = pytest.mark.parametrize("family", ["jamba", "zamba2"])


def test_different_salts_never_share(model, cold_model):
    cache = HybridPrefixCache(model)
    ids = random_ids(60, seed=400)
    tenant_a, tenant_b = cache.with_salt("tenant-a"), cache.with_salt("tenant-b")
    assert_matches_cold(model, cold_model, tenant_a, ids)
    blocks_a = cache.stats.kv_blocks
    for view in (tenant_b, cache, cache.with_salt("tenant-a ")):  # a miss behaves like a fresh cache
        assert_matches_cold(model, cold_model, view, ids)
        assert view.last_hit_tokens == [0]
    assert cache.stats.kv_blocks == 4 * blocks_a  # every salt stored its own copy of the same tokens
    for view in (cache.with_salt("tenant-a"), tenant_b, cache):
        assert_matches_cold(model, cold_model, view, ids)
        assert view.last_hit_tokens == [48]
    check_store(cache)


def test_views_share_store_budget_and_counters(model, cold_model):
    cache = HybridPrefixCache(model)
    view = cache.with_salt("t")
    assert view is not cache and isinstance(view, HybridPrefixCache)
    assert view.store is cache.store and view.with_salt("u").store is cache.store
    assert view.layers is not cache.layers
    assert_matches_cold(model, cold_model, view, random_ids(40, seed=401))
    assert cache.stats == view.stats and cache.stats.requests == 1
    assert cache.last_hit_tokens == [] and view.last_hit_tokens == [0]
    cache.max_cache_bytes = cache.spec.kv_block_bytes * 3 + cache.spec.checkpoint_bytes
    assert view.max_cache_bytes == cache.max_cache_bytes and view.stored_bytes <= view.max_cache_bytes
    view.clear()
    assert cache.stats.kv_blocks == 0


def test_views_made_per_call_pin_nothing_once_done(model, cold_model):
    """Each request ends when another view starts one, so per-call views never leave chains pinned: a budget of a
    few blocks keeps working over many tenants."""
    cache = HybridPrefixCache(model, max_cache_bytes=None)
    cache.max_cache_bytes = 8 * cache.spec.kv_block_bytes + 2 * cache.spec.checkpoint_bytes
    digests = None
    for tenant in range(8):
        view = cache.with_salt(f"user-{tenant}")
        assert_matches_cold(model, cold_model, view, random_ids(50, seed=410 + tenant), new_tokens=4)
        digests = check_store(cache, digests)
    pinned = [block.block_id for block in cache.store.blocks() if block.ref_count]
    assert len(pinned) <= 3  # only the last request's chain (50 + 3 tokens: 3 blocks)
    assert cache.store.evicted_kv_blocks > 0


def test_salt_must_be_a_non_empty_string(model):
    cache = HybridPrefixCache(model)
    for bad in ("", 7, b"tenant"):
        with pytest.raises(ValueError, match="non-empty string naming the tenant"):
            cache.with_salt(bad)
    assert cache.with_salt(None).salt is None


def test_seed_makes_hashes_reproducible(model, family):
    ids = random_ids(64, seed=420)[0].tolist()
    same = [HybridPrefixCache(model, seed=b"app-seed") for _ in range(2)]
    assert same[0].root_hash == same[1].root_hash
    assert same[0].with_salt("a").root_hash == same[1].with_salt("a").root_hash != same[0].root_hash
    hashes = chain_hashes(same[0].root_hash, ids, 16)
    assert hashes == chain_hashes(same[1].root_hash, ids, 16)
    random_seeded = [HybridPrefixCache(model) for _ in range(2)]
    assert random_seeded[0].root_hash != random_seeded[1].root_hash != same[0].root_hash
    with pytest.raises(ValueError, match="`seed` must be bytes"):
        HybridPrefixCache(model, seed="app-seed")


def test_salted_hit_needs_the_same_salt_for_every_block(model, cold_model):
    """The salt sits at the root of the chain, so a longer prompt under another salt cannot reach the tail of a
    salted chain either."""
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(80, seed=430)
    assert_matches_cold(model, cold_model, cache.with_salt("a"), ids)
    longer = torch.cat([ids, random_ids(20, seed=431)], dim=1)
    assert_matches_cold(model, cold_model, cache.with_salt("b"), longer)
    assert cache.stats.hit_tokens == 0
