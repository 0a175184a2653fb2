"""The remote tier (``remote=``) against a real redis-server: sharing across caches and processes, isolation of
models, weights and salts, a server that goes away and comes back, tampered entries, a full server evicting."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import assert_matches_cold, assert_restored_states_match, random_ids
from redis_server import RedisClusterServers, RedisServer, require_redis

import hf_hybridcache
from hf_hybridcache import HybridPrefixCache, _compat
from hf_hybridcache._compat.versions import ALLOW_UNTESTED_ENV
from hf_hybridcache.hashing import chain_hashes
from hf_hybridcache.remote import RemoteConfig
from hf_hybridcache.remote.codec import key_namespace
from hf_hybridcache.toy import build_model

#: Tests that build their models themselves compare with the jamba ``cold_model``.
JAMBA = pytest.mark.parametrize("family", ["jamba"])
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def own_server():
    """A server this test may kill and restart."""
    require_redis()
    server = RedisServer().start()
    yield server
    server.stop()


def keys(server, kind: str, secret: bytes | None = None) -> list[bytes]:
    return sorted(server.client().keys(f"{key_namespace('hfhc', secret)}:{kind}:*"))


def warm(model, cold_model, url, ids, **kwargs) -> HybridPrefixCache:
    cache = HybridPrefixCache(model, remote=url, **kwargs)
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
    assert cache.remote.flush(30)
    return cache


def publish(server, cold_model, seeds) -> list[torch.Tensor]:
    """An emptied server holding what a Jamba cache stored for one 70-token prompt per seed; the prompts."""
    server.client().flushall()
    prompts = [random_ids(70, seed=seed) for seed in seeds]
    warmer = build_model("jamba", seed=0)
    for ids in prompts:
        warm(warmer, cold_model, server.url, ids)
    return prompts


@pytest.mark.parametrize("family", ["jamba", "zamba2", "lfm2", "qwen3_next", "kimi_linear", "mamba"])
def test_second_cache_hits_what_the_first_published_and_matches_cold(server, family, model, cold_model):
    server.client().flushall()
    ids = random_ids(70, seed=500)
    first = warm(model, cold_model, server.url, ids)
    stats = first.stats
    assert stats.remote_bytes_written > 0 and stats.remote_dropped_writes == stats.remote_errors == 0
    # 70 + 4 tokens: blocks [0, 64) from the prompt; 73 seen tokens end no further block.
    assert len(keys(server, "kv")) == stats.kv_blocks == 4
    assert len(keys(server, "ck")) == stats.checkpoints

    second_model = build_model(family, seed=0)
    second = HybridPrefixCache(second_model, remote=server.url)
    assert second.seed == first.seed, "caches of one model under one tier share the namespace seed"
    assert_restored_states_match(second, cold_model, ids, expected_hit=64)
    second.clear()
    assert_matches_cold(second_model, cold_model, second, ids)
    assert second.last_hit_tokens == [64]
    assert second.stats.remote_hit_tokens == 128  # the states check above restored the same 64 tokens once
    assert second.stats.remote_corrupt_entries == 0


_PROCESS_B = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from conftest import greedy, random_ids
import hf_hybridcache
from hf_hybridcache import HybridPrefixCache, _compat
from hf_hybridcache.toy import build_model
torch.set_num_threads(1)
model, cold = build_model("jamba", seed=0), build_model("jamba", seed=0)
cache = HybridPrefixCache(model, remote={url!r})
ids = torch.cat([random_ids(70, seed=501), random_ids(10, seed=502)], dim=1)
seq, logits = greedy(model, ids, cache)
ref_seq, ref_logits = greedy(cold, ids)
print(json.dumps({{"hit": cache.last_hit_tokens, "remote_hit_tokens": cache.stats.remote_hit_tokens,
                  "same_tokens": bool(torch.equal(seq, ref_seq)),
                  "max_logit_diff": float((logits - ref_logits).abs().max())}}))
"""


@JAMBA
def test_fresh_process_hits_and_is_exact(server, cold_model):
    server.client().flushall()
    model = build_model("jamba", seed=0)
    first = warm(model, cold_model, server.url, random_ids(70, seed=501))
    script = _PROCESS_B.format(tests=os.path.join(REPO, "tests"), url=server.url)
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["hit"] == [64] and report["remote_hit_tokens"] == 64
    assert report["same_tokens"] and report["max_logit_diff"] <= 1e-4
    assert first.stats.remote_hit_tokens == 0


@JAMBA
def test_other_weights_models_and_salts_never_share(server, cold_model):
    server.client().flushall()
    ids = random_ids(70, seed=503)
    model = build_model("jamba", seed=0)
    first = HybridPrefixCache(model, remote=server.url)
    assert_matches_cold(model, cold_model, first, ids, new_tokens=4)
    assert_matches_cold(model, cold_model, first.with_salt("alice"), ids, new_tokens=4)
    assert first.remote.flush(30)

    other_weights = build_model("jamba", seed=1)
    cache = HybridPrefixCache(other_weights, remote=server.url)
    assert cache.seed == first.seed  # same config: same namespace, but the weights fingerprint roots apart
    assert_matches_cold(other_weights, build_model("jamba", seed=1), cache, ids, new_tokens=4)
    assert cache.last_hit_tokens == [0] and cache.stats.remote_hit_tokens == 0

    other_model = build_model("zamba2", seed=0)
    cache = HybridPrefixCache(other_model, remote=server.url)
    assert cache.seed != first.seed
    assert_matches_cold(other_model, build_model("zamba2", seed=0), cache, ids, new_tokens=4)
    assert cache.last_hit_tokens == [0] and cache.stats.remote_hit_tokens == 0

    same = build_model("jamba", seed=0)
    cache = HybridPrefixCache(same, remote=server.url)
    bob = cache.with_salt("bob")
    assert_matches_cold(same, cold_model, bob, ids, new_tokens=4)
    assert bob.last_hit_tokens == [0]
    alice = cache.with_salt("alice")
    assert_matches_cold(same, cold_model, alice, ids, new_tokens=4)
    assert alice.last_hit_tokens == [64]
    assert cache.stats.remote_hit_tokens == 64


@JAMBA
def test_requests_survive_the_server_going_away_and_the_tier_recovers(own_server, cold_model):
    model = build_model("jamba", seed=0)
    config = RemoteConfig(own_server.url, retry_after_s=0.5)
    cache = warm(model, cold_model, config, random_ids(70, seed=504))
    own_server.stop()
    started = time.monotonic()
    for seed in range(505, 509):
        assert_matches_cold(model, cold_model, cache, random_ids(70, seed=seed), new_tokens=4)
        assert cache.last_hit_tokens == [0]
    cache.remote.flush(30)
    stats, breaker = cache.stats, cache.remote.breaker
    assert stats.remote_errors >= 3 and breaker.times_opened == 1 and breaker.state != "closed"
    assert stats.remote_dropped_writes > 0
    assert time.monotonic() - started < 60

    own_server.start()
    time.sleep(0.6)  # the breaker's retry_after_s
    written = stats.remote_bytes_written
    ids = random_ids(70, seed=509)
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
    assert cache.remote.flush(30)
    assert breaker.state == "closed" and cache.stats.remote_bytes_written > written
    fresh_model = build_model("jamba", seed=0)
    fresh = HybridPrefixCache(fresh_model, remote=own_server.url)
    assert_matches_cold(fresh_model, cold_model, fresh, ids, new_tokens=4)
    assert fresh.last_hit_tokens == [64]


@JAMBA
def test_cache_built_while_the_server_is_down_runs_locally(cold_model):
    require_redis()
    server = RedisServer()  # never started: connections are refused
    model = build_model("jamba", seed=0)
    cache = HybridPrefixCache(model, remote=server.url)
    ids = random_ids(70, seed=510)
    for _ in range(2):
        assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
    assert cache.last_hit_tokens == [64]  # the local store serves as without a tier
    assert cache.stats.remote_errors >= 1 and cache.stats.remote_hit_tokens == 0


def _flip_a_tensor_byte(value: bytes) -> bytes:
    data = bytearray(value)
    data[-1] ^= 0x40
    return bytes(data)


TAMPERINGS = {
    "flipped tensor byte": lambda value, other: _flip_a_tensor_byte(value),
    "truncated": lambda value, other: value[: len(value) // 2],
    "another block's entry": lambda value, other: other,
    "not safetensors": lambda value, other: b"\x00" * 64,
}


@JAMBA
@pytest.mark.parametrize("kind", ["kv", "ck"])
@pytest.mark.parametrize("tampering", sorted(TAMPERINGS))
def test_tampered_entry_is_a_miss(server, cold_model, kind, tampering):
    server.client().flushall()
    ids = random_ids(70, seed=511)
    warm(build_model("jamba", seed=0), cold_model, server.url, ids, retention_interval="dense")
    client = server.client()
    names = keys(server, kind)
    victim, other = names[0], names[-1]
    client.set(victim, TAMPERINGS[tampering](client.get(victim), client.get(other)))

    model = build_model("jamba", seed=0)
    cache = HybridPrefixCache(model, remote=server.url)
    for blocks in range(1, 5):  # whichever entry was hit, no prompt that needs it may be served from it
        # A checkpoint is only fetched at the deepest boundary: cut the prompt just past each one.
        prompt = ids if kind == "kv" else ids[:, : 16 * blocks + 1]
        assert_matches_cold(model, cold_model, cache, prompt, new_tokens=4)
        cache.clear()
    assert cache.stats.remote_corrupt_entries >= 1


@JAMBA
def test_full_server_evicts_entries_and_every_request_stays_exact(cold_model):
    require_redis()
    server = RedisServer().start()
    try:
        admin = server.client()
        admin.config_set("maxmemory-policy", "allkeys-lru")
        admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + (1 << 20))
        model = build_model("jamba", seed=0)
        cache = HybridPrefixCache(model, remote=server.url, retention_interval="dense")
        prompts = [random_ids(70, seed=seed) for seed in range(520, 540)]
        for ids in prompts:
            assert_matches_cold(model, cold_model, cache, ids, new_tokens=2)
            assert cache.remote.flush(30)
        assert int(server.client().info("stats")["evicted_keys"]) > 0
        reader_model = build_model("jamba", seed=0)
        reader = HybridPrefixCache(reader_model, remote=server.url)
        for ids in reversed(prompts):  # the newest survive allkeys-lru; the oldest have lost pieces or everything
            assert_matches_cold(reader_model, cold_model, reader, ids, new_tokens=2)
        stats = reader.stats
        assert 0 < stats.remote_hit_tokens < 64 * len(prompts)
        assert stats.remote_corrupt_entries == 0
    finally:
        server.stop()


@JAMBA
def test_fetching_is_skipped_when_recomputing_is_cheaper(server, cold_model):
    server.client().flushall()
    ids = random_ids(70, seed=541)
    warm(build_model("jamba", seed=0), cold_model, server.url, ids)
    model = build_model("jamba", seed=0)
    cache = HybridPrefixCache(model, remote=RemoteConfig(server.url, min_flops_per_byte=1e12))
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
    assert cache.last_hit_tokens == [0]
    assert cache.stats.remote_round_trips >= 1 and cache.stats.remote_bytes_read == 0


@JAMBA
def test_measured_transfer_time_decides_once_known(server, cold_model):
    """With a compute rate far beyond any network, recomputing always wins once the transfer time is measured: the
    first fetch (nothing measured yet) happens and measures it, the next is skipped."""
    prompts = publish(server, cold_model, (547, 548))
    model = build_model("jamba", seed=0)
    cache = HybridPrefixCache(model, remote=RemoteConfig(server.url, compute_flops_per_s=1e18))
    hits = []
    for ids in prompts:
        assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
        hits.append(cache.last_hit_tokens[0])
    assert hits == [64, 0]
    assert cache.remote.client.rate.seconds(1) is not None


@JAMBA
def test_the_compute_rate_measured_on_the_caches_own_prefills_decides(server, cold_model):
    """By default the rule weighs the measured transfer time against the prefill FLOP/s measured on this cache's own
    forwards: a fetch when recomputing is slower, none (counted in remote_recomputed_tokens) when it is faster."""
    prompts = publish(server, cold_model, (549, 550))
    model = build_model("jamba", seed=0)
    cache = HybridPrefixCache(model, remote=server.url)
    assert cache.remote.compute_flops_per_s is None
    assert_matches_cold(model, cold_model, cache, random_ids(40, seed=551), new_tokens=2)  # a miss, measured
    assert cache.remote.compute_flops_per_s > 0
    assert_matches_cold(model, cold_model, cache, prompts[0], new_tokens=4)
    assert cache.last_hit_tokens == [64] and cache.stats.remote_hit_tokens == 64
    cache.remote.fetcher.compute.flops_per_s = 1e18  # as if this process computed far faster than any network
    assert_matches_cold(model, cold_model, cache, prompts[1], new_tokens=4)
    assert cache.last_hit_tokens == [0] and cache.stats.remote_recomputed_tokens == 64


@JAMBA
def test_a_cache_loaded_with_remote_publishes_its_entries(server, cold_model, tmp_path):
    """A warm start from a file (saved by a cache with remote=) fills an emptied tier, and another cache hits it."""
    server.client().flushall()
    ids = random_ids(70, seed=552)
    warm(build_model("jamba", seed=0), cold_model, server.url, ids).save(tmp_path / "cache.safetensors")
    server.client().flushall()
    loaded = HybridPrefixCache.load(tmp_path / "cache.safetensors", build_model("jamba", seed=0), remote=server.url)
    assert loaded.remote.flush(30) and loaded.stats.remote_bytes_written > 0
    model = build_model("jamba", seed=0)
    cache = HybridPrefixCache(model, remote=server.url)
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
    assert cache.last_hit_tokens == [64] and cache.stats.remote_hit_tokens == 64


@JAMBA
def test_a_redis_cluster_client_shares_across_caches(cold_model, tmp_path):
    """remote= a RedisCluster client (three primaries): entries spread over the nodes' slots, each round trip is
    split per node by redis-py's cluster pipeline, and a second cache with its own client hits exactly."""
    require_redis()
    cluster = RedisClusterServers(tmp_path).start()
    try:
        ids = random_ids(70, seed=555)
        warm(build_model("jamba", seed=0), cold_model, cluster.client(), ids)
        stored = [node.client().dbsize() for node in cluster.nodes]
        assert sum(stored) >= 5 and sum(1 for n in stored if n) >= 2, stored  # 4 KV blocks + checkpoints, spread
        model = build_model("jamba", seed=0)
        cache = HybridPrefixCache(model, remote=cluster.client())
        assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
        assert cache.last_hit_tokens == [64] and cache.stats.remote_hit_tokens == 64
        assert cache.stats.remote_errors == 0
    finally:
        cluster.stop()


@JAMBA
def test_without_remote_nothing_changes(model):
    cache = HybridPrefixCache(model)
    assert cache.remote is None and cache.store.on_stored is None
    stats = cache.stats
    assert (stats.remote_hit_tokens, stats.remote_round_trips, stats.remote_bytes_written) == (0, 0, 0)


@JAMBA
def test_an_explicit_seed_is_kept(server, model):
    cache = HybridPrefixCache(model, remote=server.url, seed=b"deployment-secret")
    assert cache.seed == b"deployment-secret"


@JAMBA
@pytest.mark.filterwarnings("ignore:hf_hybridcache runs on transformers 9.9.9")
@pytest.mark.parametrize("package", ["transformers", "hf_hybridcache"])
def test_an_explicit_seed_shares_only_under_the_same_versions(server, cold_model, monkeypatch, package):
    # With seed= the namespace seed is not derived (it held the versions), and keys named no version: a cache under
    # other versions served the states those versions computed, which README and load() refuse.
    server.client().flushall()
    ids = random_ids(70, seed=556)
    warm(build_model("jamba", seed=0), cold_model, server.url, ids, seed=b"deployment seed")
    if package == "transformers":
        monkeypatch.setattr(_compat, "TRANSFORMERS_VERSION", "9.9.9")
        monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")  # its refusal without the opt-in: test_errors.py
    else:
        monkeypatch.setattr(hf_hybridcache._version, "__version__", "9.9.9")
    model = build_model("jamba", seed=0)
    cache = HybridPrefixCache(model, remote=server.url, seed=b"deployment seed")
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
    assert cache.last_hit_tokens == [0]
    assert cache.stats.remote_bytes_read == cache.stats.remote_corrupt_entries == 0
    monkeypatch.undo()
    model = build_model("jamba", seed=0)
    cache = HybridPrefixCache(model, remote=server.url, seed=b"deployment seed")
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
    assert cache.last_hit_tokens == [64]


@JAMBA
@pytest.mark.parametrize(
    "remote, error",
    [(lambda: "localhost:6379", ValueError), (lambda: 42, TypeError),
     (lambda: RemoteConfig("redis://h", timeout_s=0), ValueError)],
    ids=["url without scheme", "not a client", "zero timeout"],
)
def test_invalid_remote_is_refused(family, model, remote, error):
    with pytest.raises(error):
        HybridPrefixCache(model, remote=remote())


@JAMBA
def test_a_vanished_block_backs_the_hit_off_to_the_checkpoint_before_it(server, cold_model):
    server.client().flushall()
    ids = random_ids(70, seed=542)
    first = warm(build_model("jamba", seed=0), cold_model, server.url, ids, retention_interval="dense")
    hashes = chain_hashes(first.root_hash, ids[0].tolist(), 16)
    server.client().delete(first.remote.codec.key("kv", hashes[2]))  # tokens [32, 48): as allkeys-lru would
    model = build_model("jamba", seed=0)
    cache = HybridPrefixCache(model, remote=server.url)
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
    assert cache.last_hit_tokens == [32] and cache.stats.remote_hit_tokens == 32
    assert cache.stats.remote_corrupt_entries == 0


@JAMBA
def test_a_divergence_from_a_path_only_the_tier_holds_is_admitted(server, cold_model):
    """Workload (a) over several processes: the second one cannot see in its own store that its prompt leaves the
    first one's path, but the tier's KV chain shows it, so it keeps the checkpoint at the end of the shared part."""
    server.client().flushall()
    shared = random_ids(48, seed=543)
    prompts = [torch.cat([shared, random_ids(30, seed=seed)], dim=1) for seed in (544, 545, 546)]
    caches = []
    for ids in prompts:
        model = build_model("jamba", seed=0)
        cache = HybridPrefixCache(model, remote=server.url)
        assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
        assert cache.remote.flush(30)
        caches.append(cache)
    assert [c.last_hit_tokens for c in caches] == [[0], [0], [48]]
    assert [c.stats.divergence_checkpoints for c in caches] == [0, 1, 0]
    assert caches[2].stats.remote_hit_tokens == 48
