"""The tables ``benchmarks/ttft.py`` prints: TTFT per prefix with its ratios, the restore steps, the scan alone."""

from __future__ import annotations

import os
import statistics

import torch

from hf_hybridcache.kernels import backend


def _ms(seconds: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if seconds is None else f"{1e3 * seconds:>{width}.{digits}f}"


def _ratio(num: float | None, den: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if num is None or den is None else f"{num / den:>{width}.{digits}f}"


def model_line(args, model, device, dtype, spec, description: str) -> str:
    """One line naming the model (shape, parameters, layers), the device and the cache's per-entry bytes."""
    num_params = sum(p.numel() for p in model.parameters())
    layers = model.config.num_hidden_layers
    threads = f", {torch.get_num_threads()} CPU threads (OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']})"
    threads = threads if device.type == "cpu" else ""
    return (
        f"{description}: {num_params / 1e6:.1f}M parameters, {layers} layers ({len(spec.mamba)} with a recurrent/conv "
        f"state, {len(spec.attention)} with attention), {device.type} {str(dtype).removeprefix('torch.')}{threads}; "
        f"block_size {args.block_size}, retention {args.retention}; KV block {spec.kv_block_bytes / 2**10:.0f} KiB, "
        f"checkpoint {spec.checkpoint_bytes / 2**20:.2f} MiB; best of {args.repeats} (hits: "
        f"{args.repeats * args.hit_repeats}); kernel backend {backend.get_backend()}"
    )


def print_report(args, model, device, dtype, rows: dict, scan: list, spec, description: str) -> None:
    print("\n" + model_line(args, model, device, dtype, spec, description))
    print(
        f"TTFT in ms for prefix + {args.suffix_tokens}-token suffix (no cache* = stock with our scan swapped in, Jamba "
        "only; cpu time = the same miss/nocache* ratio in this process's CPU seconds)"
    )
    header = (
        f"{'prefix':>6} | {'no cache':>9} {'no cache*':>9} {'miss':>9} {'hit':>8} {'suffix':>7} | "
        f"{'hit/suffix':>10} {'nocache/hit':>11} {'miss/nocache':>12} {'miss/nocache*':>13} {'(cpu time)':>10} | "
        f"{'hit P':>5} {'max|dlogit|':>11}"
    )
    print(header)
    print("-" * len(header))
    for prefix_tokens, r in rows.items():
        star, star_cpu = r.get("no cache*"), r.get("no cache* cpu")
        print(
            f"{prefix_tokens:>6} | {_ms(r['no cache'], 9)} {_ms(star, 9)} {_ms(r['miss'], 9)} {_ms(r['hit'], 8)} "
            f"{_ms(r['suffix'], 7)} | {r['hit'] / r['suffix']:>10.2f} {r['no cache'] / r['hit']:>11.1f} "
            f"{r['miss'] / r['no cache']:>12.2f} {_ratio(r['miss'], star, 13, 2)} "
            f"{_ratio(r['miss cpu'], star_cpu, 10, 3)} | {r['hit_tokens']:>5} {r['max_logit_diff']:>11.1e}"
        )
    print("\nRestore of the hit, step by step (ms; bytes copied into the live cache)")
    header = (
        f"{'prefix':>6} | {'lookup':>7} {'KV gather':>9} {'KV MiB':>7} | {'ckpt copy':>9} {'ckpt MiB':>8} | "
        f"{'ckpts stored':>12} {'stored MiB':>10}"
    )
    print(header)
    print("-" * len(header))
    for prefix_tokens, r in rows.items():
        print(
            f"{prefix_tokens:>6} | {1e3 * r['lookup']:>7.2f} {1e3 * r['kv_gather']:>9.2f} {r['kv_bytes'] / 2**20:>7.2f}"
            f" | {1e3 * r['ckpt_copy']:>9.3f} {r['ckpt_bytes'] / 2**20:>8.2f} | {r['checkpoints']:>12} "
            f"{r['stored_bytes'] / 2**20:>10.1f}"
        )
    if scan:
        print(f"\nMamba-1 scan alone, {args.scan_tokens} tokens, first Mamba layer's shapes (ms)")
        base = scan[0][1]
        for name, seconds in scan:
            print(f"  {name:<44} {1e3 * seconds:>9.1f}   speed-up {base / seconds:>5.1f}x")
    hits = [r["hit"] / r["suffix"] for r in rows.values()]
    print(f"\nhit/suffix median {statistics.median(hits):.2f}")
