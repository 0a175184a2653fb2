"""Token hit rate and stored bytes per policy x budget, by trace simulation on a Jamba-1.5-Mini-sized model.

    PYTHONPATH=. python benchmarks/hit_rate.py                 # every workload, about 20 minutes on 2 CPU cores
    PYTHONPATH=. python benchmarks/hit_rate.py --workloads d_agent_tree --quick
    PYTHONPATH=. python benchmarks/hit_rate.py --quick --configs "flop r0,flop r0 +div"   # these configs only
    PYTHONPATH=. python benchmarks/hit_rate.py --jsonl chats.jsonl     # your own chats, one {"messages": [...]} a line

For each workload (``benchmarks/workloads.py``), the cache's own bookkeeping replays the requests
(``benchmarks/simulate.py``) under each configuration and budget. Budgets are fractions of the bytes of all the
checkpoints the workload would create (the checkpoints stored at the end of an unbounded run with the defaults), plus
unbounded. Prints markdown tables, writes ``results/hit_rate.csv`` and plots ``results/hit_rate_vs_budget.png`` and
``results/alpha_sweep.png``.
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from dataclasses import dataclass

import torch

from benchmarks.simulate import SimulationResult, jamba_mini_config, meta_model, replay, tokenize_workload
from benchmarks.workloads import WORKLOADS, load_jsonl_chats
from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.toy import byte_tokenizer

GIB = 1024**3
UNBOUNDED = 2**50
BUDGET_FRACTIONS = (0.05, 0.1, 0.2, None)  # None: unbounded
ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0, 2.0)
ABSOLUTE_BUDGETS_GIB = (0.5, 1, 2, 4, 8)


@dataclass(frozen=True)
class Config:
    name: str
    eviction: str
    admit_divergence: bool
    retention_interval: int | str
    alpha: float | None = None

    def cache(self, model, budget: int) -> HybridPrefixCache:
        cache = HybridPrefixCache(
            model,
            retention_interval=self.retention_interval,
            max_cache_bytes=budget,
            eviction=self.eviction,
            admit_divergence=self.admit_divergence,
            seed=b"simulation",
        )
        if self.alpha is not None:
            cache.store.eviction.alpha = self.alpha  # the benchmark sweeps the weight the package fixes
        return cache


CONFIGS = (
    Config("lru r0", "lru", False, 0),  # the baseline: LRU, prompt-end and decode-end checkpoints only
    Config("lru r0 +div", "lru", True, 0),
    Config("flop r0", "flop_aware", False, 0),
    Config("flop r0 +div", "flop_aware", True, 0),
    Config("lru r512", "lru", False, 512),  # vLLM-style sparse retention
    Config("flop r512 +div", "flop_aware", True, 512),
    Config("lru dense", "lru", False, "dense"),
    Config("flop dense +div", "flop_aware", True, "dense"),
)
DEFAULT = CONFIGS[3]
BASELINE = CONFIGS[0]


def run(model, requests, config: Config, budget: int) -> SimulationResult:
    result = replay(config.cache(model, budget), requests)
    assert result.peak_stored_bytes <= budget, "the budget was exceeded"
    return result


def budget_label(fraction: float | None) -> str:
    return "unbounded" if fraction is None else f"{fraction:.0%}"


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def chat_replay_check(requests, dataset, result: SimulationResult, block_size: int) -> tuple[int, int, int]:
    """(b): turn k replays at most ``block_size`` + what turn k adds after the tokens turn k-1 ran (EOS, chat
    template, new message). Returns (turns checked, turns within the bound, max replay beyond the added tokens)."""
    last: dict[str, int] = {}
    checked = within = 0
    worst = -(10**9)
    for i, (request, session) in enumerate(zip(requests, dataset["session"])):
        if session in last:
            previous = requests[last[session]]
            ran = len(previous.prompt_ids) + len(previous.generated_ids) - 1
            added = len(request.prompt_ids) - ran
            beyond = result.replays[i] - added
            checked += 1
            within += beyond <= block_size
            worst = max(worst, beyond)
        last[session] = i
    return checked, within, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated names")
    parser.add_argument("--jsonl", help="a local JSONL file of chats to replay instead of the built-in workloads")
    parser.add_argument("--quick", action="store_true",
                        help="no sweeps; only the baseline and default configs unless --configs names others")
    parser.add_argument("--configs", help="comma-separated config names to run (default: all), e.g. 'flop r0 +div'")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    configs = select_configs(parser, args)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    tokenizer = byte_tokenizer()
    model = meta_model(jamba_mini_config())
    probe = HybridPrefixCache(model)
    checkpoint_bytes, kv_block_bytes = probe.spec.checkpoint_bytes, probe.spec.kv_block_bytes
    print(f"Jamba-1.5-Mini-sized model (meta device): checkpoint {checkpoint_bytes / 2**20:.1f} MiB, KV block of 16 "
          f"tokens {kv_block_bytes / 2**10:.0f} KiB\n")
    csv_rows: list[dict] = []
    curves: dict[str, dict[str, list[tuple[float, float]]]] = {}
    alpha_curves: dict[str, list[tuple[float, float, float]]] = {}
    sources = {os.path.basename(args.jsonl): lambda: load_jsonl_chats(args.jsonl)} if args.jsonl else {
        name: WORKLOADS[name] for name in args.workloads.split(",")
    }
    for name, make_dataset in sources.items():
        dataset = make_dataset()
        requests = tokenize_workload(dataset, tokenizer)
        tokens = sum(len(r.prompt_ids) for r in requests)
        started = time.perf_counter()
        unbounded = run(model, requests, DEFAULT, UNBOUNDED)
        all_checkpoints = unbounded.stats.checkpoints
        smallest = kv_block_bytes + checkpoint_bytes  # a cache refuses less (small workloads, e.g. a short JSONL file)
        budgets = {f: UNBOUNDED if f is None else max(int(f * all_checkpoints * checkpoint_bytes), smallest)
                   for f in BUDGET_FRACTIONS}
        print(f"## {name}: {len(requests)} requests, {tokens} prompt tokens; the defaults store {all_checkpoints} "
              f"checkpoints ({all_checkpoints * checkpoint_bytes / GIB:.1f} GiB) without a budget")
        header = ["config"] + [f"{budget_label(f)} ({b / GIB:.2f} GiB)" if f else "unbounded" for f, b in budgets.items()]
        rows, stored_rows = [], []
        results: dict[tuple[str, float | None], SimulationResult] = {}
        for config in configs:
            row = [config.name]
            for fraction, budget in budgets.items():
                result = unbounded if (config, fraction) == (DEFAULT, None) else run(model, requests, config, budget)
                results[config.name, fraction] = result
                s = result.stats
                row.append(f"{s.token_hit_rate:.3f}")
                curves.setdefault(name, {}).setdefault(config.name, []).append(
                    (budget / GIB if fraction else float("nan"), s.token_hit_rate))
                csv_rows.append(dict(workload=name, config=config.name, budget_fraction=fraction,
                                     budget_bytes=budget, token_hit_rate=s.token_hit_rate,
                                     flop_hit_rate=result.flop_hit_rate, kv_bytes=s.kv_bytes,
                                     checkpoint_bytes=s.checkpoint_bytes, peak_stored_bytes=result.peak_stored_bytes,
                                     evicted_kv_blocks=s.evicted_kv_blocks, evicted_checkpoints=s.evicted_checkpoints,
                                     divergence_checkpoints=s.divergence_checkpoints))
            rows.append(row)
            s = results[config.name, 0.1].stats
            stored_rows.append([config.name, f"{s.kv_bytes / GIB:.2f}", f"{s.checkpoint_bytes / GIB:.2f}",
                                f"{results[config.name, 0.1].flop_hit_rate:.3f}", str(s.evicted_checkpoints),
                                str(s.divergence_checkpoints)])
        print("\nToken hit rate by budget (share of the bytes of all checkpoints):\n")
        print(markdown(header, rows))
        print("\nAt the 10% budget: stored bytes at the end, FLOP hit rate, evictions:\n")
        print(markdown(["config", "KV GiB", "checkpoint GiB", "FLOP hit rate", "evicted checkpoints",
                        "divergence checkpoints"], stored_rows))
        if (DEFAULT.name, 0.1) in results and (BASELINE.name, 0.1) in results:
            default_rate = results[DEFAULT.name, 0.1].stats.token_hit_rate
            baseline_rate = results[BASELINE.name, 0.1].stats.token_hit_rate
            ratio = f"{default_rate / baseline_rate:.2f}x" if baseline_rate else "no baseline hits"
            print(f"\n{DEFAULT.name} / {BASELINE.name} at the 10% budget: {ratio} ({default_rate:.3f} vs "
                  f"{baseline_rate:.3f})")
        if (name == "b_multi_turn" or args.jsonl) and DEFAULT in configs:
            for fraction in budgets:
                checked, within, worst = chat_replay_check(requests, dataset, results[DEFAULT.name, fraction],
                                                           probe.block_size)
                print(f"chat turns, {DEFAULT.name}, budget {budget_label(fraction)}: {within}/{checked} later turns replay at "
                      f"most block_size + the added tokens (worst: {worst:+d} beyond the added tokens)")
        if not args.quick:
            alpha_rows = []
            for fraction in (0.05, 0.1):
                row = [budget_label(fraction)]
                for alpha in ALPHAS:
                    config = Config(f"alpha {alpha}", "flop_aware", True, 0, alpha)
                    rate = run(model, requests, config, budgets[fraction]).stats.token_hit_rate
                    alpha_curves.setdefault(name, []).append((fraction, alpha, rate))
                    row.append(f"{rate:.3f}")
                alpha_rows.append(row)
            print("\nflop_aware + divergence admission, retention 0: token hit rate by alpha:\n")
            print(markdown(["budget"] + [f"alpha {a:g}" for a in ALPHAS], alpha_rows))
            abs_rows = []
            for config in (BASELINE, DEFAULT):
                abs_row = [config.name]
                for gib in ABSOLUTE_BUDGETS_GIB:
                    result = run(model, requests, config, int(gib * GIB))
                    abs_row.append(f"{result.stats.token_hit_rate:.3f}")
                    if (name == "b_multi_turn" or args.jsonl) and config is DEFAULT:
                        checked, within, worst = chat_replay_check(requests, dataset, result, probe.block_size)
                        print(f"chat turns, {DEFAULT.name}, budget {gib:g} GiB: {within}/{checked} later turns within the "
                              f"bound (worst: {worst:+d} beyond the added tokens)")
                abs_rows.append(abs_row)
            print("\nBy absolute budget:\n")
            print(markdown(["config"] + [f"{g:g} GiB" for g in ABSOLUTE_BUDGETS_GIB], abs_rows))
        print(f"\n({time.perf_counter() - started:.0f} s)\n")
    write_csv(os.path.join(args.out, "hit_rate.csv"), csv_rows)
    plot(args.out, curves, alpha_curves)


def select_configs(parser: argparse.ArgumentParser, args) -> tuple[Config, ...]:
    if args.configs is None:
        return (BASELINE, DEFAULT) if args.quick else CONFIGS
    by_name = {config.name: config for config in CONFIGS}
    names = [name.strip() for name in args.configs.split(",")]
    unknown = [name for name in names if name not in by_name]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {list(by_name)}")
    return tuple(by_name[name] for name in names)


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def plot(out: str, curves, alpha_curves) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), squeeze=False)
    for ax, (name, by_config) in zip(axes[0], curves.items()):
        for config, points in by_config.items():
            bounded = [(b, r) for b, r in points if b == b]  # drop the unbounded point (nan)
            ax.plot([b for b, _ in bounded], [r for _, r in bounded], marker="o", label=config)
        ax.set_xscale("log")
        ax.set_title(name)
        ax.set_xlabel("budget (GiB)")
        ax.set_ylabel("token hit rate")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "hit_rate_vs_budget.png"), dpi=120)
    print(f"wrote {os.path.join(out, 'hit_rate_vs_budget.png')}")
    if alpha_curves:
        fig, axes = plt.subplots(1, len(alpha_curves), figsize=(5 * len(alpha_curves), 4), squeeze=False)
        for ax, (name, points) in zip(axes[0], alpha_curves.items()):
            for fraction in sorted({f for f, _, _ in points}):
                series = [(a, r) for f, a, r in points if f == fraction]
                ax.plot([a for a, _ in series], [r for _, r in series], marker="o", label=f"budget {fraction:.0%}")
            ax.set_title(name)
            ax.set_xlabel("alpha")
            ax.set_ylabel("token hit rate")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "alpha_sweep.png"), dpi=120)
        print(f"wrote {os.path.join(out, 'alpha_sweep.png')}")


if __name__ == "__main__":
    main()
