"""The remote tier's parts without a server: circuit breaker, background writer, wire format, fetch rule, namespace."""

import dataclasses
import threading

import pytest
import torch

from hf_hybridcache.config import AttentionLayerSpec, MambaLayerSpec, ModelStateSpec, TensorSpec
from hf_hybridcache.hashing import BlockHash, block_hash
from hf_hybridcache.remote import CircuitBreaker, RemoteConfig
from hf_hybridcache.remote.client import TierClient
from hf_hybridcache.remote.codec import Codec
from hf_hybridcache.remote.fetch import worth_fetching
from hf_hybridcache.remote.namespace import namespace_seed
from hf_hybridcache.remote.rate import ComputeRate, TransferRate
from hf_hybridcache.remote.writer import Publisher
from hf_hybridcache.store import FlopModel


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_breaker_opens_after_consecutive_errors_and_half_opens_after_the_wait():
    clock = Clock()
    breaker = CircuitBreaker(max_errors=3, retry_after_s=5.0, clock=clock)
    breaker.failure()
    breaker.failure()
    breaker.success()  # a success in between resets the count
    breaker.failure()
    breaker.failure()
    assert breaker.state == "closed" and breaker.allow()
    breaker.failure()
    assert breaker.state == "open" and not breaker.allow() and breaker.times_opened == 1
    clock.now += 4.9
    assert not breaker.allow()
    clock.now += 0.2
    assert breaker.state == "half-open" and breaker.allow()
    breaker.failure()  # the trial failed: open again for another wait, still one opening
    assert breaker.state == "open" and breaker.times_opened == 1
    clock.now += 5.1
    breaker.success()
    assert breaker.state == "closed" and breaker.errors == 0


SPEC = ModelStateSpec(
    attention=(AttentionLayerSpec(1, 2, 4, torch.float32, value_head_dim=3),),
    mamba=(MambaLayerSpec(0, TensorSpec((6, 3), torch.float32), TensorSpec((6, 5), torch.float32)),),
    block_size=4,
)
TOKENS = [7, 8, 9, 10]
HASH = block_hash(BlockHash(b"\x00" * 32), TOKENS)


class BlockingPipeline:
    """Stands in for a redis-py pipeline: records SETs, and ``execute`` waits until the test releases it."""

    def __init__(self, client):
        self.client, self.commands = client, []

    def set(self, key, value, nx=False):
        self.commands.append((key, value, nx))

    def execute(self):
        self.client.release.wait(10)
        self.client.written.extend(self.commands)
        return [True] * len(self.commands)


class BlockingClient:
    def __init__(self):
        self.release, self.written = threading.Event(), []

    def pipeline(self, transaction=False):
        return BlockingPipeline(self)


def test_full_write_queue_drops_and_counts_instead_of_waiting():
    fake = BlockingClient()
    client = TierClient(fake, CircuitBreaker(3, 5.0))
    publisher = Publisher(client, Codec(SPEC, "test"), max_pending=2)
    h = BlockHash(b"\x01" * 32)
    kv = {1: (torch.zeros(2, 4, 4), torch.zeros(2, 4, 3))}
    publisher.publish("kv", h, [1, 2, 3, 4], kv)  # taken by the writer, which then blocks in execute()
    for _ in range(50):
        if publisher._queue.unfinished_tasks == 1 and publisher._queue.empty():
            break
        threading.Event().wait(0.02)
    for i in range(5):
        publisher.publish("kv", BlockHash(bytes([i + 2]) * 32), [1, 2, 3, 4], kv)
    assert client.counters["remote_dropped_writes"] == 3  # two fit the queue
    fake.release.set()
    assert publisher.flush(10)
    assert len(fake.written) == 3 and all(nx for _, _, nx in fake.written)
    assert client.counters["remote_bytes_written"] == sum(len(v) for _, v, _ in fake.written)
    publisher.muted = True
    publisher.publish("kv", BlockHash(b"\x09" * 32), [1, 2, 3, 4], kv)
    assert publisher.flush(10) and len(fake.written) == 3


def test_entries_round_trip_exactly():
    codec = Codec(SPEC, "test")
    kv = {1: (torch.randn(2, 4, 4), torch.randn(2, 4, 3))}  # keys and values of other widths, as MLA layers cache
    states = {0: (torch.randn(1, 6, 3), torch.randn(1, 6, 5))}
    got_kv = codec.decode(codec.encode("kv", HASH, TOKENS, kv), "kv", HASH, TOKENS)
    assert torch.equal(got_kv[1][0], kv[1][0]) and torch.equal(got_kv[1][1], kv[1][1])
    got = codec.decode(codec.encode("checkpoint", HASH, TOKENS, states), "checkpoint", HASH, TOKENS)
    assert torch.equal(got[0][0], states[0][0]) and torch.equal(got[0][1], states[0][1])


@pytest.mark.parametrize(
    "case",
    ["other hash", "other tokens", "other kind", "other shape", "other dtype", "missing", "garbage"],
)
def test_entries_that_do_not_fit_the_reader_are_misses(case):
    codec = Codec(SPEC, "test")
    kv = {1: (torch.randn(2, 4, 4), torch.randn(2, 4, 3))}
    value, kind, h, tokens = codec.encode("kv", HASH, TOKENS, kv), "kv", HASH, TOKENS
    if case == "other hash":
        h = block_hash(HASH, TOKENS)
    elif case == "other tokens":
        tokens = [7, 8, 9, 11]
    elif case == "other kind":
        kind = "checkpoint"
    elif case == "other shape":  # a writer whose layout differs: values as wide as keys
        value = _other_layout(value_head_dim=4).encode(kind, h, tokens, {1: (kv[1][0], torch.randn(2, 4, 4))})
    elif case == "other dtype":
        value = _other_layout(dtype=torch.float64).encode(kind, h, tokens, {1: (kv[1][0].double(), kv[1][1].double())})
    elif case == "missing":
        value = None
    else:
        value = b"\xff" * 100
    assert codec.decode(value, kind, h, tokens) is None


def _other_layout(**changes) -> Codec:
    """The codec of a model whose attention layer differs from ``SPEC``'s by ``changes``."""
    attention = dataclasses.replace(SPEC.attention[0], **changes)
    return Codec(dataclasses.replace(SPEC, attention=(attention,)), "test")


def test_fetch_rule_compares_flops_per_byte_and_measured_transfer_time():
    saved = FlopModel(flops_per_token=1000.0, flops_per_key=0.0).span_flops(0, 16)  # 16,000 FLOPs
    assert worth_fetching(saved, 1000, RemoteConfig("redis://h", min_flops_per_byte=16.0), None)
    assert not worth_fetching(saved, 1000, RemoteConfig("redis://h", min_flops_per_byte=16.1), None)
    timed = RemoteConfig("redis://h", compute_flops_per_s=1e6)  # recomputing takes 16 ms
    assert worth_fetching(saved, 1000, timed, None)  # not measured yet: fetch, which measures
    assert worth_fetching(saved, 1000, timed, 0.015)
    assert not worth_fetching(saved, 1000, timed, 0.017)


def test_worth_fetching_uses_the_measured_compute_rate_unless_one_is_given():
    saved = 16_000.0
    default = RemoteConfig("redis://h")
    assert worth_fetching(saved, 1000, default, 0.017, None)  # nothing measured: fetch
    assert worth_fetching(saved, 1000, default, 0.015, 1e6)  # recomputing takes 16 ms
    assert not worth_fetching(saved, 1000, default, 0.017, 1e6)
    assert worth_fetching(saved, 1000, RemoteConfig("redis://h", compute_flops_per_s=1e5), 0.017, 1e6)


def test_compute_rate_averages_forwards_long_enough_to_measure():
    rate = ComputeRate(min_tokens=16)
    rate.observe(15, 1e9, 0.001)  # too short: per-call overhead dominates
    assert rate.flops_per_s is None
    rate.observe(64, 1e9, 0.01)
    assert rate.flops_per_s == pytest.approx(1e11)
    rate.observe(64, 1e9, 0.02)
    assert rate.flops_per_s == pytest.approx(0.8 * 1e11 + 0.2 * 5e10)
    rate.observe(64, 0.0, 0.02)  # nothing to learn from
    assert rate.flops_per_s == pytest.approx(0.8 * 1e11 + 0.2 * 5e10)


def test_transfer_rate_separates_latency_from_bandwidth():
    rate = TransferRate()
    rate.observe_transfer(10_000, 0.01)  # no latency known yet: not used
    assert rate.seconds(1000) is None
    rate.observe_round_trip(0.001)
    rate.observe_transfer(1_000_000, 0.011)  # 1 MB in 10 ms after 1 ms of latency: 100 MB/s
    assert rate.latency_s == pytest.approx(0.001) and rate.bytes_per_s == pytest.approx(1e8)
    assert rate.seconds(2_000_000) == pytest.approx(0.021)
    rate.observe_round_trip(0.002)
    assert rate.latency_s == pytest.approx(0.8 * 0.001 + 0.2 * 0.002)


@pytest.mark.parametrize(
    "secret, error, match",
    [(b"", ValueError, "must not be empty"), (42, TypeError, "bytes, a str or None")],
    ids=["empty", "not bytes"],
)
def test_an_unusable_secret_is_refused(secret, error, match):
    with pytest.raises(error, match=match):
        RemoteConfig("redis://h", secret=secret)


def test_the_secret_stays_out_of_repr():
    assert "hunter2" not in repr(RemoteConfig("redis://h", secret="hunter2"))


def test_namespace_seed_is_shared_per_prefix_and_model():
    seed = namespace_seed("hfhc", "model-a")
    assert seed == namespace_seed("hfhc", "model-a") and len(seed) == 32
    assert seed != namespace_seed("hfhc", "model-b") and seed != namespace_seed("other", "model-a")


def test_a_missing_redis_server_skips_outside_ci_and_fails_in_ci(monkeypatch):
    import redis_server

    monkeypatch.setattr(redis_server.shutil, "which", lambda name: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        redis_server.require_redis()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI"):
        redis_server.require_redis()


class DictPipeline:
    def __init__(self, data):
        self.data, self.ops = data, []

    def exists(self, key):
        self.ops.append(lambda: int(key in self.data))

    def get(self, key):
        self.ops.append(lambda: self.data.get(key))

    def delete(self, key):
        self.ops.append(lambda: int(self.data.pop(key, None) is not None))

    def set(self, key, value, nx=False):
        def op():
            if nx and key in self.data:
                return None
            self.data[key] = value
            return True

        self.ops.append(op)

    def execute(self):
        return [op() for op in self.ops]


class DictClient:
    """An in-memory stand-in for a redis-py client, passed as ``remote=`` (the client-object path)."""

    def __init__(self):
        self.data = {}

    def pipeline(self, transaction=False):
        return DictPipeline(self.data)


@pytest.mark.parametrize("family", ["jamba"])
def test_a_given_client_object_is_used_as_it_is(family, cold_model):
    from conftest import assert_matches_cold, random_ids

    from hf_hybridcache import HybridPrefixCache
    from hf_hybridcache.toy import build_model

    client, ids = DictClient(), random_ids(70, seed=549)
    first_model, second_model = build_model("jamba", seed=0), build_model("jamba", seed=0)
    first = HybridPrefixCache(first_model, remote=client)
    assert_matches_cold(first_model, cold_model, first, ids, new_tokens=4)
    assert first.remote.flush(30) and len(client.data) == first.stats.kv_blocks + first.stats.checkpoints
    second = HybridPrefixCache(second_model, remote=client)
    assert_matches_cold(second_model, cold_model, second, ids, new_tokens=4)
    assert second.last_hit_tokens == [64] and second.stats.remote_hit_tokens == 64


@pytest.mark.parametrize("family", ["jamba"])
def test_close_writes_the_queue_and_stops_the_writer_thread(family, cold_model):
    import threading

    from conftest import assert_matches_cold, random_ids

    from hf_hybridcache import HybridPrefixCache
    from hf_hybridcache.toy import build_model

    def writers():
        return [t for t in threading.enumerate() if t.name == "hf_hybridcache-remote-writer" and t.is_alive()]

    client, model = DictClient(), build_model("jamba", seed=0)
    cache = HybridPrefixCache(model, remote=client)
    before = len(writers())
    assert_matches_cold(model, cold_model, cache, random_ids(70, seed=553), new_tokens=2)
    assert len(writers()) == before + 1
    assert cache.remote.close(10) and len(writers()) == before
    written = len(client.data)
    assert written > 0 and cache.stats.remote_dropped_writes == 0
    assert cache.remote.close(10)  # idempotent
    assert_matches_cold(model, cold_model, cache, random_ids(70, seed=554), new_tokens=2)  # a new thread publishes
    assert cache.remote.close(10) and len(client.data) > written and len(writers()) == before
