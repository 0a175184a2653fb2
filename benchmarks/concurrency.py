"""Many requests at once: the engine (``model.init_continuous_batching`` with a HybridPrefixCache) against serial
``generate()`` calls with the cache, threads calling ``generate()`` at once, one static batch, and stock sequential
``generate()`` without a cache, side by side in one run.

    PYTHONPATH=. python benchmarks/concurrency.py                                   # every model, workload, level
    PYTHONPATH=. python benchmarks/concurrency.py --models jamba --workloads a --levels 8 32 --arrivals all

Models (built in code, long-memory init, fp32, greedy): ``jamba`` (Jamba-shaped: 8 layers, hidden 256, attention in
layers 2 and 6, as benchmarks/ttft_workloads.py) and ``qwen3_5`` (Qwen3.5-shaped: 8 layers, hidden 256, three gated
delta net layers to one attention layer). Workloads: (a) every user sends one prompt made of a shared 1,024-token
system prompt and a 32-token question of its own (the system prompt is in the cache before the run, as in a warm
service); (b) every user has a chat of its own: a 256-token first message, then a 32-token follow-up sent when the
reply arrives, which reuses the first turn. Each request generates 32 tokens.

Arrivals: ``all`` (every user at time 0) or ``poisson`` (users arrive with exponential gaps at ``--rate`` users per
second). Each way of serving gets a fresh cache warmed the same way and serves the same users:

- engine: one manager; a user's request is added when it arrives (its next turn when its reply is complete);
- serial: one ``generate()`` call at a time with the cache, in arrival order;
- threads: one thread per user calling ``generate()`` with the cache when it arrives;
- static: one ``generate()`` call with the cache on the left-padded batch of every user's turn, once all arrived;
- stock: serial ``generate()`` without a cache (transformers alone).

Printed per row (the run of median tokens/s among ``--repeats`` interleaved runs): tokens/s (generated tokens over the time from the first arrival to the last token), TTFT p50 / p95
(arrival to first token, seconds), token hit rate (hit tokens / prompt tokens of the measured requests), peak memory
(largest rise of the process's resident memory during the run, MiB, sampled every 5 ms), and the ratios the bars
name. Writes ``results/concurrency_<model>_<workload>_<arrivals>.png`` (tokens/s per level). Timing is noisy on a
shared machine: compare rows of one run.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
from dataclasses import dataclass, field

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads stall small ops on a shared CPU

import psutil
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.toy import build_model

SYSTEM_TOKENS, QUESTION_TOKENS, FIRST_MESSAGE_TOKENS, NEW_TOKENS = 1024, 32, 256, 32
METHODS = ("serial", "static", "engine", "threads", "stock")  # the ratios' bases first: rows print as they come
VOCAB = 262


def bench_model(name: str, **shrink):
    """The benchmark's model ``jamba`` or ``qwen3_5`` (``shrink`` overrides for the smoke test)."""
    if name == "jamba":
        config = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, mamba_dt_rank=16, max_position_embeddings=16384)
        return build_model("jamba", **{**config, **shrink})
    config = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
                  linear_key_head_dim=32, linear_value_head_dim=32)
    return build_model("qwen3_5_text", **{**config, **shrink})


@dataclass
class User:
    """One user: arrives at ``arrival`` seconds, sends ``turns`` in order (each turn's prompt is the previous turn's
    prompt + its reply + the turn's own tokens)."""

    arrival: float
    turns: list[list[int]]
    prompts: list[list[int]] = field(default_factory=list)
    first_token_at: list[float] = field(default_factory=list)
    turn_sent_at: list[float] = field(default_factory=list)
    generated: int = 0

    def prompt(self, turn: int, reply: list[int] | None) -> list[int]:
        previous = self.prompts[-1] + reply if turn else []
        self.prompts.append(previous + self.turns[turn])
        return self.prompts[-1]


def workload(name: str, num_users: int, arrivals: str, rate: float, sizes: dict, seed: int = 0):
    """(users, warm-up prompts) of workload ``a`` or ``b``."""
    rng = random.Random(seed)

    def tokens(n):
        return [rng.randrange(6, VOCAB) for _ in range(n)]

    clock, times = 0.0, []
    for _ in range(num_users):
        times.append(clock if arrivals == "poisson" else 0.0)
        clock += rng.expovariate(rate)
    if name == "a":
        system = tokens(sizes["system"])
        return [User(t, [system + tokens(sizes["question"])]) for t in times], [system]
    return [User(t, [tokens(sizes["first"]), tokens(sizes["question"])]) for t in times], []


class FirstToken(LogitsProcessor):
    """Records when a generate() call samples its first token (its first logits-processor call)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            self.at = time.perf_counter()
        return scores


class PeakMemory:
    """The largest rise of this process's resident memory while the block runs (bytes), sampled every 5 ms."""

    def __enter__(self):
        self.process, self.start, self.peak = psutil.Process(), psutil.Process().memory_info().rss, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss - self.start)

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def _generate(model, prompts: list[list[int]], cache, new_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy generate() of ``prompts`` (left-padded when several) -> (replies, time of the first token)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    first = FirstToken()
    kwargs = {} if cache is None else {CACHE_KWARG: cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([first]), **kwargs)
    return out[:, width:].tolist(), first.at


def _wait_until(start: float, offset: float) -> None:
    delay = start + offset - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def serve_generate(model, users: list[User], cache, new_tokens: int, start: float) -> None:
    """Serial: one generate() call at a time, users in arrival order, each user's turns in order."""
    for user in sorted(users, key=lambda u: u.arrival):
        reply = None
        for turn in range(len(user.turns)):
            _wait_until(start, user.arrival)
            user.turn_sent_at.append(start + user.arrival if turn == 0 else time.perf_counter())  # queueing counts
            (reply,), at = _generate(model, [user.prompt(turn, reply)], cache, new_tokens)
            user.first_token_at.append(at)
            user.generated += len(reply)


def serve_threads(model, users: list[User], cache, new_tokens: int, start: float) -> None:
    """One thread per user calling generate() with the cache when it arrives."""
    threads = [threading.Thread(target=serve_generate, args=(model, [u], cache, new_tokens, start)) for u in users]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def serve_static(model, users: list[User], cache, new_tokens: int, start: float) -> None:
    """One static batch per turn of every user, sent once the last user arrived."""
    _wait_until(start, max(u.arrival for u in users))
    replies = [None] * len(users)
    for turn in range(len(users[0].turns)):
        sent = time.perf_counter()
        prompts = [user.prompt(turn, reply) for user, reply in zip(users, replies)]
        replies, at = _generate(model, prompts, cache, new_tokens)
        for user, reply in zip(users, replies):
            user.turn_sent_at.append(sent)
            user.first_token_at.append(at)
            user.generated += len(reply)


def serve_engine(model, users: list[User], cache, new_tokens: int, start: float) -> None:
    """The engine: each user's turn is added when it arrives (a later turn when the previous reply is complete)."""
    # transformers' own entry point: the cache built last for this model serves it
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    )
    manager.start()
    try:
        pending = {}  # request id -> (user, turn)
        order = sorted(range(len(users)), key=lambda i: users[i].arrival)
        next_user = 0
        while next_user < len(order) or pending:
            now = time.perf_counter() - start
            due = []
            while next_user < len(order) and users[order[next_user]].arrival <= now:
                due.append(order[next_user])
                next_user += 1
            if due:  # users arriving together are sent together (the engine starts them in one step)
                for i in due:
                    users[i].turn_sent_at.append(start + users[i].arrival)
                request_ids = manager.add_requests([users[i].prompt(0, None) for i in due], streaming=True)
                pending.update({request_id: (users[i], 0) for request_id, i in zip(request_ids, due)})
            output = manager.get_result(timeout=0.002)
            if output is None:
                continue
            user, turn = pending[output.request_id]
            if len(user.first_token_at) == turn:
                user.first_token_at.append(time.perf_counter())
            if not output.is_finished():
                continue
            del pending[output.request_id]
            assert output.error is None, output.error
            user.generated += len(output.generated_tokens)
            if turn + 1 < len(user.turns):
                user.turn_sent_at.append(time.perf_counter())
                prompt = user.prompt(turn + 1, output.generated_tokens)
                pending[manager.add_request(prompt, request_id=f"u{users.index(user)}t{turn + 1}",
                                            streaming=True)] = (user, turn + 1)
    finally:
        manager.stop()


SERVE = dict(engine=serve_engine, serial=serve_generate, threads=serve_threads, static=serve_static,
             stock=serve_generate)


def run_one(model, method: str, users: list[User], warm: list[list[int]], new_tokens: int) -> dict:
    """Serve ``users`` one way; returns the row's numbers."""
    cache = None if method == "stock" else HybridPrefixCache(model, retention_interval="dense")
    for prompt in warm:  # the shared system prompt is stored before the run, as in a warm service
        _generate(model, [prompt], cache, 1)
    before = None if cache is None else cache.stats
    with PeakMemory() as memory:
        start = time.perf_counter()
        SERVE[method](model, users, cache, new_tokens, start)
        seconds = time.perf_counter() - start
    ttfts = [at - sent for u in users for at, sent in zip(u.first_token_at, u.turn_sent_at)]
    hit_rate = float("nan")
    if cache is not None:
        after = cache.stats
        hit_rate = (after.hit_tokens - before.hit_tokens) / max(after.prompt_tokens - before.prompt_tokens, 1)
    qs = statistics.quantiles(ttfts, n=20) if len(ttfts) > 1 else [ttfts[0]] * 19
    return dict(tokens_per_s=sum(u.generated for u in users) / seconds, ttft_p50=statistics.median(ttfts),
                ttft_p95=qs[18], hit_rate=hit_rate, peak_mib=memory.peak / 2**20)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["jamba", "qwen3_5"], choices=["jamba", "qwen3_5"])
    parser.add_argument("--workloads", nargs="+", default=["a", "b"], choices=["a", "b"])
    parser.add_argument("--levels", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--arrivals", nargs="+", default=["all", "poisson"], choices=["all", "poisson"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--repeats", type=int, default=1, help="runs per row (interleaved; the median is printed)")
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals: users per second")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", default="results")
    parser.add_argument("--tiny", action="store_true", help="a few-MB model and short prompts (smoke test)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = dict(system=SYSTEM_TOKENS, question=QUESTION_TOKENS, first=FIRST_MESSAGE_TOKENS)
    new_tokens = NEW_TOKENS
    if args.tiny:
        sizes, new_tokens = dict(system=48, question=8, first=24), 4
    rows = []
    for model_name in args.models:
        model = bench_model(model_name, **(_tiny_shrink(model_name) if args.tiny else {}))
        _generate(model, [list(range(6, 38))], None, 2)  # warm up kernels and the allocator
        print(f"\n{model_name}-shaped model, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
              f"fp32, {args.threads} torch thread(s); {new_tokens} new tokens per request")
        for workload_name in args.workloads:
            for arrivals in args.arrivals:
                print(f"\nworkload ({workload_name}), arrivals: {arrivals}")
                print("| requests | method | tokens/s | vs serial | vs static | TTFT p50 (s) | TTFT p95 (s) | hit rate "
                      "| peak MiB |")
                print("|---:|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
                table = []
                for level in args.levels:
                    runs = {}
                    for _ in range(args.repeats):  # interleaved, so that a busy moment hits every way alike
                        for method in sorted(args.methods, key=METHODS.index):
                            users, warm = workload(workload_name, level, arrivals, args.rate, sizes)
                            runs.setdefault(method, []).append(run_one(model, method, users, warm, new_tokens))
                    for method, results in runs.items():
                        median = sorted(results, key=lambda r: r["tokens_per_s"])[(len(results) - 1) // 2]
                        row = dict(model=model_name, workload=workload_name, arrivals=arrivals, level=level,
                                   method=method, **median)
                        table.append(row)
                        _print_row(row, table)
                _plot(table, args.out, model_name, workload_name, arrivals)
                rows += table
    return rows


def _tiny_shrink(model_name: str) -> dict:
    if model_name == "jamba":
        return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, mamba_dt_rank=8)
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, layer_types=["linear_attention"] * 3
                + ["full_attention"], num_attention_heads=4, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)


def _print_row(row: dict, table: list[dict]) -> None:
    same = {r["method"]: r["tokens_per_s"] for r in table if r["level"] == row["level"]}
    print(f"| {row['level']} | {row['method']} | {row['tokens_per_s']:.1f} | "
          f"{_ratio(row['tokens_per_s'], same.get('serial'))} | {_ratio(row['tokens_per_s'], same.get('static'))} | "
          f"{row['ttft_p50']:.3f} | {row['ttft_p95']:.3f} | {row['hit_rate']:.3f} | {row['peak_mib']:.0f} |",
          flush=True)


def _ratio(value: float, base: float | None) -> str:
    return "" if not base else f"{value / base:.2f}x"


def _plot(table: list[dict], out: str, model: str, workload_name: str, arrivals: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    figure, axis = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in table):
        points = [(r["level"], r["tokens_per_s"]) for r in table if r["method"] == method]
        axis.plot(*zip(*points), marker="o", label=method)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("concurrent requests")
    axis.set_ylabel("generated tokens/s")
    axis.set_title(f"{model}-shaped, workload ({workload_name}), arrivals: {arrivals}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(out, f"concurrency_{model}_{workload_name}_{arrivals}.png"), dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
