"""Linear layers at a few tokens on CPU: ``F.linear`` against the batched form of
``hf_hybridcache.kernels.decode_linear`` (issue 35), per weight shape, token count and thread count.

Each weight is read from memory, not cache: the script cycles through enough copies of it to exceed ~200 MB. The
shapes are the Jamba-tiny-random shape's (hidden 128: an expert's gate and up projections, its down projection, the
LM head) and a few others; ``routed`` says whether the package routes that weight (``weight_qualifies``).

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/decode_linear.py
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/decode_linear.py --threads 1 2 --rows 1 8
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as every benchmark here

import torch
import torch.nn.functional as F

from hf_hybridcache.kernels.decode_linear import decode_linear, weight_qualifies

#: (N, K, what it is)
SHAPES = [
    (28672, 128, "Jamba 128M expert gate+up"),
    (128, 14336, "Jamba 128M expert down"),
    (65536, 128, "Jamba 128M LM head"),
    (14336, 128, "Jamba 128M MLP gate / up"),
    (4096, 128, "2 MiB, the smallest routed"),
    (4864, 896, "a 0.5B model's MLP gate / up"),
    (2048, 2048, "square 2048"),
]


def _ms(fn, weights, x, repeats: int) -> float:
    fn(x, weights[0])
    started = time.perf_counter()
    for _ in range(repeats):
        for w in weights:
            fn(x, w)
    return (time.perf_counter() - started) / (repeats * len(weights)) * 1e3


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8], help="tokens in the step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--megabytes", type=float, default=200.0, help="weight copies cycled through per shape")
    args = parser.parse_args(argv)
    results = []
    print(f"{'shape N x K':>14} {'what':<30}{'routed':>7}{'threads':>8}{'rows':>5}{'F.linear ms':>13}"
          f"{'batched ms':>12}{'speed-up':>10}")
    for n, k, what in SHAPES:
        copies = max(2, int(args.megabytes * 1e6 / (n * k * 4)))
        weights = [torch.randn(n, k) for _ in range(copies)]
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                x = torch.randn(rows, k)
                base = _ms(F.linear, weights, x, args.repeats)
                ours = _ms(decode_linear, weights, x, args.repeats)
                row = dict(n=n, k=k, what=what, routed=weight_qualifies((n, k)), threads=threads, rows=rows,
                           linear_ms=base, batched_ms=ours)
                results.append(row)
                print(f"{f'{n} x {k}':>14} {what:<30}{'yes' if row['routed'] else 'no':>7}{threads:>8}{rows:>5}"
                      f"{base:>13.3f}{ours:>12.3f}{base / ours:>9.2f}x")
    return results


if __name__ == "__main__":
    main()
