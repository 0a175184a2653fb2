"""The exactness checks have power: a deliberately broken restore or replay makes them fail."""

import pytest
from conftest import MAMBA1_FAMILIES, assert_matches_cold, greedy, random_ids

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.store.checkpoints import CheckpointStore
from hf_hybridcache.store.kv_store import KVStore


def _warm(model, cold_model):
    cache = HybridPrefixCache(model)
    ids = random_ids(100, seed=70)
    assert_matches_cold(model, cold_model, cache, ids)
    return cache, ids


def test_zeroing_the_state_changes_the_logits_clearly(model, cold_model):
    """The long-memory init makes the SSM path drive the logits: without the prefix state they move a lot."""
    ids = random_ids(100, seed=70)
    _, with_state = greedy(cold_model, ids, new_tokens=1)
    _, without_prefix = greedy(cold_model, ids[:, 96:], new_tokens=1)
    assert (with_state - without_prefix).abs().max() > 0.1


@pytest.mark.parametrize("part", ["ssm", "conv"])
def test_zeroed_restored_state_fails_the_check(family, model, cold_model, monkeypatch, part):
    cache, ids = _warm(model, cold_model)
    if part == "ssm" and not any(m.ssm.num_bytes for m in cache.spec.mamba):
        part = "conv"  # a short conv keeps no recurrent state: its checkpoint is the conv window alone
    original = CheckpointStore.get_copy

    def broken(self, block_id):
        states = original(self, block_id)
        return {i: (conv.zero_() if part == "conv" else conv, ssm.zero_() if part == "ssm" else ssm)
                for i, (conv, ssm) in states.items()}

    monkeypatch.setattr(CheckpointStore, "get_copy", broken)
    with pytest.raises(AssertionError):
        assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [96]


@pytest.mark.needs_attention_layers
def test_corrupted_restored_kv_fails_the_check(model, cold_model, monkeypatch):
    cache, ids = _warm(model, cold_model)
    original = KVStore.gather

    def broken(self, layer_idx, block_ids, *args):
        keys, values = original(self, layer_idx, block_ids, *args)
        return keys, values.zero_()  # in place: the restore keeps the room it writes the prompt's tail into

    monkeypatch.setattr(KVStore, "gather", broken)
    with pytest.raises(AssertionError):
        assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [96]


@pytest.mark.parametrize("family", MAMBA1_FAMILIES)
def test_replay_from_a_zero_state_fails_the_check(model, cold_model, monkeypatch):
    """transformers 5.23's own continuation (scan restarts from zero) would fail the exactness check."""
    from hf_hybridcache import kernels
    from hf_hybridcache.kernels import mamba1_scan

    cache, ids = _warm(model, cold_model)
    original = mamba1_scan.selective_scan_ref

    def from_zero(*args, **kwargs):
        kwargs["initial_state"] = None
        return original(*args, **kwargs)

    monkeypatch.setattr(mamba1_scan, "selective_scan_ref", from_zero)
    with kernels.use_backend("reference"), pytest.raises(AssertionError):  # the broken scan is the one that runs
        assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [96]
