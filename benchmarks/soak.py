"""Soak run: thousands of requests on one HybridPrefixCache with a small budget, from several threads and tenants,
checking that nothing is lost or corrupted.

The workload is a support desk: a few system prompts shared by several tenants (cache salts), chat sessions that
grow turn by turn (each prompt = the previous prompt + reply + a new message), one-off prompts and small batches.
Sessions are spread over worker threads that call ``generate()`` on the same cache concurrently. The budget is small,
so eviction runs all the time. The run checks:

- every output against a cold run of the same prompt (an unpatched twin of the model, after the soak): tokens equal
  and first-step logits within 1e-4;
- the store invariants (``hf_hybridcache.core.check_store``: budget, byte accounting, block tree, hash chain, no
  stored entry ever written, no stray pins) every ``--check-every`` requests while the workers run;
- at the end: a save / load round trip with identical entries, and ``clear()`` leaving zero bytes.

and prints one table: token hit rate, requests with a hit, peak stored bytes (after every store) against the budget,
peak process memory (RSS), evictions and the checks. Not a test: run it by hand.

Usage::

    PYTHONPATH=. python benchmarks/soak.py                      # 2,000 requests, 4 threads (several minutes on CPU)
    PYTHONPATH=. python benchmarks/soak.py --requests 200 --threads 2
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import tempfile
import threading
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/ttft.py: spinning OpenMP threads stall small ops

import psutil
import torch
from tqdm.auto import tqdm

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.core import check_store, entry_digests
from hf_hybridcache.toy import VOCAB_SIZE, build_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=3, help="cache salts; each session belongs to one")
    parser.add_argument("--family", default="jamba")
    parser.add_argument("--budget-kib", type=int, default=1024, help="max_cache_bytes in KiB (small on purpose)")
    parser.add_argument("--retention", default="dense", help='retention_interval: "dense", 0 or a multiple of 16')
    parser.add_argument("--check-every", type=int, default=100, help="requests between store invariant checks")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(6, VOCAB_SIZE) for _ in range(n)]


class Workload:
    """Request descriptions per worker: ``(tenant, rows, max_new_tokens, session)``. A session's turns depend on the
    previous reply, so all turns of a session go to one worker."""

    def __init__(self, args: argparse.Namespace):
        self.rng = random.Random(args.seed)
        self.system_prompts = [tokens(self.rng, self.rng.randrange(40, 100)) for _ in range(5)]
        self.args = args

    def plan(self) -> list[list[tuple]]:
        """For each worker, its requests ``(kind, tenant, prompt rows or session, max_new_tokens)``: kind "turn" (the
        next turn of a chat session; its prompt is known once the previous reply is), "once" or "batch"."""
        rng, plans = self.rng, [[] for _ in range(self.args.threads)]
        sessions: list[list[dict]] = [[] for _ in range(self.args.threads)]
        for _ in range(self.args.requests):
            worker = rng.randrange(self.args.threads)
            tenant = f"tenant-{rng.randrange(self.args.tenants)}"
            new_tokens, kind = rng.randrange(1, 17), rng.random()
            if kind < 0.7:  # a chat turn: the next turn of one of this worker's sessions, or a new session
                if sessions[worker] and rng.random() < 0.6:
                    session = rng.choice(sessions[worker])
                else:
                    session = {"tenant": tenant, "ids": rng.choice(self.system_prompts)}
                    session["messages"] = random.Random(rng.random())  # the user's next messages
                    sessions[worker].append(session)
                plans[worker].append(("turn", session["tenant"], session, new_tokens))
            elif kind < 0.9:
                rows = [rng.choice(self.system_prompts) + tokens(rng, rng.randrange(1, 30))]
                plans[worker].append(("once", tenant, rows, new_tokens))
            else:
                rows = [rng.choice(self.system_prompts)[: rng.randrange(8, 40)] + tokens(rng, rng.randrange(1, 20))
                        for _ in range(2)]
                plans[worker].append(("batch", tenant, rows, new_tokens))
        return plans


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask


def generate(model, rows: list[list[int]], cache, new_tokens: int):
    """Greedy tokens of each row (without padding) and first-step logits ``[B, V]``."""
    ids, mask = left_pad(rows)
    kwargs = {} if cache is None else {CACHE_KWARG: cache}
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs)
    return [out.sequences[i, ids.shape[1] :].tolist() for i in range(len(rows))], out.logits[0]


class PeakStored:
    """Stored bytes right after every add (entries are only ever added by these two calls)."""

    def __init__(self, store):
        self.peak, self.store = 0, store
        for name in ("add_block", "add_checkpoint"):
            setattr(store, name, self._after(getattr(store, name)))

    def _after(self, add):
        def wrapped(*args, **kwargs):
            result = add(*args, **kwargs)
            self.peak = max(self.peak, self.store.stored_bytes)
            return result

        return wrapped


def run_soak(args: argparse.Namespace) -> dict:
    model = build_model(args.family, seed=0)
    retention = args.retention if args.retention == "dense" else int(args.retention)
    cache = HybridPrefixCache(model, retention_interval=retention, max_cache_bytes=args.budget_kib * 1024)
    peak = PeakStored(cache.store)
    plans = Workload(args).plan()
    records, served, lock = [], [0], threading.Lock()
    check_results = {"checks": 0, "rss_first_check": None}
    errors: list[BaseException] = []
    done = threading.Event()

    def worker(plan: list[tuple]) -> None:
        try:
            for kind, tenant, rows, n in plan:
                if kind == "turn":
                    session = rows
                    if "reply" in session:  # the next turn: previous prompt + reply + a new message
                        session["ids"] = session["ids"] + session["reply"] + tokens(session["messages"], 8)
                    rows = [session["ids"]]
                view = cache.with_salt(tenant)
                replies, logits = generate(model, rows, view, n)
                if kind == "turn":
                    session["reply"] = replies[0]
                with lock:
                    records.append((rows, n, replies, logits, list(view.last_hit_tokens)))
                    served[0] += 1
                    progress.update()
        except BaseException as error:
            errors.append(error)

    def checker() -> None:
        before, last = None, 0
        while not done.is_set():
            time.sleep(0.05)
            if served[0] - last >= args.check_every:
                last = served[0]
                try:
                    before = check_store(cache, before)
                    check_results["checks"] += 1
                    if check_results["rss_first_check"] is None:
                        check_results["rss_first_check"] = psutil.Process().memory_info().rss
                except BaseException as error:
                    errors.append(error)
                    return

    progress = tqdm(total=sum(len(plan) for plan in plans), desc="requests", unit="req")
    threads = [threading.Thread(target=worker, args=(plan,)) for plan in plans]
    watcher = threading.Thread(target=checker)
    start = time.perf_counter()
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    watcher.join()
    progress.close()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    check_store(cache)
    check_results["checks"] += 1
    rss_end = psutil.Process().memory_info().rss
    rss_first = check_results["rss_first_check"] or rss_end
    rss_peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # before the cold model is built
    stats = cache.stats

    cold = build_model(args.family, seed=0)
    mismatches, worst = 0, 0.0
    for rows, n, replies, logits, _ in tqdm(records, desc="cold reruns", unit="req"):
        ref_replies, ref_logits = generate(cold, rows, None, n)
        worst = max(worst, (logits - ref_logits).abs().max().item())
        mismatches += replies != ref_replies or not torch.allclose(logits, ref_logits, rtol=0, atol=1e-4)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "soak.safetensors")
        cache.save(path)
        loaded = HybridPrefixCache.load(path, model)
        round_trip = entry_digests(loaded) == entry_digests(cache)
        file_bytes = os.path.getsize(path)
    cache.clear()
    rows_with_hit = sum(hit > 0 for *_, hits in records for hit in hits)
    budget = cache.max_cache_bytes
    return {
        "requests (rows)": f"{len(records)} ({sum(len(r[0]) for r in records)})",
        "threads / tenants": f"{args.threads} / {args.tenants}",
        "wall time": f"{elapsed:.1f} s ({len(records) / elapsed:.1f} requests/s)",
        "token hit rate": f"{stats.token_hit_rate:.1%} ({stats.hit_tokens} of {stats.prompt_tokens} prompt tokens)",
        "rows with a hit": f"{rows_with_hit} of {sum(len(r[0]) for r in records)}",
        "peak stored bytes / budget": f"{peak.peak:,} / {budget:,} ({peak.peak / budget:.1%})",
        "evicted KV blocks / checkpoints": f"{stats.evicted_kv_blocks:,} / {stats.evicted_checkpoints:,}",
        "peak process memory (RSS)": f"{rss_peak_kib / 1024:.0f} MiB",
        "RSS at first check -> end of soak": f"{rss_first / 2**20:.0f} MiB -> {rss_end / 2**20:.0f} MiB",
        "outputs equal to cold runs": f"{len(records) - mismatches} of {len(records)} (max |dlogit| {worst:.1e})",
        "store invariant checks passed": f"{check_results['checks']}",
        "save / load round trip": f"{'identical' if round_trip else 'DIFFERS'} ({file_bytes:,} bytes)",
        "bytes after clear()": f"{cache.stored_bytes}",
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    result = run_soak(args)
    width = max(len(k) for k in result)
    print(f"\nSoak: {args.family}, block_size 16, retention {args.retention}, budget {args.budget_kib} KiB\n")
    print(f"| {'metric'.ljust(width)} | value |")
    print(f"|{'-' * (width + 2)}|-------|")
    for key, value in result.items():
        print(f"| {key.ljust(width)} | {value} |")


if __name__ == "__main__":
    main()
