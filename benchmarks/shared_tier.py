"""Several worker processes serving one workload round-robin: local caches only, versus with the shared tier.

    PYTHONPATH=. python benchmarks/shared_tier.py                          # (a) and (b), 3 workers, own redis-server
    PYTHONPATH=. python benchmarks/shared_tier.py --workers 4 --redis redis://host:6379/0

Each worker is its own Python process with its own model (the same seeded weights: a small Jamba-shaped model, as in
``ttft_workloads.py``) and its own :class:`~hf_hybridcache.HybridPrefixCache`. Request ``i`` of the workload goes to
worker ``i % workers``. Three runs per workload: one worker serving every request (the reference hit rate), N workers
with local caches only, and N workers whose caches share a tier (``remote=``). Requests run one at a time and each
worker waits for its queued writes after a request (``cache.remote.flush()``, not counted in TTFT), so a run is
deterministic; in a service the writes overlap the next requests. Every first token must equal the reference run's.

Reports per run the token hit rate, the median TTFT, the bytes read from the tier per request it served a hit to,
the tokens the tier held that were recomputed instead (the fetch-or-recompute rule measured recomputing as faster),
and the median read (EXISTS / GET pipelines) and write (SET pipelines) round-trip times. Without ``--redis`` a ``redis-server`` is started on a free loopback port
(Debian: ``apt-get install redis-server``); with it, keys go under a fresh prefix, so nothing there is touched.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import subprocess
import time
import uuid

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

#: Workload sizes that keep a CPU run to a few minutes.
SIZES = {
    "a_system_prompt": dict(num_requests=24, system_chars=2000),
    "b_multi_turn": dict(num_chats=4, turns=5),
}


def _worker(conn, remote, threads: int) -> None:
    """Serve ``(prompt ids)`` messages from ``conn`` until None; answer each with the request's measurements."""
    import torch

    from benchmarks.ttft_workloads import first_token
    from hf_hybridcache import HybridPrefixCache
    from hf_hybridcache.remote import RemoteConfig
    from hf_hybridcache.toy import build_model

    torch.set_num_threads(threads)
    model = build_model("jamba", hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=2, mamba_dt_rank=16, max_position_embeddings=16384)
    first_token(model, torch.tensor([list(range(6, 38))]))  # warm up kernels and allocator
    cache = HybridPrefixCache(model, remote=None if remote is None else RemoteConfig(**remote))
    conn.send("ready")
    while (prompt := conn.recv()) is not None:
        before = cache.stats
        seconds, token = first_token(model, torch.tensor([prompt]), cache)
        if cache.remote is not None:
            cache.remote.flush(60)
        after = cache.stats
        latencies = {} if cache.remote is None else {k: list(v) for k, v in cache.remote.client.latencies_s.items()}
        conn.send(dict(
            ttft_s=seconds, token=token, hit=cache.last_hit_tokens[0], prompt_tokens=len(prompt),
            remote_hit=after.remote_hit_tokens - before.remote_hit_tokens,
            bytes_read=after.remote_bytes_read - before.remote_bytes_read,
            bytes_written=after.remote_bytes_written - before.remote_bytes_written,
            errors=after.remote_errors, dropped=after.remote_dropped_writes, latencies=latencies,
            recomputed=after.remote_recomputed_tokens,
        ))
    conn.close()


def run(prompts: list[list[int]], workers: int, remote: dict | None, threads: int) -> list[dict]:
    """Serve ``prompts`` round-robin over ``workers`` fresh processes; the measurements per request."""
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    for _ in range(workers):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, remote, threads), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        for pipe in pipes:
            assert pipe.recv() == "ready"
        results = []
        for i, prompt in enumerate(prompts):
            pipes[i % workers].send(prompt)
            results.append(pipes[i % workers].recv())
        for pipe in pipes:
            pipe.send(None)
        for i, result in enumerate(results):
            result["worker"] = i % workers
        return results
    finally:
        for proc in procs:
            proc.join(timeout=30)


def summarize(label: str, results: list[dict]) -> dict:
    hits = sum(r["hit"] for r in results)
    tokens = sum(r["prompt_tokens"] for r in results)
    served = [r for r in results if r["remote_hit"]]
    last = {r["worker"]: r for r in results}  # a worker's counters and latencies accumulate over its requests
    lat = {"read": [], "write": []}
    for r in last.values():
        for kind in lat:
            lat[kind].extend(r["latencies"].get(kind, []))
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.2f}" if xs else "-"  # noqa: E731
    return dict(
        run=label, hit_rate=hits / tokens, median_ttft=statistics.median(r["ttft_s"] for r in results),
        bytes_per_hit=(sum(r["bytes_read"] for r in served) / len(served)) if served else 0,
        remote_hits=len(served), get_ms=ms(lat["read"]), set_ms=ms(lat["write"]),
        errors=sum(r["errors"] for r in last.values()), dropped=sum(r["dropped"] for r in last.values()),
        recomputed=sum(r["recomputed"] for r in last.values()),
    )


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def main(argv: list[str] | None = None) -> None:
    from benchmarks.simulate import tokenize_workload
    from benchmarks.workloads import WORKLOADS
    from hf_hybridcache.toy import byte_tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=sorted(SIZES), choices=sorted(SIZES))
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--redis", help="URL of a running Redis / Valkey (default: start a redis-server here)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--requests", type=int, help="serve only the first N requests of each workload")
    args = parser.parse_args(argv)
    server, url = (None, args.redis) if args.redis else start_server()
    tokenizer = byte_tokenizer()
    rows = []
    try:
        for workload in args.workloads:
            prompts = [r.prompt_ids for r in tokenize_workload(WORKLOADS[workload](**SIZES[workload]), tokenizer)]
            prompts = prompts[: args.requests]
            reference = run(prompts, 1, None, args.threads)
            local = run(prompts, args.workers, None, args.threads)
            remote = dict(target=url, key_prefix=f"hfhc-bench-{uuid.uuid4().hex[:8]}")
            shared = run(prompts, args.workers, remote, args.threads)
            for label, results in (("1 worker", reference), (f"{args.workers} workers, local", local),
                                   (f"{args.workers} workers + tier", shared)):
                same = [r["token"] for r in results] == [r["token"] for r in reference]
                assert same, f"{workload}, {label}: a first token differs from the one-worker run"
                rows.append(dict(workload=workload, requests=len(prompts), **summarize(label, results)))
    finally:
        if server is not None:
            server.kill()
            server.wait()
    print("\n| workload | run | requests | token hit rate | median TTFT | requests hit from the tier | bytes read "
          "per such hit | tier tokens recomputed | median read / write round trip (ms) | tier errors / dropped writes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['run']} | {r['requests']} | {r['hit_rate']:.3f} | {r['median_ttft']:.3f} s | "
              f"{r['remote_hits']} | {r['bytes_per_hit'] / 1024:.0f} KiB | {r['recomputed']} | "
              f"{r['get_ms']} / {r['set_ms']} | "
              f"{r['errors']} / {r['dropped']} |")
    print("\nfirst tokens identical in every run")


if __name__ == "__main__":
    main()
