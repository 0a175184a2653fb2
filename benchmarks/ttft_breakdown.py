"""Where a hit's time goes: the hit against the suffix-only bound and against stock transformers continuing from its
own cache, with the restore alone and a profile of the hit's ops.

For one prefix length, in turn within each repeat (best of ``--repeats``):

- ``suffix``: prefilling only the suffix with no cache (the lower bound of a hit);
- ``stock continuation``: transformers' own ``DynamicCache`` holding the prefix (prefilled once, copied before each
  run, the copy not timed), then ``generate`` on prefix + suffix: what the suffix costs over a cached prefix without
  this package (its attention reads the prefix's keys, as a hit's does);
- ``hit``: HybridPrefixCache restores the prefix and replays the suffix;
- ``restore``: ``cache.restore`` alone (lookup, KV gather, checkpoint copy into the live layers).

The hit's first-token logits are compared with the stock continuation's (``max|dlogit|``).

Then ``torch.profiler`` tables of the hit and of the suffix-only run (ops by self CPU time).

    PYTHONPATH=. python benchmarks/ttft_breakdown.py --family qwen3_5_text --shape 0.8b --prefix-tokens 4096
"""

from __future__ import annotations

import argparse
import copy
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as every benchmark here (see ttft.py)

import torch
from transformers import DynamicCache

from benchmarks.model_shapes import SHAPES, build_shape_model
from benchmarks.ttft import first_token, random_ids, timed
from hf_hybridcache import CACHE_KWARG, HybridPrefixCache


def stock_prefix_cache(model, prefix: torch.Tensor) -> DynamicCache:
    """transformers' own cache after a forward of ``prefix``."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prefix, **{CACHE_KWARG: cache}, use_cache=True, logits_to_keep=1)
    return cache


def measure(args, model, cache, prefix_tokens: int) -> dict[str, float]:
    device = model.device
    prefix = random_ids(prefix_tokens, seed=prefix_tokens, device=device)
    prompts = [torch.cat([prefix, random_ids(args.suffix_tokens, seed=s, device=device)], 1) for s in range(3, 9)]
    first_token(model, torch.cat([prefix, random_ids(args.suffix_tokens, seed=1, device=device)], 1), cache)
    stock = stock_prefix_cache(model, prefix)
    times: dict[str, list[float]] = {}
    max_logit_diff = 0.0
    for repeat in range(args.repeats):
        prompt = prompts[repeat % len(prompts)]
        suffix = prompt[:, prefix_tokens:]
        times.setdefault("suffix", []).append(timed(device, lambda s=suffix: first_token(model, s))[0])
        own = copy.deepcopy(stock)
        seconds, reference = timed(device, lambda p=prompt, c=own: first_token(model, p, c))
        times.setdefault("stock continuation", []).append(seconds)
        seconds, logits = timed(device, lambda p=prompt: first_token(model, p, cache))
        times.setdefault("hit", []).append(seconds)
        max_logit_diff = max(max_logit_diff, (logits - reference).abs().max().item())
        cache.reset()
        times.setdefault("restore", []).append(timed(device, lambda p=prompt: cache.restore(p))[0])
        cache.reset()
    best = {name: min(values) for name, values in times.items()}
    best["max|dlogit| (hit vs stock continuation)"] = max_logit_diff
    return best


def profile(label: str, fn, row_limit: int) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    print(f"\nprofile of the {label} (ops by self CPU time)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit, max_name_column_width=48))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(SHAPES), default="qwen3_5_text")
    parser.add_argument("--shape", default="0.8b")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--prefix-tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--suffix-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile-rows", type=int, default=25, help="0: no profile")
    args = parser.parse_args(argv)
    model, description = build_shape_model(args.family, args.shape, args.layers)
    cache = HybridPrefixCache(model)
    print(f"{description}, {torch.get_num_threads()} threads; best of {args.repeats} (ms)")
    for prefix_tokens in args.prefix_tokens:
        r = measure(args, model, cache, prefix_tokens)
        bound = r["suffix"]
        print(f"\nprefix {prefix_tokens} + suffix {args.suffix_tokens}")
        for name, value in r.items():
            if name.startswith("max"):
                print(f"  {name}: {value:.1e}")
            else:
                print(f"  {name:<20} {1e3 * value:>8.1f} ms  {value / bound:>5.2f}x suffix")
        if args.profile_rows:
            prefix = random_ids(prefix_tokens, seed=prefix_tokens, device=model.device)
            prompt = torch.cat([prefix, random_ids(args.suffix_tokens, seed=99, device=model.device)], 1)
            suffix = prompt[:, prefix_tokens:]
            profile("hit", lambda p=prompt: first_token(model, p, cache), args.profile_rows)
            profile("suffix-only run", lambda s=suffix: first_token(model, s), args.profile_rows)


if __name__ == "__main__":
    main()
