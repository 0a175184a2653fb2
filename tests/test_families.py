"""Per-family checks beyond the exactness suite: bf16 models and save_pretrained/from_pretrained round trips."""

import torch
from transformers import AutoModelForCausalLM

from conftest import assert_matches_cold, cold_states, greedy, random_ids
from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.toy import build_model


def test_bf16_checkpoints_keep_the_live_dtypes_and_tokens_match(family):
    model = build_model(family, dtype=torch.bfloat16)
    cold_model = build_model(family, dtype=torch.bfloat16)
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(70, seed=70)
    cold_seq, _ = greedy(cold_model, ids, new_tokens=16)
    for expected_hit in (0, 64):
        seq, _ = greedy(model, ids, cache, new_tokens=16)
        assert cache.last_hit_tokens == [expected_hit]
        assert torch.equal(seq, cold_seq), "bf16 tokens differ from the bf16 cold run"

    live = cold_states(cold_model, ids, 64)
    store = cache._store
    checkpoint = store.checkpoints.get_copy(store.lookup(ids[0].tolist()).block_ids[-1])
    for m in cache.spec.mamba:
        conv, ssm = checkpoint[m.layer_idx]
        assert conv.dtype == live.layers[m.layer_idx].conv_states[0].dtype == torch.bfloat16
        assert ssm.dtype == live.layers[m.layer_idx].recurrent_states[0].dtype  # float32 where the model keeps it
        assert (conv.dtype, ssm.dtype) == (m.conv.dtype, m.ssm.dtype)
    stats = cache.stats
    assert (
        stats.stored_bytes
        == stats.kv_blocks * cache.spec.kv_block_bytes + stats.checkpoints * cache.spec.checkpoint_bytes
    )


def test_save_pretrained_round_trip_then_cached_run(model, cold_model, tmp_path):
    cache = HybridPrefixCache(model)  # a model already patched by a cache saves like any other
    assert_matches_cold(model, cold_model, cache, random_ids(40, seed=80))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    expected, got = cold_model.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name

    cache = HybridPrefixCache(loaded)
    ids = random_ids(60, seed=81)
    assert_matches_cold(loaded, cold_model, cache, ids)
    assert_matches_cold(loaded, cold_model, cache, ids)
    assert cache.last_hit_tokens == [48]
