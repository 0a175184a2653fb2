"""Inkling 2 Loop (``inkling2_loop_text``, new in transformers 5.24): looped decoder layers whose passes after the
first keep their KV and conv windows in cache layers of their own. The exactness scenarios every family runs
(test_exactness.py, test_power.py) run here on it, from transformers 5.24 on (this module is version-specific, so CI
runs it on every release of the window; on 5.23 it skips with the reason), and the checks below that a restore needs
the loop passes' windows and KV."""

import pytest
import torch
from conftest import assert_matches_cold, cold_states, needs_inkling2_loop, random_ids
from test_exactness import (  # noqa: F401  (collected here: every exactness scenario, both eviction policies)
    eviction,
    test_divergence_admission_makes_a_shared_trunk_reusable,
    test_dropped_checkpoint_backs_off_while_its_kv_stays,
    test_miss_after_many_hits_starts_from_a_fresh_state,
    test_retention_interval,
    test_same_prompt_twice,
    test_shared_prefix_with_different_suffixes,
    test_stats_count_tokens_and_entries,
    test_suffix_shorter_than_the_conv_width,
    test_tiny_budget_with_eviction_churn,
    test_two_turn_chat_hits_inside_the_reply,
)
from test_power import (  # noqa: F401
    test_corrupted_restored_kv_fails_the_check,
    test_zeroed_restored_state_fails_the_check,
    test_zeroing_the_state_changes_the_logits_clearly,
)

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.config import split_state_key
from hf_hybridcache.store.checkpoints import CheckpointStore
from hf_hybridcache.store.kv_store import KVStore

pytestmark = needs_inkling2_loop

#: The tiny config (hf_hybridcache.toy): 6 decoder layers, layers 2-3 run 3 times, so cache layers 6-9 hold passes 2
#: and 3 of layers 2-3.
NUM_DECODER_LAYERS, LOOP_CACHE_LAYERS = 6, {6: 2, 7: 3, 8: 2, 9: 3}


@pytest.fixture
def family():
    return "inkling2_loop_text"


def test_upstream_continues_exactly_from_a_cache(cold_model):
    """One forward over a prefix then one over the rest equals one forward over everything (fp32), so a restored
    cache has a cold run to equal."""
    ids = random_ids(100, seed=60)
    past = cold_states(cold_model, ids, 64)
    with torch.no_grad():
        whole = cold_model(ids).logits
        rest = cold_model(ids[:, 64:], **{CACHE_KWARG: past}, use_cache=True).logits
    assert len(past.layers) == NUM_DECODER_LAYERS + len(LOOP_CACHE_LAYERS)
    torch.testing.assert_close(rest, whole[:, 64:], rtol=0, atol=1e-5)


def test_the_spec_holds_every_cache_layer_of_every_loop_pass(model):
    cache = HybridPrefixCache(model)
    num_cache_layers = NUM_DECODER_LAYERS + len(LOOP_CACHE_LAYERS)
    assert [a.layer_idx for a in cache.spec.attention] == list(range(num_cache_layers))
    assert [m.key for m in cache.spec.mamba] == [(i, s) if s else i for i in range(num_cache_layers) for s in range(4)]
    for cache_idx, decoder_idx in LOOP_CACHE_LAYERS.items():  # a loop pass's layer is its decoder layer's copy
        assert cache.spec.attention[cache_idx].num_kv_heads == cache.spec.attention[decoder_idx].num_kv_heads
        assert (cache_idx in cache.spec.sliding_layers) == (decoder_idx in cache.spec.sliding_layers)
    assert len(cache.layers) == num_cache_layers  # upstream's forward then appends no copies of its own
    ids = random_ids(40, seed=61)
    model.generate(ids, max_new_tokens=2, **{CACHE_KWARG: cache})
    assert len(cache.layers) == num_cache_layers


def _warm(model, cold_model):
    cache = HybridPrefixCache(model)
    ids = random_ids(100, seed=62)
    assert_matches_cold(model, cold_model, cache, ids)
    return cache, ids


def _is_loop_pass_layer(layer_idx) -> bool:
    return layer_idx >= NUM_DECODER_LAYERS


def test_power_a_restore_that_drops_the_loop_passes_conv_windows_fails(model, cold_model, monkeypatch):
    cache, ids = _warm(model, cold_model)
    original = CheckpointStore.get_copy

    def broken(self, block_id):
        states = original(self, block_id)
        for key, (conv, _) in states.items():
            if _is_loop_pass_layer(split_state_key(key)[0]):
                conv.zero_()
        return states

    monkeypatch.setattr(CheckpointStore, "get_copy", broken)
    with pytest.raises(AssertionError):
        assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [96]


def test_power_a_restore_that_drops_the_loop_passes_kv_fails(model, cold_model, monkeypatch):
    cache, ids = _warm(model, cold_model)
    original = KVStore.gather

    def broken(self, layer_idx, block_ids, *args):
        keys, values = original(self, layer_idx, block_ids, *args)
        if _is_loop_pass_layer(layer_idx):
            keys.zero_(), values.zero_()  # in place: the restore keeps the room it writes the prompt's tail into
        return keys, values

    monkeypatch.setattr(KVStore, "gather", broken)
    with pytest.raises(AssertionError):
        assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [96]
