"""What a hit costs over stock transformers continuing from its own cache, per family kind, shape and prefix length.

The floor of a hit is not the suffix alone: stock transformers continuing from a ``DynamicCache`` that already holds
the prefix still attends over every prefix key. For each model and prefix length, a prompt is the prefix plus a new
64-token suffix, and each repeat runs:

- ``stock``: stock transformers' ``generate`` on prefix + suffix with a ``DynamicCache`` that holds the prefix
  (prefilled once, deep-copied before each run; the copy is not timed);
- ``hit``: the same ``generate`` with a HybridPrefixCache that stored the prefix: it restores it and runs the suffix.

The two run in lockstep (two threads taking turns at every token, the first turn alternating between repeats), so
load from other processes on a shared machine falls on both alike. Each is timed to its first new token (``TTFT``)
and per decode step for ``--decode-tokens`` more tokens (``decode`` is the median step). Inside the hit's
``generate()`` the start of its request (``start``: weights check, lookup, restore), the restore alone (``restore``:
lookup, KV gather, checkpoint copy; ``restore ms/MB`` divides it by the bytes it copies) and the bookkeeping after
its forwards (storing blocks and checkpoints: the prefill forward, then the mean per decode step) are timed. Every
number is the median over ``--repeats``; the hit's tokens and first-token logits are checked against stock's
(``max|dlogit|``). A second table restores stored prefixes of ``--restore-prefixes`` tokens with ``cache.restore``
alone (no forward), for the restore time per byte from short to long prefixes.

Family kinds: Mamba-1 (``jamba``), Mamba-2 (``zamba2`` small, ``falcon_h1`` real), gated delta net
(``qwen3_5_text``), short conv (``lfm2``). Shapes: ``small`` (hidden 512, 8 layers, 2 with attention) and ``real``
(``benchmarks/model_shapes.py``, cut to ``--real-layers`` layers on a CPU; the table names the cut).

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/hit_overhead.py
    PYTHONPATH=. python benchmarks/hit_overhead.py --kinds gdn --shapes small --prefixes 4096 --repeats 9
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import threading
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as every benchmark here (see ttft.py)

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from benchmarks.model_shapes import build_shape_model
from benchmarks.ttft import random_ids
from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.generate import LiveRequest, lifecycle

#: family kind -> (family of the small shape, (family, shape) of the real one).
KINDS = {
    "mamba1": ("jamba", ("jamba", "tiny-random")),
    "mamba2": ("zamba2", ("falcon_h1", "0.5b")),
    "gdn": ("qwen3_5_text", ("qwen3_5_text", "0.8b")),
    "short_conv": ("lfm2", ("lfm2", "350m")),
}


class Lockstep:
    """Two ``generate()`` calls in two threads that take turns at every token, so a load change on a shared machine
    falls on both alike: a call runs until its streamer receives a token, then waits while the other runs."""

    def __init__(self, names: list[str]) -> None:
        self._turn = threading.Condition()
        self._running = list(names)
        self._current = names[0]

    def wait(self, name: str) -> None:
        with self._turn:
            self._turn.wait_for(lambda: self._current == name)

    def hand_over(self, name: str, leaving: bool = False) -> None:
        with self._turn:
            if leaving:
                self._running.remove(name)
            others = [n for n in self._running if n != name]
            if others:
                self._current = others[0]
                self._turn.notify_all()


class StepClock(BaseStreamer):
    """Times a ``generate()`` call in lockstep with another one: the stretch before its first ``put`` (the prompt,
    before the prefill), then one stretch per emitted token; the time spent waiting for its turn is not counted."""

    def __init__(self, name: str, lockstep: Lockstep) -> None:
        self.name, self.lockstep = name, lockstep
        self.stretches: list[float] = []
        self._resumed = 0.0

    def begin(self) -> None:
        self.lockstep.wait(self.name)
        self._resumed = time.perf_counter()

    def put(self, value) -> None:
        self.stretches.append(time.perf_counter() - self._resumed)
        self.lockstep.hand_over(self.name)
        self.begin()

    def end(self) -> None:
        pass

    @property
    def ttft(self) -> float:
        return self.stretches[0] + self.stretches[1]

    @property
    def decode_step(self) -> float:
        return statistics.median(self.stretches[2:])


class Clocks:
    """Benchmark only: times the package's own steps of a request while it runs inside ``generate()``: the start of a
    request (``start_request``: weights check, lookup, restore), the restore itself (``restore_row``: lookup, KV
    gather, checkpoint copy) and the bookkeeping after each forward (``LiveRequest.after_forward``: storing blocks and
    checkpoints). Seconds, one entry per call."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {"start": [], "restore": [], "bookkeeping": []}
        self._originals = [
            (lifecycle, "start_request", "start"),
            (lifecycle, "restore_row", "restore"),
            (LiveRequest, "after_forward", "bookkeeping"),
        ]

    def __enter__(self):
        for owner, name, clock in self._originals:
            setattr(owner, name, self._timed(getattr(owner, name), self.seconds[clock]))
        return self

    @staticmethod
    def _timed(function, seconds: list[float]):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds.append(time.perf_counter() - start)

        timed.original = function
        return timed

    def __exit__(self, *exc) -> None:
        for owner, name, _ in self._originals:
            setattr(owner, name, getattr(owner, name).original)


def run(model, prompt: torch.Tensor, cache, new_tokens: int, streamer: BaseStreamer | None = None):
    """(sequences, first-step logits) of a greedy ``generate`` of ``new_tokens`` tokens."""
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0, streamer=streamer,
        **{CACHE_KWARG: cache},
    )
    return out.sequences, out.logits[0]


def run_lockstep(model, jobs: dict[str, tuple[torch.Tensor, object]], new_tokens: int) -> dict[str, tuple]:
    """``{name: (clock, sequences, first-step logits)}`` of one ``generate`` per job ``{name: (prompt, cache)}``, run
    in lockstep (:class:`Lockstep`; the first job starts)."""
    lockstep, results, errors = Lockstep(list(jobs)), {}, []

    def work(name, prompt, cache):
        clock = StepClock(name, lockstep)
        try:
            clock.begin()
            results[name] = (clock, *run(model, prompt, cache, new_tokens, clock))
        except BaseException as error:
            errors.append(error)
        finally:
            lockstep.hand_over(name, leaving=True)

    threads = [threading.Thread(target=work, args=(name, *job)) for name, job in jobs.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def stock_prefix_cache(model, prefix: torch.Tensor) -> DynamicCache:
    """transformers' own cache after a forward of ``prefix``."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prefix, use_cache=True, logits_to_keep=1, **{CACHE_KWARG: cache})
    return cache


def restored_bytes(cache, prompt: torch.Tensor) -> int:
    """Bytes a restore of ``prompt`` copies: the hit's KV blocks (sliding layers: their window) and one checkpoint."""
    hit = cache.store.lookup(prompt[0].tolist(), cache.root_hash)
    kv = sum(
        (len(hit.block_ids) - a.restore_from_block(hit.hit_tokens, cache.block_size)) * a.block_bytes(cache.block_size)
        for a in cache.spec.attention
    )
    return kv + cache.spec.checkpoint_bytes


def measure(args, model, prefix_tokens: int) -> dict[str, float]:
    """Medians over the repeats (seconds, bytes, ratios) for one prefix length."""
    device = model.device
    cache = HybridPrefixCache(model)
    prefix = random_ids(prefix_tokens, seed=prefix_tokens, device=device)
    new_tokens = 1 + args.decode_tokens
    with torch.no_grad():  # the prefix is stored with its prompt-end checkpoint; hits below restore it
        run(model, prefix, cache, 1)
    stock = stock_prefix_cache(model, prefix)
    times: dict[str, list[float]] = {}
    max_logit_diff, same_tokens = 0.0, True

    def record(name, value):
        times.setdefault(name, []).append(value)

    for repeat in range(args.repeats + 1):  # repeat 0 warms both paths up and is not recorded
        prompt = torch.cat([prefix, random_ids(args.suffix_tokens, seed=1000 + repeat, device=device)], 1)
        own = copy.deepcopy(stock)
        jobs = {"stock": (prompt, own), "hit": (prompt, cache)}
        order = ("stock", "hit") if repeat % 2 else ("hit", "stock")
        with Clocks() as clocks:
            results = run_lockstep(model, {name: jobs[name] for name in order}, new_tokens)
        del own
        assert cache.last_hit_tokens == [prefix_tokens], cache.last_hit_tokens
        if not repeat:
            continue
        (stock_clock, stock_seq, stock_logits), (hit_clock, hit_seq, hit_logits) = results["stock"], results["hit"]
        max_logit_diff = max(max_logit_diff, (hit_logits - stock_logits).abs().max().item())
        same_tokens &= torch.equal(hit_seq, stock_seq)
        record("stock", stock_clock.ttft)
        record("hit", hit_clock.ttft)
        record("hit / stock", hit_clock.ttft / stock_clock.ttft)
        record("start", clocks.seconds["start"][0])
        record("restore", clocks.seconds["restore"][0])
        bookkeeping = clocks.seconds["bookkeeping"]
        record("prefill bookkeeping", bookkeeping[0])
        record("decode bookkeeping", statistics.mean(bookkeeping[1:]) if args.decode_tokens else 0.0)
        if args.decode_tokens:
            record("stock decode", stock_clock.decode_step)
            record("hit decode", hit_clock.decode_step)
            record("decode hit / stock", hit_clock.decode_step / stock_clock.decode_step)
    row = {name: statistics.median(values) for name, values in times.items()}
    row["restored bytes"] = restored_bytes(cache, prompt)
    row["restore per MB"] = row["restore"] / (row["restored bytes"] / 2**20)
    row["max|dlogit|"], row["same tokens"] = max_logit_diff, same_tokens
    return row


def copy_floor(cache, prompt: torch.Tensor):
    """A function that copies what a restore of ``prompt`` copies and nothing else, and those bytes: the hit's pages
    of every attention layer's key and value pools by one contiguous ``index_select`` each (a memcpy per page, into
    the pools' own token-major layout) and a clone of each checkpoint tensor. No lookup, no Python per block, no
    layout change: the copy's own cost on this machine, which a restore of the same bytes cannot beat."""
    store = cache.store
    hit = store.find(prompt[0].tolist(), cache.root_hash, cache.options.min_tail_tokens)
    pools, pages = [], {}
    for a in cache.spec.attention:
        first = a.restore_from_block(hit.hit_tokens, cache.block_size)
        for rows in store.pages.rows(a.layer_idx):
            pools.append((rows.view(-1, cache.block_size, *rows.shape[1:]), first))
        pages[first] = store.page_table(hit.block_ids[first:])
    states = [t for pair in store.checkpoints.get(hit.block_ids[-1]).values() for t in pair]

    def copy_bytes() -> list[torch.Tensor]:
        return [pool.index_select(0, pages[first]) for pool, first in pools] + [t.clone() for t in states]

    return copy_bytes, sum(t.numel() * t.element_size() for t in copy_bytes())


def measure_restores(args, model, prefixes: list[int]) -> dict[int, dict[str, float]]:
    """``{prefix tokens: medians}`` of the request start and the restore (``restore_row``) of stored prefixes of each
    length, outside ``generate()`` (``cache.restore``), with the bytes each copies, and of the copy floor of the same
    bytes (:func:`copy_floor`). One cache stores every prefix; each round restores every length, then copies every
    length's floor, so load on a shared machine falls on all alike and each 1k restore and copy runs with the CPU
    caches full of the 32k one before it (as a server's would after a long request)."""
    cache = HybridPrefixCache(model)
    prompts = {}
    for prefix_tokens in prefixes:
        prefix = random_ids(prefix_tokens, seed=prefix_tokens, device=model.device)
        with torch.no_grad():
            run(model, prefix, cache, 1)
        prompts[prefix_tokens] = torch.cat([prefix, random_ids(args.suffix_tokens, seed=7, device=model.device)], 1)
    floors = {prefix_tokens: copy_floor(cache, prompt) for prefix_tokens, prompt in prompts.items()}
    seconds: dict[int, dict[str, list[float]]] = {p: {"start": [], "restore": [], "floor": []} for p in prefixes}
    for repeat in range(args.repeats + 1):  # round 0 warms up and is not recorded
        for prefix_tokens, prompt in prompts.items():
            cache.reset()
            with Clocks() as clocks:
                assert cache.restore(prompt) == [prefix_tokens]
            if repeat:
                for name in ("start", "restore"):
                    seconds[prefix_tokens][name].append(clocks.seconds[name][0])
        cache.reset()
        for prefix_tokens, (copy_bytes, _) in floors.items():
            began = time.perf_counter()
            copied = copy_bytes()
            if repeat:
                seconds[prefix_tokens]["floor"].append(time.perf_counter() - began)
            del copied
    rows = {}
    for prefix_tokens, prompt in prompts.items():
        cache.reset()
        row = {name: statistics.median(values) for name, values in seconds[prefix_tokens].items()}
        row["restored bytes"] = restored_bytes(cache, prompt)
        assert row["restored bytes"] == floors[prefix_tokens][1], "the copy floor copies other bytes than a restore"
        row["restore per MB"] = row["restore"] / (row["restored bytes"] / 2**20)
        row["floor per MB"] = row["floor"] / (row["restored bytes"] / 2**20)
        rows[prefix_tokens] = row
    cache.reset()
    return rows


def print_table(rows: list[tuple[str, int, dict]], args) -> None:
    print(
        f"\nmedians of {args.repeats} interleaved repeats; suffix {args.suffix_tokens} tokens, {args.decode_tokens} "
        f"decode steps; {torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}\n"
    )
    columns = ["model", "prefix", "stock TTFT ms", "hit TTFT ms", "hit / stock", "start ms", "restore ms",
               "restored MB", "restore ms/MB", "bookkeeping ms (prefill / step)", "stock decode ms/tok",
               "hit decode ms/tok", "decode hit / stock", "max\\|dlogit\\|", "tokens equal"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for label, prefix_tokens, r in rows:
        decode = (f"{1e3 * r['stock decode']:.2f} | {1e3 * r['hit decode']:.2f} | {r['decode hit / stock']:.2f}x"
                  if "stock decode" in r else "- | - | -")
        print(
            f"| {label} | {prefix_tokens} | {1e3 * r['stock']:.1f} | {1e3 * r['hit']:.1f} | {r['hit / stock']:.2f}x "
            f"| {1e3 * r['start']:.2f} | {1e3 * r['restore']:.2f} | {r['restored bytes'] / 2**20:.1f} "
            f"| {1e3 * r['restore per MB']:.3f} | {1e3 * r['prefill bookkeeping']:.2f} / "
            f"{1e3 * r['decode bookkeeping']:.3f} | {decode} | {r['max|dlogit|']:.1e} "
            f"| {'yes' if r['same tokens'] else 'NO'} |"
        )


def print_restore_table(rows: list[tuple[str, int, dict]], args) -> None:
    print(f"\nrestore alone (cache.restore, no forward): medians of {args.repeats} rounds over the prefix lengths; copy "
          "floor: the same bytes by one contiguous index_select per pool tensor and a clone per checkpoint tensor\n")
    print("| model | prefix | request start ms | restore ms | restored MB | restore ms/MB | ms/MB vs the first row "
          "| copy floor ms/MB | floor vs its first row | restore / floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    first = {}
    for label, prefix_tokens, r in rows:
        first.setdefault(label, r)
        f = first[label]
        print(
            f"| {label} | {prefix_tokens} | {1e3 * r['start']:.2f} | {1e3 * r['restore']:.2f} "
            f"| {r['restored bytes'] / 2**20:.1f} | {1e3 * r['restore per MB']:.3f} "
            f"| {r['restore per MB'] / f['restore per MB']:.2f}x | {1e3 * r['floor per MB']:.3f} "
            f"| {r['floor per MB'] / f['floor per MB']:.2f}x | {r['restore'] / r['floor']:.2f}x |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=list(KINDS))
    parser.add_argument("--shapes", nargs="+", choices=["small", "real", "tiny"], default=["small", "real"],
                        help="tiny: the few-MB test shape of the small family (gdn only), for the smoke test")
    parser.add_argument("--prefixes", type=int, nargs="*", default=[1024, 4096, 8192, 16384, 32768],
                        help="prefix tokens of the stock-vs-hit comparison on the small shapes")
    parser.add_argument("--real-prefixes", type=int, nargs="*", default=[1024, 4096],
                        help="prefix tokens of the comparison on the real shapes (their prefill is minutes at 4k on a "
                        "CPU)")
    parser.add_argument("--restore-prefixes", type=int, nargs="*", default=[1024, 4096, 16384, 32768],
                        help="prefix tokens of the restore-alone sweep (every shape)")
    parser.add_argument("--real-layers", type=int, default=8, help="keep the real shapes' first N layers")
    parser.add_argument("--suffix-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    rows, restore_rows = [], []
    for shape in args.shapes:
        for kind in args.kinds:
            small_family, (real_family, real_shape) = KINDS[kind]
            if shape != "real":
                model, _ = build_shape_model(small_family, shape)
                label, prefixes = f"{kind} {small_family} {shape}", args.prefixes
            else:
                model, description = build_shape_model(real_family, real_shape, args.real_layers)
                label, prefixes = f"{kind} {description}", args.real_prefixes
            for prefix_tokens in prefixes:
                rows.append((label, prefix_tokens, measure(args, model, prefix_tokens)))
                print_table(rows[-1:], args)
            if args.restore_prefixes:
                restores = measure_restores(args, model, args.restore_prefixes)
                restore_rows.extend((label, prefix_tokens, row) for prefix_tokens, row in restores.items())
                print_restore_table(restore_rows, args)
            del model
    if rows:
        print_table(rows, args)


if __name__ == "__main__":
    main()
