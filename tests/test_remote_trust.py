"""Whom the remote tier trusts, against a real redis-server: a forged entry is served without a secret (the threat the
README states) and is a miss under ``RemoteConfig(secret=...)``; processes with different secrets never share; a
value that fails verification is removed, so the next process that computes it replaces it and the one after hits."""

import pytest
import torch
from conftest import assert_matches_cold, random_ids

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.hashing import chain_hashes
from hf_hybridcache.remote import RemoteConfig
from hf_hybridcache.remote.codec import Codec, key_namespace
from hf_hybridcache.remote.config import SECRET_ENV
from hf_hybridcache.toy import build_model

pytestmark = pytest.mark.parametrize("family", ["jamba"])


@pytest.fixture(autouse=True)
def no_secret_in_the_environment(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)


def keys(server, kind: str, secret: bytes | None = None) -> list[bytes]:
    return sorted(server.client().keys(f"{key_namespace('hfhc', secret)}:{kind}:*"))


def publish(server, cold_model, ids, secret=None) -> HybridPrefixCache:
    """A jamba cache under ``secret`` that ran ``ids`` and wrote its entries to the tier."""
    model = build_model("jamba", seed=0)
    cache = HybridPrefixCache(model, remote=RemoteConfig(server.url, secret=secret))
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
    assert cache.remote.flush(30)
    return cache


def reader(server, secret=None) -> tuple[torch.nn.Module, HybridPrefixCache]:
    model = build_model("jamba", seed=0)
    return model, HybridPrefixCache(model, remote=RemoteConfig(server.url, secret=secret))


def forge_checkpoint(server, writer, ids, forger: Codec) -> dict:
    """Overwrite the checkpoint at token 64 that ``writer`` published with one whose states are all 0.5, encoded by
    ``forger`` (what anyone who can write to the server can do: the format is public and the checksum unkeyed).
    Returns the forged states."""
    block_hash = chain_hashes(writer.root_hash, ids[0].tolist(), 16)[3]
    key, tokens = writer.remote.codec.key("checkpoint", block_hash), ids[0, 48:64].tolist()
    states = Codec(writer.spec, "hfhc").decode(server.client().get(key), "checkpoint", block_hash, tokens)
    assert states is not None, "an unsigned reader accepts the published entry, signed or not"
    forged = {idx: (torch.full_like(conv, 0.5), torch.full_like(ssm, 0.5)) for idx, (conv, ssm) in states.items()}
    server.client().set(key, forger.encode("checkpoint", block_hash, tokens, forged))
    return forged


def test_without_a_secret_a_forged_entry_is_served(server, cold_model):
    server.client().flushall()
    ids = random_ids(70, seed=570)
    writer = publish(server, cold_model, ids)
    forged = forge_checkpoint(server, writer, ids, Codec(writer.spec, "hfhc"))

    model, cache = reader(server)
    cache.restore(ids)
    try:
        assert cache.last_hit_tokens == [64] and cache.stats.remote_corrupt_entries == 0
        for m in cache.spec.mamba:
            layer = cache.layers[m.layer_idx]
            assert torch.equal(layer.conv_states[m.state_idx], forged[m.key][0])
            assert torch.equal(layer.recurrent_states[m.state_idx], forged[m.key][1])
    finally:
        cache.reset()
    with pytest.raises(AssertionError):  # the forged states change what the model says
        assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)


@pytest.mark.parametrize("forger_secret", [None, b"another secret"], ids=["unsigned", "signed under another secret"])
def test_under_a_secret_a_forged_entry_is_a_miss_and_is_replaced(server, cold_model, forger_secret):
    server.client().flushall()
    ids, secret = random_ids(70, seed=571), b"deployment secret"
    writer = publish(server, cold_model, ids, secret)
    forge_checkpoint(server, writer, ids, Codec(writer.spec, "hfhc", forger_secret))

    model, first = reader(server, secret)
    assert_matches_cold(model, cold_model, first, ids, new_tokens=4)
    assert first.last_hit_tokens == [0]
    assert first.remote.flush(30)
    stats = first.stats
    assert (stats.remote_corrupt_entries, stats.remote_removed_entries, stats.remote_hit_tokens) == (1, 1, 0)

    model, second = reader(server, secret)  # the first one's recomputed checkpoint replaced the forged one
    assert_matches_cold(model, cold_model, second, ids, new_tokens=4)
    assert second.last_hit_tokens == [64] and second.stats.remote_hit_tokens == 64
    assert second.stats.remote_corrupt_entries == 0


def test_processes_with_different_secrets_never_share_nor_touch_each_others_keys(server, cold_model, monkeypatch):
    server.client().flushall()
    ids = random_ids(70, seed=572)
    publish(server, cold_model, ids, "alpha")  # a str secret is its UTF-8 bytes
    for secret in ("beta", None):
        model, cache = reader(server, secret)
        assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
        assert cache.remote.flush(30)
        stats = cache.stats
        assert cache.last_hit_tokens == [0] and stats.remote_bytes_read == 0 and stats.remote_corrupt_entries == 0
    namespaces = [keys(server, "kv", secret) for secret in (b"alpha", b"beta", None)]
    assert [len(n) for n in namespaces] == [4, 4, 4]
    assert len(set().union(*namespaces)) == 12

    monkeypatch.setenv(SECRET_ENV, "alpha")  # a deployment sets the secret in the environment
    model, cache = reader(server)
    assert cache.remote.config.secret == b"alpha"
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
    assert cache.last_hit_tokens == [64] and cache.stats.remote_hit_tokens == 64


def _flip_last_byte(value: bytes) -> bytes:
    return value[:-1] + bytes([value[-1] ^ 0x40])


@pytest.mark.parametrize("kind", ["kv", "checkpoint"])
@pytest.mark.parametrize("secret", [None, b"deployment secret"], ids=["unsigned", "signed"])
def test_a_damaged_entry_is_replaced_by_the_next_process_and_the_one_after_hits(server, cold_model, kind, secret):
    server.client().flushall()
    ids = random_ids(70, seed=573)
    writer = publish(server, cold_model, ids, secret)
    block = 2 if kind == "kv" else 3  # the block [32, 48), or the checkpoint at 64
    block_hash = chain_hashes(writer.root_hash, ids[0].tolist(), 16)[block]
    key, tokens = writer.remote.codec.key(kind, block_hash), ids[0, 16 * block : 16 * block + 16].tolist()
    intact = writer.remote.codec.decode(server.client().get(key), kind, block_hash, tokens)
    server.client().set(key, _flip_last_byte(server.client().get(key)))

    model, first = reader(server, secret)
    assert_matches_cold(model, cold_model, first, ids, new_tokens=4)
    assert first.last_hit_tokens == [0]  # a hit never crosses a missing piece
    assert first.remote.flush(30)
    assert (first.stats.remote_corrupt_entries, first.stats.remote_removed_entries) == (1, 1)
    replaced = writer.remote.codec.decode(server.client().get(key), kind, block_hash, tokens)
    assert replaced is not None and replaced.keys() == intact.keys()
    for idx, pair in intact.items():  # recomputed by the same prefill: the same states, bit for bit
        assert all(torch.equal(got, want) for got, want in zip(replaced[idx], pair))

    model, second = reader(server, secret)
    assert_matches_cold(model, cold_model, second, ids, new_tokens=4)
    assert second.last_hit_tokens == [64] and second.stats.remote_hit_tokens == 64
    assert second.stats.remote_corrupt_entries == second.stats.remote_removed_entries == 0
