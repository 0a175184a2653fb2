"""Replicas behind a real gateway (SMG 1.13, ``smg launch``) with the shared tier on a Redis Cluster with a replica per
primary, all on loopback ports: the gateway registers the replicas from their own endpoints (no fallback) and reads
their load; replies through it equal one replica's; the hit rates of ``cache_aware`` and ``round_robin`` with the
tier are within 0.02 and 0.05 of one replica's; a cluster primary killed mid-run, a replica drained with SIGTERM and
one killed with SIGKILL cost no request and no token; a restarted replica's first request hits through the tier; and
docs/scale-out.md's recipe runs as written."""

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from redis_server import RedisClusterServers, require_redis

from benchmarks.fleet import Gateway, Replica
from benchmarks.scale_out import chats, questions, system_prompts

MODEL = "toy:jamba"
SYSTEMS = system_prompts(4, 160)
CLIENTS, TURNS, MAX_TOKENS = 6, 3, 4
ANSI = re.compile(r"\x1b\[[0-9;]*m")
DOC = Path(__file__).resolve().parents[1] / "docs" / "scale-out.md"


def require_smg() -> None:
    if shutil.which("smg") is None:
        if os.environ.get("CI"):
            pytest.fail("needs smg: .ci/run installs the dev extra, which has it")
        pytest.skip("needs smg (the Shepherd Model Gateway): pip install -e '.[dev]'")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A 3 + 3 Redis Cluster, three replicas on it and one replica without a tier (the solo reference)."""
    require_redis()
    require_smg()
    logdir = tmp_path_factory.mktemp("fleet")
    cluster = RedisClusterServers(logdir, size=3, replicas=1, node_timeout_ms=1000).start()
    extra = ("--max-tokens", str(MAX_TOKENS), "--drain-timeout", "20")
    tiered = [Replica(logdir, i, MODEL, cluster.url, extra).start() for i in range(3)]
    solo = Replica(logdir, 3, MODEL, None, extra).start()
    try:
        for replica in (*tiered, solo):
            replica.wait_ready()
        yield logdir, cluster, tiered, solo
    finally:
        for replica in (*tiered, solo):
            replica.stop()
        cluster.stop()


def run_chats(url: str, seed: int, clients: int = CLIENTS, turns: int = TURNS):
    return asyncio.run(chats(url, MODEL, SYSTEMS, questions(clients, turns, seed), MAX_TOKENS, "test"))


def empty(cluster, replicas) -> None:
    """Every replica's cache and the tier emptied, so a run's hits are its own."""
    for replica in replicas:
        httpx.post(f"{replica.url}/flush_cache", timeout=60).raise_for_status()
    roles = cluster.roles()
    for node in cluster.nodes:
        if roles.get(node.port) == "master":
            node.client().flushall()


def test_the_gateway_registers_replicas_from_their_own_endpoints_and_reads_their_load(fleet):
    logdir, _, tiered, _ = fleet
    gateway = Gateway(logdir, tiered, "power_of_two").start()
    try:
        workers = gateway.workers()
        assert {w["url"] for w in workers} == {r.url for r in tiered}
        for worker in workers:  # identified by /server_info (not "generic"), labels from /server_info, /model_info
            assert worker["runtime_type"] == "sglang" and worker["model_id"] == MODEL, worker
            labels = worker["labels"]
            assert labels["model_type"] == "jamba" and labels["max_running_requests"] == "32", labels
        busy = openai.OpenAI(base_url=f"{tiered[0].url}/v1", api_key="unused", max_retries=0).completions.create(
            model=MODEL, prompt="a long answer please " * 8, max_tokens=2000, temperature=0, stream=True)
        next(iter(busy))
        deadline = time.monotonic() + 10
        while True:  # the gateway's load poll (every second) sees the request running on replica 0
            loads = {entry["worker"]: entry for entry in httpx.get(f"{gateway.url}/get_loads").json()["loads"]}
            seen = loads.get(tiered[0].url, {}).get("num_running_reqs", 0) >= 1 and len(loads) == len(tiered)
            if seen or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        busy.close()
        assert seen, loads
        assert all(entry["max_total_num_tokens"] > 0 and entry["max_running_requests"] == 32
                   for entry in loads.values()), loads
    finally:
        gateway.stop()
    log = ANSI.sub("", gateway.log.read_text())
    assert "Discovered" in log or "Starting load monitor" in log  # it ran with our workers
    for fallback in ("falling back to deprecated", "Could not identify backend", "No loads fetched"):
        assert fallback not in log, [line for line in log.splitlines() if fallback in line]


def test_replies_equal_one_replica_and_hit_rates_follow_it(fleet):
    """The issue's bars on the benchmark's shape (24 clients x 6 turns over 4 system prompts; shorter prompts)."""
    logdir, cluster, tiered, solo = fleet
    empty(cluster, [solo])
    reference = run_chats(solo.url, seed=1, clients=24, turns=6)
    assert reference.errors == 0 and len(reference.replies) == 24 * 6
    rates = {}
    for policy, bar in (("cache_aware", 0.02), ("round_robin", 0.05)):
        empty(cluster, tiered)
        gateway = Gateway(logdir, tiered, policy).start()
        try:
            run = run_chats(gateway.url, seed=1, clients=24, turns=6)
        finally:
            gateway.stop()
        assert run.errors == 0 and run.equal_to(reference) == 24 * 6, policy
        rates[policy] = run.hit_rate()
        assert rates[policy] >= reference.hit_rate() - bar, (policy, rates, reference.hit_rate())
    assert reference.hit_rate() > 0.3, "the workload has no reuse: the test has no power"


def test_a_cluster_primary_killed_mid_run_costs_no_request_and_no_token(fleet):
    """cache_aware, with its spilling to a less loaded replica off, keeps each chat on one replica, so its replies'
    ids are in that replica's memory while the tier is out (a turn that moved would re-encode the previous reply from
    its text, as any server does without the tier: another prompt, which this test does not compare)."""
    logdir, cluster, tiered, solo = fleet
    reference = run_chats(solo.url, seed=2, clients=12, turns=6)
    sticky = ("--balance-abs-threshold", "100000", "--balance-rel-threshold", "100000")
    gateway = Gateway(logdir, tiered, "cache_aware", sticky).start()
    roles = cluster.roles()
    victim = next(node for node in cluster.nodes if roles.get(node.port) == "master")

    killed_at: list[float] = []

    async def kill_mid_run():
        async def kill_later() -> None:
            await asyncio.sleep(0.25)  # early: on an idle machine the 72 turns take about a second
            victim.stop()
            killed_at.append(time.monotonic())

        killing = asyncio.ensure_future(kill_later())
        run = await chats(gateway.url, MODEL, SYSTEMS, questions(12, 6, 2), MAX_TOKENS, "failover")
        ended = time.monotonic()
        await killing
        return run, ended

    try:
        run, ended = asyncio.run(kill_mid_run())
    finally:
        gateway.stop()
    assert ended > killed_at[0] + 0.1, "the chats ended before the kill: the test has no power"
    assert run.errors == 0, [r for r in run.records if r["error"]]
    differ = sorted(key for key, text in run.replies.items() if reference.replies.get(key) != text)
    assert not differ, (differ, (logdir / f"{Path(gateway.log).name}").read_text()[-3000:])
    cluster.wait_ok()
    assert sum(role == "master" for role in cluster.roles().values()) == 3  # its replica was promoted


def test_drained_and_killed_replicas_cost_no_request_and_a_restart_hits_through_the_tier(fleet):
    logdir, _, tiered, solo = fleet
    reference, later = run_chats(solo.url, seed=3), run_chats(solo.url, seed=4)
    gateway = Gateway(logdir, tiered, "round_robin").start()

    async def drain_mid_run():
        async def drain_later() -> int:
            await asyncio.sleep(0.5)
            return await asyncio.to_thread(tiered[1].stop, signal.SIGTERM)

        draining = asyncio.ensure_future(drain_later())
        run = await chats(gateway.url, MODEL, SYSTEMS, questions(CLIENTS, TURNS, 3), MAX_TOKENS, "drain")
        return run, await draining

    try:
        run, drained = asyncio.run(drain_mid_run())
        assert drained == 0
        assert "0 request(s) cut at the deadline; the tier's writes flushed" in tiered[1].log.read_text()
        assert run.errors == 0 and run.equal_to(reference) == CLIENTS * TURNS
        # SIGKILL, and the next chats at once: the gateway still routes to the dead replica until its next health
        # check, and retries those requests on the live one.
        assert tiered[2].stop() == -signal.SIGKILL
        after = run_chats(gateway.url, seed=4)
        assert after.errors == 0 and after.equal_to(later) == CLIENTS * TURNS
        # A restarted replica starts with an empty cache; its first request restores its prefix through the tier.
        tiered[1].start().wait_ready()
        messages = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": questions(1, 1, 3)[0][0]}]
        first = openai.OpenAI(base_url=f"{tiered[1].url}/v1", api_key="unused", max_retries=0).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens >= 128, first.usage
        assert first.choices[0].message.content == reference.replies[(0, 0)]
    finally:
        gateway.stop()
        for replica in tiered[1:]:
            if replica.process.poll() is not None:
                replica.start()
        for replica in tiered[1:]:
            replica.wait_ready()


#: The loopback ports docs/scale-out.md's recipe names: Redis, three replicas, the gateway and its Prometheus listener.
RECIPE_PORTS = (6379, 8001, 8002, 8003, 30000, 29000)


def _on_free_ports(*blocks: str) -> list[str]:
    """The blocks with each of the recipe's ports replaced by a free loopback port, so a Redis or a server of the
    user's on one of them neither fails nor skips the test."""
    with contextlib.ExitStack() as stack:  # all held at once: the ports differ
        sockets = [stack.enter_context(socket.socket()) for _ in RECIPE_PORTS]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        free = {str(port): str(sock.getsockname()[1]) for port, sock in zip(RECIPE_PORTS, sockets)}
    named = re.compile(r"\b(" + "|".join(free) + r")\b")
    assert set(named.findall("".join(blocks))) == set(free), "the recipe names other ports than RECIPE_PORTS"
    return [named.sub(lambda port: free[port.group()], block) for block in blocks]


def test_the_docs_recipe_runs_as_written(tmp_path):
    """docs/scale-out.md's two blocks, with free ports in place of the ones they name: the bash block starts
    redis-server, three replicas and smg (their logs in a temporary folder), and the Python block talks to the
    gateway; everything the bash block started is stopped after."""
    require_redis()
    require_smg()
    text = DOC.read_text()
    start, use = _on_free_ports(re.findall(r"```bash\n(.*?)```", text, re.DOTALL)[0],
                                re.findall(r"```python\n(.*?)```", text, re.DOTALL)[0])
    with open(tmp_path / "recipe.log", "w") as log:
        process = subprocess.Popen(["bash", "-euo", "pipefail", "-c", start], start_new_session=True, cwd=tmp_path,
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        assert process.wait(timeout=300) == 0, (tmp_path / "recipe.log").read_text()
        done = subprocess.run([sys.executable, "-c", use], check=False, capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "cached tokens" in done.stdout and "answered by 3 replicas" in done.stdout, done.stdout
    finally:
        os.killpg(process.pid, signal.SIGKILL)


def test_the_simulation_gives_the_tier_back_what_split_caches_lose():
    """benchmarks/scale_sim.py on 4 replicas: one replica's hit rate bounds every policy's; without the tier
    round_robin loses most of it, with the tier it comes within 0.05; affinity policies keep it without a tier and
    concentrate the clients of a system prompt (4 prompts over 4 replicas at best); hits follow the cache's rules
    (a 6-turn chat's last turns restore everything up to the question)."""
    from benchmarks.scale_sim import simulate, simulate_single

    single = simulate_single(4, systems=4, turns=6)
    results = {(policy, tier): simulate(policy, 4, tier) for policy in ("round_robin", "cache_aware", "prefix_hash",
                                                                        "power_of_two") for tier in (False, True)}
    assert all(r["hit_rate"] <= single["hit_rate"] + 1e-9 for r in results.values())
    assert results["round_robin", False]["hit_rate"] < single["hit_rate"] - 0.2
    assert results["round_robin", True]["hit_rate"] > single["hit_rate"] - 0.05
    assert results["round_robin", True]["request_skew"] == 1.0
    assert results["cache_aware", False]["hit_rate"] > single["hit_rate"] - 0.01
    assert 0.8 < single["hit_rate"] < 0.95
