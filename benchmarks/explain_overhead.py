"""What a request's HitReport costs: the report of a 4k-token prompt against a forward of it.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/explain_overhead.py
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/explain_overhead.py --family qwen3_5_text --tokens 8192

Every request makes one :class:`~hf_hybridcache.core.explain.HitReport` per row right after its lookup
(``CacheCore.report``: the reason and its sentence, the records of evictions and earlier weights read) and counts and
logs it. This measures that call on a ``--tokens`` prompt in the states that cost the most or the least, beside the
lookup itself (``CacheCore.peek``: hashing the prompt's blocks) and one forward of the prompt without a cache, on the
same machine, interleaved; it prints the median of ``--repeats`` calls each:

- ``complete``: the prompt is stored with its checkpoint; the report reads nothing but the hit.
- ``new_tokens``: nothing stored starts like it (the cheapest miss).
- ``no_checkpoint``: the prompt ends inside a longer stored one that has no checkpoint there.
- ``evicted (worst)``: every block and checkpoint of the prompt was evicted: the report hashes the whole path again,
  following the record of evictions block by block.
- ``weights_changed``: the weights changed since the prompt was stored: the report searches it again under the
  earlier weights (a full lookup).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.toy import VOCAB_SIZE, build_model

#: A model size at which a forward on CPU takes long enough to time: the Space demo's built-in model.
SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2)


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def store_prompt(cache: HybridPrefixCache, ids: torch.Tensor) -> None:
    """Store ``ids`` as a request would, without running the model's decode: one cached forward of the prompt."""
    cache.reset()
    with torch.no_grad():
        cache.model(ids, **{CACHE_KWARG: cache}, use_cache=True)
    cache.reset()


def scenarios(model, ids: torch.Tensor):
    """``(name, cache, token ids)`` for each state of the module docstring."""
    tokens = ids[0].tolist()
    cache = HybridPrefixCache(model, retention_interval=0)
    yield "new_tokens", cache, tokens
    store_prompt(cache, ids)
    yield "complete", cache, tokens
    longer = torch.cat([ids, ids[:, :64]], dim=1)
    cache.clear()
    with torch.no_grad():
        cache.model(longer, **{CACHE_KWARG: cache}, use_cache=True)  # checkpoints at its end only
    cache.reset()
    yield "no_checkpoint", cache, tokens[: len(tokens) - 8]
    cache.clear()
    store_prompt(cache, ids)
    spec = cache.spec
    cache.max_cache_bytes = spec.kv_block_bytes + spec.checkpoint_bytes  # evicts every entry of the prompt
    yield "evicted (worst)", cache, tokens
    cache.max_cache_bytes = None
    store_prompt(cache, ids)
    weight = model.get_output_embeddings().weight
    with torch.no_grad():
        weight.add_(1e-3)
    yield "weights_changed", cache, tokens
    with torch.no_grad():
        weight.sub_(1e-3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="jamba")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--forward-repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = build_model(args.family, seed=0, **SIZES)
    cold = build_model(args.family, seed=0, **SIZES)
    ids = torch.randint(6, VOCAB_SIZE, (1, args.tokens))

    def forward() -> None:
        with torch.no_grad():
            cold(ids)

    forward()  # one-time costs out of the timing
    print(f"{args.family}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, a {args.tokens:,}-token "
          f"prompt, block_size 16, median of {args.repeats} calls (forward: of {args.forward_repeats})")
    print(f"| state | reason | report (us) | lookup (us) | forward (ms) | report / forward |")
    print("|---|---|---:|---:|---:|---:|")
    for name, cache, tokens in scenarios(model, ids):
        core = cache.core
        root = core.request_root(None)
        hit = core.peek(tokens, root)
        report = core.report(tokens, root, hit)
        lookup_s = median_seconds(lambda: core.peek(tokens, root), args.repeats)
        report_s = median_seconds(lambda: core.report(tokens, root, hit), args.repeats)
        forward_s = median_seconds(forward, args.forward_repeats)
        print(f"| {name} | {report.reason} | {report_s * 1e6:,.1f} | {lookup_s * 1e6:,.1f} | {forward_s * 1e3:,.1f} | "
              f"{report_s / forward_s:.2e} |")


if __name__ == "__main__":
    main()
