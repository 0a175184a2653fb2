"""Cost of the weights identity (:mod:`hf_hybridcache.core.weights`) on real model shapes, next to a 64-token forward.

For each shape of ``benchmarks/model_shapes.py`` (random weights; ``--shapes family:shape``) and each ``--dtypes``
one row:

- ``tensors``, ``GB``: the parameters and buffers the identity reads, and their bytes;
- ``full s``, ``GB/s``: ``weights_identity(model)``, every element read on its device (construction, ``save()``,
  ``load()``, ``clear()``, and a request whose key changed);
- ``sha256 s``: ``hashlib.sha256`` over the same bytes, for comparison (CPU tensors only; the identity uses the
  reduction instead because it runs on any device and gives the same value wherever the weights live);
- ``check ms``: the per-request check with unchanged weights (``WeightsTracker.refresh()``: ids, storage pointers
  and version counters of every tensor, 64 elements of each, the adapters' state);
- ``fwd 64 ms``: one forward of 64 tokens without a cache (``use_cache=False``), the least a hit's 64-token suffix
  forward costs, so ``check/fwd`` overstates the check's share; the bar is 1%.

Times are medians of ``--repeats`` runs; the check and the forward run in turn within each repeat, so their ratio is
measured side by side. Usage::

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/weights_identity.py
    PYTHONPATH=. python benchmarks/weights_identity.py --shapes qwen3_5_text:0.8b --dtypes bfloat16 --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/ttft.py

import torch

from benchmarks.model_shapes import build_shape_model
from hf_hybridcache import _compat
from hf_hybridcache.core import WeightsTracker, weights_identity

COLUMNS = ("shape", "dtype", "tensors", "GB", "full s", "GB/s", "sha256 s", "check ms", "fwd 64 ms", "check/fwd")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3_5_text:0.8b", "jamba:v0.1"],
                        help="family:shape pairs of benchmarks/model_shapes.py (default cuts apply)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=None, help="cut every shape to its first N layers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check-calls", type=int, default=20, help="per-request checks timed per repeat")
    return parser.parse_args(argv)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def sha256_seconds(model: torch.nn.Module) -> float:
    """Seconds to SHA-256 the raw bytes of every distinct parameter and buffer (zero-copy views)."""
    seen, seconds = set(), 0.0
    for _, tensor, value in _compat.weight_tensors(model):
        if id(tensor) not in seen and value.numel():
            seen.add(id(tensor))
            data = value.detach().contiguous().view(-1).view(torch.uint8).numpy()
            seconds += timed(lambda data=data: hashlib.sha256(data).digest())
    return seconds


def measure(family: str, shape: str, dtype: torch.dtype, args) -> tuple[dict, str]:
    model, description = build_shape_model(family, shape, args.layers, dtype=dtype)
    tensors = {id(t): t for _, t, _ in _compat.weight_tensors(model)}
    gigabytes = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    tracker = WeightsTracker(model)
    full, sha, check, forward = [], [], [], []
    with torch.no_grad():
        model(ids[:, :8], use_cache=False)  # warm-up (lazy inits, allocator)
        for _ in range(args.repeats):
            full.append(timed(lambda: weights_identity(model)))
            sha.append(sha256_seconds(model))
            check.append(statistics.median(timed(tracker.refresh) for _ in range(args.check_calls)))
            forward.append(timed(lambda: model(ids, use_cache=False)))
    assert not tracker.refresh(), "the weights did not change, so the fingerprint must not"
    full_s, check_s, forward_s = (statistics.median(v) for v in (full, check, forward))
    row = {
        "shape": f"{family}:{shape}", "dtype": str(dtype).removeprefix("torch."), "tensors": len(tensors),
        "GB": f"{gigabytes:.2f}", "full s": f"{full_s:.2f}", "GB/s": f"{gigabytes / full_s:.2f}",
        "sha256 s": f"{statistics.median(sha):.2f}", "check ms": f"{check_s * 1e3:.2f}",
        "fwd 64 ms": f"{forward_s * 1e3:.0f}", "check/fwd": f"{check_s / forward_s:.3%}",
    }
    return row, description


def print_table(rows: list[dict]) -> None:
    """A Markdown table, one row per shape and dtype."""
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in COLUMNS}
    print("| " + " | ".join(c.ljust(widths[c]) for c in COLUMNS) + " |")
    print("|-" + "-|-".join("-" * widths[c] for c in COLUMNS) + "-|")
    for row in rows:
        print("| " + " | ".join(str(row[c]).ljust(widths[c]) for c in COLUMNS) + " |")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs (CPU, shared machine)")
    rows = []
    for spec in args.shapes:
        family, shape = spec.split(":")
        for dtype_name in args.dtypes:
            row, description = measure(family, shape, getattr(torch, dtype_name), args)
            print(f"{spec} {dtype_name}: {description}", flush=True)
            rows.append(row)
            gc.collect()
    print_table(rows)


if __name__ == "__main__":
    main()
