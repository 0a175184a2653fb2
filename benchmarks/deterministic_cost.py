"""What deterministic mode costs the engine (issue 46's bar: tokens/s with the mode on at least 0.7x off).

For each model of a family (``--family``: Mamba, Mamba-2, Jamba, Zamba or Qwen3.5's text model; its toy, Jamba's
with 4 routed experts (top 2), and its 130M checkpoint's shape or, for Jamba, the ``small`` shape of
:mod:`benchmarks.model_shapes`, for Qwen3.5 its ``100m`` shape; Zamba: the toy only; random weights),
dtype and request count, two model instances
with the same weights serve ``HybridPrefixCache(model)`` and ``HybridPrefixCache(model, deterministic=True)``; each
runs ``generate_batch`` on ``R`` prompts of :data:`PROMPT_TOKENS` tokens (shorter than a block, so no round hits the
previous one's store) with :data:`NEW_TOKENS` greedy tokens each, so the time is mostly decode steps of ``R`` rows.
The two modes alternate round by round, with a third run of the deterministic model whose products all go through
``F.linear`` (``mkl``: :func:`~hf_hybridcache.kernels.batch_invariant.mkl_only`, the mode before its large float32
weights took oneDNN's product; the same as ``on`` in bf16); a cell is the best round's generated tokens per second
(all requests together), and ``ratio`` is on / off. Read a ratio under 0.7 as the mode missing the issue's bar there.

A second table times one ``generate()`` prefill of :data:`PREFILL_TOKENS` tokens (one new token, the store cleared
before each run) per model and dtype, the same way: in the mode every prompt token runs the decode step's arithmetic.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/deterministic_cost.py
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/deterministic_cost.py --models toy --rounds 2
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/deterministic_cost.py --family mamba2
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/deterministic_cost.py --family jamba
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/deterministic_cost.py --family qwen3_5_text
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as every benchmark here

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.kernels.batch_invariant import mkl_only
from hf_hybridcache.toy import build_model

from benchmarks.model_shapes import build_shape_model

PROMPT_TOKENS = 8
NEW_TOKENS = 32
PREFILL_TOKENS = 256
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: family -> the models ``--models`` may name (the first ones are the default).
MODELS = {"mamba": ("toy", "130m"), "mamba2": ("toy", "130m"), "jamba": ("toy", "small"), "zamba": ("toy",),
          "qwen3_5_text": ("toy", "100m")}
FAMILIES = tuple(MODELS)
#: Config overrides of a family's toy here: Jamba's toy gets routed experts (its default has one MLP per layer).
TOY_OVERRIDES = {"jamba": dict(num_experts=4, num_experts_per_tok=2)}


def _model(family: str, name: str, dtype: torch.dtype):
    if name == "toy":
        return build_model(family, seed=0, dtype=dtype, **TOY_OVERRIDES.get(family, {}))
    return build_shape_model(family, name, dtype=dtype)[0]


def _prompts(num_requests: int, vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(6, vocab_size, (num_requests, PROMPT_TOKENS), generator=gen).tolist()


def _tokens_per_s(model, prompts: list[list[int]], new_tokens: int) -> float:
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=config,
                                   continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=512))
    elapsed = time.perf_counter() - start
    return sum(len(o.generated_tokens) for o in outputs.values()) / elapsed


def measure(family: str, name: str, dtype: torch.dtype, num_requests: int, rounds: int,
            new_tokens: int) -> tuple[float, float, float]:
    """Best-round engine tokens/s ``(off, on, on with MKL's products only)`` for ``num_requests`` concurrent
    requests."""
    off_model = _model(family, name, dtype)
    on_model = copy.deepcopy(off_model)
    caches = HybridPrefixCache(off_model), HybridPrefixCache(on_model, deterministic=True)  # alive while serving
    prompts = _prompts(num_requests, off_model.config.vocab_size)
    for model in (off_model, on_model):  # warm-up: first-call costs out of the rounds
        _tokens_per_s(model, prompts, 2)
    best = {"off": 0.0, "on": 0.0, "mkl": 0.0}
    for _ in range(rounds):
        for run, model in (("off", off_model), ("on", on_model), ("mkl", on_model)):
            with mkl_only() if run == "mkl" else contextlib.nullcontext():
                best[run] = max(best[run], _tokens_per_s(model, prompts, new_tokens))
    del caches
    return best["off"], best["on"], best["mkl"]


def measure_prefill(family: str, name: str, dtype: torch.dtype, rounds: int) -> tuple[float, float, float]:
    """Best-round seconds of a :data:`PREFILL_TOKENS`-token ``generate()`` prefill ``(off, on, on with MKL's products
    only)``."""
    off_model = _model(family, name, dtype)
    on_model = copy.deepcopy(off_model)
    caches = HybridPrefixCache(off_model), HybridPrefixCache(on_model, deterministic=True)
    ids = torch.tensor(_prompts(1, off_model.config.vocab_size)[0] * (PREFILL_TOKENS // PROMPT_TOKENS))[None]
    best = {"off": float("inf"), "on": float("inf"), "mkl": float("inf")}
    for _ in range(rounds):
        for run, model, cache in (("off", off_model, caches[0]), ("on", on_model, caches[1]),
                                  ("mkl", on_model, caches[1])):
            cache.clear()
            with mkl_only() if run == "mkl" else contextlib.nullcontext():
                start = time.perf_counter()
                model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False, pad_token_id=0)
                best[run] = min(best[run], time.perf_counter() - start)
    return best["off"], best["on"], best["mkl"]


def main(argv: list[str] | None = None) -> list[tuple]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="mamba")
    parser.add_argument("--models", nargs="+", choices=sorted({m for ms in MODELS.values() for m in ms}),
                        help="default: the family's toy and its ~100M+ shape")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--requests", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    args = parser.parse_args(argv)
    args.models = args.models or list(MODELS[args.family])
    if set(args.models) - set(MODELS[args.family]):
        parser.error(f"--family {args.family} has the models {', '.join(MODELS[args.family])}")
    print(f"engine tokens/s, deterministic off vs on (torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}; prompts of {PROMPT_TOKENS} tokens, "
          f"{args.new_tokens} new tokens each, best of {args.rounds} alternating rounds)")
    print(f"{'model':<12} {'dtype':<5} {'requests':>8} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>6} "
          f"{'mkl tok/s':>10} {'ratio':>6}")
    rows = []
    for name in args.models:
        label = f"{args.family}-{name}"
        for dtype_name in args.dtypes:
            for num_requests in args.requests:
                off, on, mkl = measure(args.family, name, DTYPES[dtype_name], num_requests, args.rounds,
                                       args.new_tokens)
                rows.append((name, dtype_name, num_requests, off, on))
                print(f"{label:<12} {dtype_name:<5} {num_requests:>8} {off:>10.1f} {on:>10.1f} {on / off:>5.2f}x "
                      f"{mkl:>10.1f} {mkl / off:>5.2f}x", flush=True)
    print(f"\ngenerate() prefill of {PREFILL_TOKENS} tokens, seconds (best of {args.rounds} alternating rounds)")
    print(f"{'model':<12} {'dtype':<5} {'off s':>8} {'on s':>8} {'on/off':>7} {'mkl s':>8} {'mkl/off':>7}")
    for name in args.models:
        label = f"{args.family}-{name}"
        for dtype_name in args.dtypes:
            off, on, mkl = measure_prefill(args.family, name, DTYPES[dtype_name], args.rounds)
            print(f"{label:<12} {dtype_name:<5} {off:>8.3f} {on:>8.3f} {on / off:>6.2f}x {mkl:>8.3f} {mkl / off:>6.2f}x",
                  flush=True)
    return rows


if __name__ == "__main__":
    main()
