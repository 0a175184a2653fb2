"""Speculative steps in the continuous-batching engine: decode tokens/s with and without speculation, at acceptance
rates the benchmark controls.

Toy and random weights accept little on their own, so the drafts here are made to be accepted at set rates:

- ``ceiling``: each request's drafts are its own greedy continuation (known from the plain run), so every draft is
  accepted: what the machinery gives at most (llama-server's ``--spec-synth-rates 1``, the same idea);
- ``rate r``: each draft token is the true one with probability ``r`` (else a wrong one), so a draft's first ``i``
  tokens are kept with probability ``r^i``;
- ``draft model``: a copy of the target as :class:`~hf_hybridcache.engine.DraftModelDrafter` (every draft accepted,
  its own ``k`` forwards per step paid: the draft-model path's cost, not a speed-up);
- ``ngram``: :class:`~hf_hybridcache.engine.NgramDrafter` on a reply that repeats its prompt (the ``repeat``
  workload: the prompt ends with the model's own greedy continuation of a document, which it goes on repeating).

Each workload's ``plain`` row is the same engine without speculation; every row runs the same prompts (single stream
and 8 streams, all added at once), greedy, fp32, and its tokens are compared with the plain row's (``identical``).
Decode tokens/s = tokens after each request's first / (last token - first token of the run), from the engine's
token timestamps, so prefill is left out; ``accepted`` = accepted / drafted tokens. Ways run interleaved,
``--repeats`` times each, the best kept; ``vs plain`` divides by that workload's plain row measured in the same run.

Usage::

    PYTHONPATH=. python benchmarks/engine_speculative.py                           # the toy, 1 and 8 streams
    PYTHONPATH=. python benchmarks/engine_speculative.py --shape jamba:tiny-random # a 128M-parameter shape
"""

from __future__ import annotations

import argparse
import os
import random

# Sleeping OpenMP threads instead of spinning ones: a shared CPU otherwise stalls every small op (see ttft.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from transformers import GenerationConfig

from benchmarks.model_shapes import build_shape_model
from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.engine import DraftModelDrafter, Drafter, NgramDrafter, Speculation
from hf_hybridcache.toy import build_model


class SynthDrafter(Drafter):
    """Drafts each request's known continuation, each token true with probability ``rate`` (else a wrong one),
    from a generator seeded per request."""

    def __init__(self, continuations: dict[tuple, list[int]], rate: float, vocab_size: int) -> None:
        self.continuations, self.rate, self.vocab_size = continuations, rate, vocab_size
        self.rngs: dict[str, random.Random] = {}

    def propose(self, requests, num_tokens):
        drafts = []
        for request, n in zip(requests, num_tokens):
            rng = self.rngs.setdefault(request.request_id, random.Random(request.request_id))
            start = len(request.generated)
            true = self.continuations[tuple(request.prompt)][start : start + n]
            drafts.append([t if rng.random() < self.rate else (t + 1) % self.vocab_size for t in true])
        return drafts


def _model(args, seed: int = 0):
    """The toy (a Jamba whose greedy output settles into cycles, as benchmarks/speculative_multiturn.py's) or
    ``--shape family:shape`` (benchmarks/model_shapes.py, random weights)."""
    if args.shape:
        family, shape = args.shape.split(":")
        model, description = build_shape_model(family, shape, args.layers, seed=seed)
        return model, description
    model = build_model("jamba", seed=seed, long_memory=False, initializer_range=0.02, hidden_size=128,
                        intermediate_size=256, num_hidden_layers=8, attn_layer_period=8, attn_layer_offset=4,
                        mamba_dt_rank=16)
    return model, "toy jamba (hidden 128, 8 layers)"


def run_engine(cache, prompts: list[list[int]], new_tokens: int, speculation, salt: str) -> dict:
    """One run of ``prompts`` added at once; their tokens, decode tokens/s and what speculation kept."""
    generation = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=0)
    manager = cache.init_continuous_batching(generation, speculation=speculation)
    manager.start()
    try:
        ids = manager.add_requests(prompts, record_timestamps=True, cache_salt=salt)
        outputs = {}
        for request_id in ids:
            while request_id not in outputs:
                output = manager.get_result(request_id=request_id, timeout=600)
                assert output is not None and output.error is None, output
                if output.is_finished():
                    outputs[request_id] = output
    finally:
        manager.stop()
    ordered = [outputs[i] for i in ids]
    start = min(o.timestamps[0] for o in ordered)
    end = max(o.timestamps[-1] for o in ordered)
    stats = manager.batch_processor.speculator.stats
    decoded = sum(len(o.timestamps) - 1 for o in ordered)
    return dict(tokens=[o.generated_tokens for o in ordered], tps=decoded / (end - start), accepted=stats.acceptance_rate)


def _prompts(model, workload: str, streams: int, length: int, new_tokens: int, vocab_size: int) -> list[list[int]]:
    """``streams`` prompts of about ``length`` tokens: random ids (``text``), or a random document followed by the
    model's own greedy continuation of it (``repeat``: the reply goes on repeating it)."""
    prompts = []
    for i in range(streams):
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(6, vocab_size, (1, length), generator=g)
        if workload == "repeat":
            with torch.no_grad():
                ids = model.generate(ids[:, : length // 2], max_new_tokens=length - length // 2 + new_tokens,
                                     min_new_tokens=length - length // 2 + new_tokens, do_sample=False,
                                     pad_token_id=0)
        prompts.append(ids[0].tolist())
    return prompts


def _ways(args, workload: str, continuations: dict, vocab_size: int, draft_cache) -> dict:
    k = args.num_speculative_tokens
    if workload == "repeat":
        return {"plain": None, f"ngram k={k}": Speculation(NgramDrafter(), k)}
    ways = {"plain": None, f"ceiling k={k}": Speculation(SynthDrafter(continuations, 1.0, vocab_size), k)}
    for rate in args.rates:
        ways[f"rate {rate} k={k}"] = Speculation(SynthDrafter(continuations, rate, vocab_size), k)
    if draft_cache is not None:
        ways[f"draft model k={k}"] = Speculation(DraftModelDrafter(draft_cache), k)
    return ways


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default=None, help="family:shape of benchmarks/model_shapes.py (default: the toy)")
    parser.add_argument("--layers", type=int, default=None, help="cut --shape to its first N layers")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--workloads", nargs="+", default=["text", "repeat"], choices=["text", "repeat"])
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--rates", type=float, nargs="*", default=[0.8, 0.5])
    parser.add_argument("--draft-model", action="store_true", help="also a copy of the target as the draft model")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="runs per way (interleaved; the best is kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, description = _model(args)
    vocab_size = model.get_input_embeddings().num_embeddings
    cache = HybridPrefixCache(model)
    draft_cache = HybridPrefixCache(_model(args)[0]) if args.draft_model else None
    print(f"{description}, greedy fp32, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, "
          f"best of {args.repeats}, {torch.get_num_threads()} threads")
    print("| workload | streams | way | accepted | decode tokens/s | vs plain | identical |")
    print("|---|---:|---|---:|---:|---:|---|")
    rows = []
    for workload in args.workloads:
        for streams in args.streams:
            prompts = _prompts(model, workload, streams, args.prompt_tokens, args.new_tokens, vocab_size)
            reference = run_engine(cache, prompts, args.new_tokens, None, f"{workload}/{streams}/reference")
            continuations = {tuple(p): t for p, t in zip(prompts, reference["tokens"])}
            ways = _ways(args, workload, continuations, vocab_size, draft_cache)
            best: dict[str, dict] = {}
            for repeat in range(args.repeats):
                for name, speculation in ways.items():
                    salt = f"{workload}/{streams}/{name}/{repeat}"
                    run = run_engine(cache, prompts, args.new_tokens, speculation, salt)
                    if name not in best or run["tps"] > best[name]["tps"]:
                        best[name] = run
            for name, run in best.items():
                row = dict(workload=workload, streams=streams, way=name, accepted=run["accepted"], tps=run["tps"],
                           vs_plain=run["tps"] / best["plain"]["tps"],
                           identical=run["tokens"] == reference["tokens"])
                rows.append(row)
                accepted = "-" if name == "plain" else f"{row['accepted']:.2f}"
                print(f"| {workload} | {streams} | {name} | {accepted} | {row['tps']:.1f} | {row['vs_plain']:.2f}x | "
                      f"{row['identical']} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
