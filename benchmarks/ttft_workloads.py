"""TTFT per request with and without a HybridPrefixCache, on a small Jamba-shaped model run for real.

    PYTHONPATH=. python benchmarks/ttft_workloads.py                                # workload (a), 24 requests, CPU
    PYTHONPATH=. python benchmarks/ttft_workloads.py --workload d_agent_tree --requests 16

The model is built in code (8 layers, hidden 256, one attention layer in 4, long-memory init, byte-level tokenizer;
no downloads). Each request is generated twice with greedy decoding — without the cache and with one cache kept for
the whole run (default options) — and the time to the first new token is measured with a streamer. The first tokens
of the two runs must be identical. Writes ``results/ttft_<workload>.csv`` and ``results/ttft_<workload>.png``.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time

# Spinning OpenMP threads stall small torch ops on a shared CPU: set before torch loads OpenMP, as every script here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

from benchmarks.simulate import tokenize_workload
from benchmarks.workloads import WORKLOADS, load_jsonl_chats
from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.toy import build_model, byte_tokenizer

#: Workload sizes that keep a CPU run to a few minutes (prompts of 1-5k tokens).
SMALL_WORKLOADS = {
    "a_system_prompt": dict(num_requests=24, system_chars=2000),
    "b_multi_turn": dict(num_chats=4, turns=5),
    "c_few_shot": dict(num_requests=24, pool_size=8, shots=4),
    "d_agent_tree": dict(num_tasks=4, max_steps=3, trunk_chars=2500),
}


class FirstTokenTimer(BaseStreamer):
    """Time from construction to generate()'s first new token (its second ``put``; the first is the prompt)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: float | None = None
        self._puts = 0

    def put(self, value) -> None:
        self._puts += 1
        if self._puts == 2:
            self.seconds = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def first_token(model, ids: torch.Tensor, cache=None) -> tuple[float, int]:
    """(TTFT in seconds, first new token id) of a greedy generate() of one token."""
    timer = FirstTokenTimer()
    kwargs = {} if cache is None else {CACHE_KWARG: cache}
    out = model.generate(ids, max_new_tokens=1, do_sample=False, streamer=timer, **kwargs)
    return timer.seconds, int(out[0, -1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="a_system_prompt", choices=sorted(WORKLOADS))
    parser.add_argument("--jsonl", help="a local JSONL file of chats to run instead of the built-in workload")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--out", default="results")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    tokenizer = byte_tokenizer()
    model = build_model("jamba", hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=2, mamba_dt_rank=16, max_position_embeddings=16384)
    if args.jsonl:
        args.workload = os.path.splitext(os.path.basename(args.jsonl))[0]
        dataset = load_jsonl_chats(args.jsonl)
    else:
        dataset = WORKLOADS[args.workload](**SMALL_WORKLOADS[args.workload])
    requests = tokenize_workload(dataset, tokenizer)
    requests = requests[: args.requests]
    first_token(model, torch.tensor([requests[0].prompt_ids[:32]]))  # warm up kernels and allocator
    cache = HybridPrefixCache(model)
    rows = []
    for i, request in enumerate(tqdm(requests, desc=f"TTFT {args.workload}", unit="request")):
        ids = torch.tensor([request.prompt_ids])
        cold_seconds, cold_token = first_token(model, ids)
        cached_seconds, cached_token = first_token(model, ids, cache)
        assert cached_token == cold_token, f"request {i}: the first token differs from the run without the cache"
        rows.append(dict(request=i, prompt_tokens=ids.shape[1], hit_tokens=cache.last_hit_tokens[0],
                         ttft_without_s=cold_seconds, ttft_with_s=cached_seconds))
    print(f"\n{args.workload}: {len(rows)} requests, small Jamba-shaped model on "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}, {args.threads} thread(s); first tokens identical\n")
    print("| request | prompt tokens | hit | TTFT without (s) | TTFT with (s) | speedup |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['request']} | {r['prompt_tokens']} | {r['hit_tokens']} | {r['ttft_without_s']:.3f} | "
              f"{r['ttft_with_s']:.3f} | {r['ttft_without_s'] / r['ttft_with_s']:.1f}x |")
    without = [r["ttft_without_s"] for r in rows]
    with_cache = [r["ttft_with_s"] for r in rows]
    print(f"\nmedian TTFT without {statistics.median(without):.3f} s, with {statistics.median(with_cache):.3f} s; "
          f"total {sum(without):.1f} s vs {sum(with_cache):.1f} s ({sum(without) / sum(with_cache):.1f}x); "
          f"token hit rate {cache.stats.token_hit_rate:.3f}")
    path = os.path.join(args.out, f"ttft_{args.workload}")
    with open(path + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(path + ".png", args.workload, without, with_cache)
    print(f"wrote {path}.csv and {path}.png")


def plot(path: str, workload: str, without: list[float], with_cache: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(without, marker="o", label="without cache")
    ax.plot(with_cache, marker="o", label="with HybridPrefixCache")
    ax.set_xlabel("request")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"TTFT per request, {workload}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
