"""Sliding-window attention layers (tiny LFM3 and Inkling: window 24, so a 96-token hit restores 23 tokens' KV).

A sliding layer keeps the KV of its last ``sliding_window - 1`` tokens and counts all of them; a hit restores that
window from the stored blocks. These tests go through the public API and check that a broken window restore fails.
"""

import pytest
import torch
import transformers
from conftest import SLIDING_FAMILIES, and_inkling2_loop, assert_matches_cold, assert_restored_states_match, random_ids
from packaging.version import Version

import hf_hybridcache._compat as compat
from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.store.kv_store import KVStore

pytestmark = pytest.mark.parametrize("family", and_inkling2_loop(SLIDING_FAMILIES))


def _warm(model, cold_model, length=100):
    cache = HybridPrefixCache(model)
    ids = random_ids(length, seed=90)
    assert_matches_cold(model, cold_model, cache, ids)
    return cache, ids


INKLING_WINDOWS = {0: 24, 1: None, 2: 24, 3: None}  # sliding and full layers alternate (ZAYA too)
WINDOWS = {"lfm3": {1: 24, 2: None}, "inkling_text": INKLING_WINDOWS, "inkling2_text": INKLING_WINDOWS,
           "zaya": INKLING_WINDOWS, "lara_mini": {1: 24, 3: None},
           # 6 decoder layers, then cache layers 6-9 of the loop passes of layers 2 (sliding) and 3 (full)
           "inkling2_loop_text": {idx: None if idx % 2 else 24 for idx in range(10)}}


def test_the_spec_names_the_sliding_layers(model, family):
    spec = HybridPrefixCache(model).spec
    assert {a.layer_idx: a.sliding_window for a in spec.attention} == WINDOWS[family]
    assert spec.sliding_layers == {idx for idx, window in WINDOWS[family].items() if window}


@pytest.mark.parametrize("length,expected_hit", [(100, 96), (20, 16)])
def test_a_hit_past_or_inside_the_window_equals_a_cold_run(model, cold_model, length, expected_hit):
    """96 restored tokens are four windows; 16 are fewer than the window holds."""
    cache, ids = _warm(model, cold_model, length)
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [expected_hit]
    assert_restored_states_match(cache, cold_model, ids, expected_hit)


def test_a_longer_prompt_and_a_chat_turn_equal_cold_runs(model, cold_model):
    """The decode-end checkpoint at 112 (100 prompt + 16 new tokens) and the blocks the decode stored, beyond the
    window of every earlier forward, serve the next turn."""
    cache, ids = _warm(model, cold_model)
    seq = assert_matches_cold(model, cold_model, cache, ids)
    turn = torch.cat([seq, random_ids(30, seed=91)], dim=1)
    assert_matches_cold(model, cold_model, cache, turn)
    assert cache.last_hit_tokens == [112]


def _break_sliding_kv(monkeypatch, cache, how):
    original = KVStore.gather
    sliding = cache.spec.sliding_layers

    def broken(self, layer_idx, block_ids, *args):
        keys, values = original(self, layer_idx, block_ids, *args)
        if layer_idx not in sliding:
            return keys, values
        if how == "zero":
            return keys, torch.zeros_like(values)
        return torch.roll(keys, cache.block_size, dims=-2), torch.roll(values, cache.block_size, dims=-2)

    monkeypatch.setattr(KVStore, "gather", broken)


@pytest.mark.parametrize("how", ["zero", "shifted"])
def test_a_broken_window_fails_the_check(model, cold_model, monkeypatch, how):
    """Zeroed values, or the window's keys and values taken one block off: the cold comparison catches both, so the
    sliding layer's restored window drives the logits."""
    cache, ids = _warm(model, cold_model)
    _break_sliding_kv(monkeypatch, cache, how)
    with pytest.raises(AssertionError, match="differ from the cold run|not close"):
        assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [96]


def test_a_window_that_forgets_the_cumulative_length_fails_the_check(model, cold_model, monkeypatch):
    """A sliding layer restored with the right KV but counting only the tokens it holds (as a full layer would): its
    length is wrong on every version, and on transformers 5.23 - 5.24 it builds its mask at the wrong offset (5.25
    takes the query offset from the same count, so whether the mask's pattern survives depends on the family)."""
    cache, ids = _warm(model, cold_model)
    original = compat.set_kv

    def forgetful(layer, keys, values, num_tokens=None, **kwargs):
        original(layer, keys, values, num_tokens, **kwargs)
        if getattr(layer, "is_sliding", False):
            layer.cumulative_length = layer.keys.shape[-2]

    monkeypatch.setattr(compat, "set_kv", forgetful)
    with pytest.raises(AssertionError):
        assert_restored_states_match(cache, cold_model, ids, 96)
    if Version(transformers.__version__) >= Version("5.25.0"):
        return
    with pytest.raises(AssertionError, match="differ from the cold run|not close"):
        assert_matches_cold(model, cold_model, cache, ids)


def test_blocks_longer_than_the_window_are_refused(model):
    with pytest.raises(ValueError, match="block_size <= 24"):
        HybridPrefixCache(model, block_size=32)
    HybridPrefixCache(model, block_size=24)
