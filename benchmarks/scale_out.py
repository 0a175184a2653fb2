"""Scale-out: replicas of ``python -m hf_hybridcache.serve`` behind SMG (the Shepherd Model Gateway), with and
without the shared tier, beside one replica alone::

    PYTHONPATH=. python benchmarks/scale_out.py                      # the short default run (a few minutes, 2 cores)
    PYTHONPATH=. python benchmarks/scale_out.py --system-chars 1500 --max-tokens 48     # longer prompts, replies
    PYTHONPATH=. python benchmarks/scale_out.py --simulate-only      # the 8-64 replica simulation alone

24 clients each hold a 6-turn chat (greedy, fp32) over one of 4 system prompts, all at once; a turn is sent when the
previous reply has arrived and carries the whole conversation. For each gateway policy (``round_robin``,
``cache_aware``, ``prefix_hash``, ``power_of_two``), with and without the tier (its own ``redis-server`` on a free
loopback port, emptied between runs, as the replicas' caches are through ``POST /flush_cache``), it prints the token
hit rate (``cached_tokens`` over prompt tokens), TTFT p50 / p95 (client side, streamed), generated tokens per second,
the requests each replica served (from its ``/metrics``), the replies equal to the one replica's, and failed requests.
``--skew`` (on by default) adds runs of ``round_robin`` and ``power_of_two`` while replica 0 also serves a side load of
long requests sent to it directly: a policy that follows the load sends it fewer (it reads ``/v1/loads``). Two cores
cannot show throughput scaling (three replicas share them); :mod:`benchmarks.scale_sim` shows it for 8-64 replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from benchmarks.fleet import Gateway, Replica
from benchmarks.scale_sim import print_simulation

POLICIES = ("round_robin", "cache_aware", "prefix_hash", "power_of_two")
#: The side-load runs: round_robin, and power_of_two with SMG's default metric (the expected wait: the work ahead that
#: /v1/loads reports, over one rate for all) and with its "requests" metric.
SKEW_RUNS = (("round_robin", ()), ("power_of_two", ()), ("power_of_two", ("--power-of-two-load-metric", "requests")))
REQUESTS_METRIC = 'hf_hybridcache_requests_total{endpoint="/v1/chat/completions",status="200"}'
TOPICS = ("billing", "shipping", "returns", "warranty", "accounts", "privacy", "repairs", "orders")


def system_prompts(count: int, chars: int, seed: int = 0) -> list[str]:
    """``count`` distinct system prompts of ``chars`` characters (one token a byte with the toy tokenizer)."""
    rng = random.Random(seed)
    prompts = []
    for k in range(count):
        words = [f"You are support assistant {k} of Northwind."]
        while sum(len(w) + 1 for w in words) < chars:
            words.append(f"Rule {len(words)}: answer {rng.choice(TOPICS)} questions in one line.")
        prompts.append(" ".join(words)[:chars])
    return prompts


def questions(clients: int, turns: int, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed + 1)
    return [[f"Client {c} asks about {rng.choice(TOPICS)}, case {rng.randrange(10**6)} (turn {t})."
             for t in range(turns)] for c in range(clients)]


@dataclass
class Run:
    """One run's requests: ``replies[(client, turn)]`` and per request its prompt, cached and generated tokens,
    TTFT and error."""

    label: str
    wall_s: float = 0.0
    replies: dict = field(default_factory=dict)
    records: list = field(default_factory=list)
    per_replica: list = field(default_factory=list)

    @property
    def errors(self) -> int:
        return sum(r["error"] is not None for r in self.records)

    def hit_rate(self) -> float:
        prompt = sum(r["prompt"] for r in self.records)
        return sum(r["cached"] for r in self.records) / prompt if prompt else 0.0

    def ttft(self, q: float) -> float:
        times = sorted(r["ttft"] for r in self.records if r["ttft"] is not None)
        return times[min(int(q * len(times)), len(times) - 1)] if times else float("nan")

    def tokens_per_s(self) -> float:
        return sum(r["completion"] for r in self.records) / self.wall_s if self.wall_s else 0.0

    def equal_to(self, reference: Run) -> int:
        return sum(reference.replies.get(key) == text for key, text in self.replies.items())


async def one_turn(client: openai.AsyncOpenAI, model: str, messages: list[dict], max_tokens: int) -> dict:
    sent, first, text, usage = time.perf_counter(), None, [], None
    try:
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
    except openai.APIError as problem:
        return {"error": f"{type(problem).__name__}: {problem}", "text": None, "prompt": 0, "cached": 0,
                "completion": 0, "ttft": None}
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"error": None, "text": "".join(text), "prompt": usage.prompt_tokens, "cached": cached,
            "completion": usage.completion_tokens, "ttft": None if first is None else first - sent}


async def chats(base_url: str, model: str, systems: list[str], asked: list[list[str]], max_tokens: int,
                label: str) -> Run:
    """Every client's chat at once through ``base_url`` (``/v1``)."""
    run = Run(label)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)

    async def converse(c: int) -> None:
        messages = [{"role": "system", "content": systems[c % len(systems)]}]
        for t, question in enumerate(asked[c]):
            messages.append({"role": "user", "content": question})
            record = await one_turn(client, model, messages, max_tokens)
            run.records.append({"client": c, "turn": t, **record})
            if record["error"] is not None:
                return
            run.replies[(c, t)] = record["text"]
            messages.append({"role": "assistant", "content": record["text"]})

    started = time.perf_counter()
    await asyncio.gather(*(converse(c) for c in range(len(asked))))
    run.wall_s = time.perf_counter() - started
    await client.close()
    return run


def counted(replicas: list[Replica]) -> list[float]:
    return [r.metric(REQUESTS_METRIC) for r in replicas]


def fresh(replicas: list[Replica], tier) -> None:
    """Empty the replicas' caches and the tier, so runs do not share entries."""
    for replica in replicas:
        httpx.post(f"{replica.url}/flush_cache", timeout=60).raise_for_status()
    if tier is not None:
        tier.flushall()


async def side_load(replica: Replica, model: str, stop: asyncio.Event, streams: int = 12) -> None:
    """``streams`` long text completions at a time, sent to ``replica`` directly, until ``stop`` (completions, so the
    replicas' chat request counters count the gateway's requests alone)."""
    client = openai.AsyncOpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=0, timeout=600)

    async def one(k: int) -> None:
        while not stop.is_set():
            await client.completions.create(model=model, prompt=f"side load {k} " * 40, max_tokens=96,
                                            temperature=0)

    await asyncio.gather(*(one(k) for k in range(streams)))
    await client.close()


async def through(replicas: list[Replica], policy: str, logdir: Path, args, systems, asked, label: str,
                  skew: bool = False) -> Run:
    gateway = Gateway(logdir, replicas, policy, tuple(args.gateway_flags)).start()
    before = counted(replicas)
    stop = asyncio.Event()
    side = asyncio.ensure_future(side_load(replicas[0], args.model, stop)) if skew else None
    try:
        if skew:
            await asyncio.sleep(2)  # the gateway's next load poll sees it
        run = await chats(gateway.url, args.model, systems, asked, args.max_tokens, label)
    finally:
        stop.set()
        if side is not None:
            await asyncio.gather(side, return_exceptions=True)
        gateway.stop()
    run.per_replica = [after - b for after, b in zip(counted(replicas), before)]
    return run


def print_table(runs: list[Run], reference: Run) -> None:
    print("| run | token hit rate | TTFT p50 | TTFT p95 | tokens/s | requests per replica | replies equal to 1 replica "
          "| failed |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for run in runs:
        split = " / ".join(f"{n:.0f}" for n in run.per_replica) or "-"
        print(f"| {run.label} | {run.hit_rate():.3f} | {run.ttft(0.5) * 1000:.0f} ms | {run.ttft(0.95) * 1000:.0f} ms "
              f"| {run.tokens_per_s():.0f} | {split} | {run.equal_to(reference)}/{len(run.replies)} | {run.errors} |")


def start_redis():
    """A ``redis-server`` on a free loopback port (the tests' throwaway server, ``tests/redis_server.py``)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from redis_server import RedisServer

    return RedisServer().start()


async def live(args) -> tuple[list[Run], Run]:
    logdir = Path(tempfile.mkdtemp(prefix="scale_out-"))
    systems, asked = system_prompts(args.systems, args.system_chars), questions(args.clients, args.turns)
    redis_server = start_redis()
    extra = ("--max-tokens", str(args.max_tokens))
    tiered = [Replica(logdir, i, args.model, redis_server.url, extra).start() for i in range(args.replicas)]
    local = [Replica(logdir, args.replicas + i, args.model, None, extra).start() for i in range(args.replicas)]
    runs = []
    try:
        for replica in tiered + local:
            replica.wait_ready()
        fresh(local[:1], None)
        before = counted(local[:1])
        reference = await chats(local[0].url, args.model, systems, asked, args.max_tokens, "1 replica")
        reference.per_replica = [after - b for after, b in zip(counted(local[:1]), before)]
        runs.append(reference)
        for policy in args.policies:
            for replicas, tier in ((local, None), (tiered, redis_server.client())):
                fresh(replicas, tier)
                label = f"{len(replicas)} x {policy}" + (" + tier" if tier is not None else "")
                runs.append(await through(replicas, policy, logdir, args, systems, asked, label))
        if args.skew:
            for policy, flags in SKEW_RUNS:
                fresh(tiered, redis_server.client())
                label = f"{len(tiered)} x {policy} {' '.join(flags)} + tier, side load on replica 0".replace("  ", " ")
                skewed = argparse.Namespace(**{**vars(args), "gateway_flags": [*args.gateway_flags, *flags]})
                runs.append(await through(tiered, policy, logdir, skewed, systems, asked, label, skew=True))
    finally:
        for replica in tiered + local:
            replica.stop()
        redis_server.stop()
    return runs, reference


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="toy:jamba")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--systems", type=int, default=4)
    parser.add_argument("--system-chars", type=int, default=320, help="characters (toy: tokens) per system prompt")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per reply")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--skew", action=argparse.BooleanOptionalAction, default=True,
                        help="also run round_robin and power_of_two with a side load on replica 0")
    parser.add_argument("--gateway-flags", nargs=argparse.REMAINDER, default=[],
                        help="more smg launch flags, last on the line (e.g. --power-of-two-load-metric requests)")
    parser.add_argument("--simulate-only", action="store_true")
    parser.add_argument("--sim-replicas", type=int, nargs="+", default=[8, 16, 32, 64])
    args = parser.parse_args(argv)
    if not args.simulate_only:
        runs, reference = asyncio.run(live(args))
        print(f"\n{args.clients} clients x {args.turns}-turn chats over {args.systems} system prompts of "
              f"{args.system_chars} tokens, {args.max_tokens}-token replies, {args.model} (fp32, greedy), smg "
              f"(health checks and load polls every second):\n")
        print_table(runs, reference)
    print_simulation(args.sim_replicas, args.systems, args.turns)


if __name__ == "__main__":
    main()
