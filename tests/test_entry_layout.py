"""Every supported family's KV blocks and checkpoints written and read through both paths that serialize them — a
cache file (``save`` / ``HybridPrefixCache.load``) and the remote tier on a loopback redis-server — and then served
as an exact hit. Both take their tensor names, shapes and dtypes from :mod:`hf_hybridcache.store.layout`."""

import torch
from conftest import assert_restored_states_match, greedy, random_ids

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.core import entry_digests
from hf_hybridcache.store import entry_layout
from hf_hybridcache.toy import build_model

NEW_TOKENS = 4


def test_the_layout_names_every_state_once_and_sizes_it_as_the_spec_does(family, model):
    spec = HybridPrefixCache(model).spec
    kv, checkpoint = entry_layout(spec, "kv"), entry_layout(spec, "checkpoint")
    assert kv.num_bytes == spec.kv_block_bytes and checkpoint.num_bytes == spec.checkpoint_bytes
    assert len(kv.fields) == 2 * len(spec.attention) and len(checkpoint.fields) == 2 * len(spec.mamba)
    assert {(f.key, f.part) for f in checkpoint.fields} == {(m.key, part) for m in spec.mamba for part in (0, 1)}


def _assert_exact_hit(model, cache, ids, reference, hit_tokens):
    seq, logits = greedy(model, ids, cache, NEW_TOKENS)
    assert torch.equal(seq, reference[0]), f"tokens differ from the cold run (hit {cache.last_hit_tokens})"
    torch.testing.assert_close(logits, reference[1], rtol=0, atol=1e-4)
    assert cache.last_hit_tokens == [hit_tokens]


def test_every_family_round_trips_through_a_file_and_the_tier_and_hits_exactly(
    family, model, cold_model, server, tmp_path
):
    server.client().flushall()
    ids = random_ids(70, seed=560)
    reference = greedy(cold_model, ids, None, NEW_TOKENS)
    writer = HybridPrefixCache(model, remote=server.url, retention_interval="dense")
    _assert_exact_hit(model, writer, ids, reference, 0)
    assert writer.remote.flush(30) and writer.stats.remote_dropped_writes == 0
    written = entry_digests(writer)
    assert sum(kind == "checkpoint" for kind, _ in written) == 4  # at 16, 32, 48 and 64 (dense)
    writer.save(tmp_path / "cache.safetensors")

    loaded_model = build_model(family, seed=0)
    loaded = HybridPrefixCache.load(tmp_path / "cache.safetensors", loaded_model)
    assert entry_digests(loaded) == written, "the file gave back other bytes than were saved"
    assert_restored_states_match(loaded, cold_model, ids, expected_hit=64)
    _assert_exact_hit(loaded_model, loaded, ids, reference, 64)

    reader_model = build_model(family, seed=0)
    reader = HybridPrefixCache(reader_model, remote=server.url)
    assert_restored_states_match(reader, cold_model, ids, expected_hit=64)
    fetched = entry_digests(reader)  # 4 KV blocks and the checkpoint at 64, nothing computed yet
    assert len(fetched) == 5 and fetched.items() <= written.items(), "the tier gave back other bytes than were sent"
    reader.clear()
    _assert_exact_hit(reader_model, reader, ids, reference, 64)
    stats = reader.stats
    assert stats.remote_hit_tokens == 128 and stats.remote_corrupt_entries == 0  # restored twice: 2 x 64 tokens
