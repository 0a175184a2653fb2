"""bf16 multi-turn chats with HybridPrefixCache against a cold run: how often the outputs differ, where the hit came
from, and what replaying replies costs.

Each trial is one chat of ``--turns`` turns on a tiny seeded model (``hf_hybridcache.toy.build_model``): turn 1 is a
random prompt, turn k is turn k-1's prompt + its greedy reply (``--new-tokens``) + a random new message. Every turn
runs with the cache (one cache per chat) and without it (an unpatched model with the same weights), and is compared
on its greedy tokens and its first-step logits (bit for bit). A turn's hit comes from a checkpoint taken inside a
prefill ("prefill") or past the previous turn's prompt, in its reply ("reply"). The same turn is also compared with
the stock computation of its path: a ``DynamicCache`` filled by the same model in the same pieces the cached run
computed (decode steps one token at a time, or the replay of the reply as one forward), then continued by
``generate()``.

Each configuration runs with ``replay_replies`` off (decode-made KV and checkpoints are stored: the behaviour before
it existed) and on (the default in bf16). The cost table times each turn's ``generate()`` with the replay on and off,
interleaved per turn, and the time spent in the replay itself (best of ``--repeats``; the machine is shared, so read
the ratios, not the absolute times).

Usage::

    PYTHONPATH=. python benchmarks/bf16_multiturn.py                          # flip table + cost table (~6 min)
    PYTHONPATH=. python benchmarks/bf16_multiturn.py --families lfm2 kimi_linear --seeds 4 --skip-cost
    PYTHONPATH=. python benchmarks/bf16_multiturn.py --skip-flips --families --shape qwen3_5_text:0.8b --layers 4 \
        --seeds 2 --new-tokens 64                                              # the cost on a real model shape
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field

# Sleeping OpenMP threads instead of spinning ones: a shared CPU otherwise stalls every small op (see ttft.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from transformers import DynamicCache

from benchmarks.model_shapes import build_shape_model
from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.generate import lifecycle
from hf_hybridcache.store import last_boundary
from hf_hybridcache.toy import VOCAB_SIZE, build_model


@dataclass
class Turn:
    """One turn of a chat: prompt length, hit, where the hit came from, and how it compares."""

    prompt_tokens: int
    hit_tokens: int
    source: str  # "miss", "prefill" or "reply"
    tokens_equal_cold: bool
    logits_equal_cold: bool
    max_dlogit: float
    tokens_equal_stock: bool
    logits_equal_stock: bool


@dataclass
class Path:
    """The forwards that computed a cached state, as ``(start, end, one_token_steps)`` pieces."""

    pieces: list[tuple[int, int, bool]] = field(default_factory=list)

    def extended(self, start: int, end: int, steps: bool = False) -> Path:
        return Path(self.pieces + [(start, end, steps)] if end > start else list(self.pieces))


def greedy(model, ids: torch.Tensor, new_tokens: int, past=None):
    """(sequences [1, L + n], first-step logits [V]) of greedy generation."""
    kwargs = {} if past is None else {CACHE_KWARG: past}
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs,
    )
    return out.sequences, out.logits[0][0]


def stock_continuation(model, ids: torch.Tensor, path: Path, new_tokens: int):
    """Greedy generation from a ``DynamicCache`` that the same model filled along ``path`` (no prefix cache)."""
    past = DynamicCache(config=model.config)
    with torch.no_grad():
        for start, end, steps in path.pieces:
            for lo in range(start, end) if steps else [start]:
                hi = lo + 1 if steps else end
                positions = torch.arange(lo, hi)[None]
                model(ids[:, lo:hi], **{CACHE_KWARG: past}, use_cache=True, position_ids=positions)
    return greedy(model, ids, new_tokens, past)


def chat(model, cold, seed: int, args, replay: bool, always_stock: bool = True) -> list[Turn]:
    """One chat of ``args.turns`` turns with a fresh cache; each turn compared with the cold run and the stock path
    (with ``always_stock=False`` only where it differs from the cold run; elsewhere the stock columns say equal)."""
    g = torch.Generator().manual_seed(seed)
    cache = HybridPrefixCache(model, replay_replies=replay)
    ids = torch.randint(6, VOCAB_SIZE, (1, args.prompt_tokens + seed), generator=g)
    paths = {0: Path()}  # boundary -> the pieces that computed the checkpoint stored there
    turns = []
    for _ in range(args.turns):
        length = ids.shape[1]
        seq, logits = greedy(model, ids, args.new_tokens, cache)
        hit = cache.last_hit_tokens[0]
        ref_seq, ref_logits = greedy(cold, ids, args.new_tokens)
        path = paths[hit]
        cold_equal = torch.equal(seq, ref_seq) and torch.equal(logits, ref_logits)
        if always_stock or not cold_equal:
            stock_seq, stock_logits = stock_continuation(model, ids, path, args.new_tokens)
        else:
            stock_seq, stock_logits = seq, logits
        previous = turns[-1].prompt_tokens if turns else 0
        source = "miss" if hit == 0 else "reply" if turns and hit > previous else "prefill"
        turns.append(Turn(
            length, hit, source, torch.equal(seq, ref_seq), torch.equal(logits, ref_logits),
            (logits.float() - ref_logits.float()).abs().max().item(),
            torch.equal(seq, stock_seq), torch.equal(logits, stock_logits),
        ))
        _record_paths(paths, path, hit, length, seq.shape[1] - 1, args.block_size, replay)
        ids = torch.cat([seq, torch.randint(6, VOCAB_SIZE, (1, args.message_tokens), generator=g)], dim=1)
    return turns


def _record_paths(paths: dict[int, Path], path: Path, hit: int, length: int, fed: int, bs: int, replay: bool) -> None:
    """The pieces behind the checkpoints a turn stored (retention 0): the prompt-end ones, taken inside its prefill
    from ``hit``, and the decode-end one, at the last boundary of the ``fed`` tokens the model consumed."""
    prompt_end = last_boundary(length, bs)
    for boundary in {prompt_end, last_boundary(length - (2 if replay else 1), bs)}:
        paths.setdefault(boundary, path.extended(hit, boundary))
    decode_end = last_boundary(fed, bs)
    if decode_end > length:
        if replay:  # one forward from the prompt-end checkpoint
            paths.setdefault(decode_end, paths[prompt_end].extended(prompt_end, decode_end))
        else:  # the prompt's forward, then one decode step per token
            paths.setdefault(decode_end, path.extended(hit, length).extended(length, decode_end, steps=True))


def flip_table(args) -> None:
    print(f"\n{args.turns}-turn chats, {args.seeds} seeds, {args.dtype}, {args.new_tokens} new tokens per turn, "
          f"block_size {args.block_size}; 'equal' = bit for bit")
    header = ("family", "replay_replies", "hits prefill/reply", "tokens != cold", "logits != cold",
              "max|dlogit|", "tokens != stock path", "logits != stock path")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    dtype = getattr(torch, args.dtype)
    for family in args.families:
        model, cold = build_model(family, dtype=dtype), build_model(family, dtype=dtype)
        for replay in (False, True):
            turns = [t for seed in range(args.seeds) for t in chat(model, cold, seed, args, replay)]
            hits = [t for t in turns if t.source != "miss"]
            count = lambda pred: f"{sum(1 for t in hits if pred(t))}/{len(hits)}"  # noqa: E731
            row = (
                family, "on" if replay else "off",
                f"{sum(t.source == 'prefill' for t in hits)}/{sum(t.source == 'reply' for t in hits)}",
                count(lambda t: not t.tokens_equal_cold), count(lambda t: not t.logits_equal_cold),
                f"{max((t.max_dlogit for t in hits), default=0.0):.3g}",
                count(lambda t: not t.tokens_equal_stock), count(lambda t: not t.logits_equal_stock),
            )
            print("| " + " | ".join(row) + " |", flush=True)


class _ReplayTimer:
    """Wraps the lifecycle's ``replay_replies`` to time it (benchmark only)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = lifecycle.replay_replies

    def __enter__(self):
        def timed(cache):
            started = time.perf_counter()
            try:
                return self._original(cache)
            finally:
                self.seconds += time.perf_counter() - started

        lifecycle.replay_replies = timed
        return self

    def __exit__(self, *exc) -> None:
        lifecycle.replay_replies = self._original


def cost_table(args) -> None:
    print(f"\nCost of replay_replies: each turn's generate() with the replay off and on (interleaved, best of "
          f"{args.repeats}), {args.dtype}, {args.new_tokens} new tokens, {args.seeds} chats x {args.turns} turns")
    header = ("family", "request ms (off)", "request ms (on)", "replay ms", "replay / request",
              "replayed tokens per request")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for label, model in _cost_models(args):
        totals = {False: 0.0, True: 0.0}
        replay_seconds = requests = replayed = 0
        for seed in range(args.seeds):
            best = {False: [], True: []}
            replay_best = []
            for _ in range(args.repeats):
                for replay in (False, True):
                    with _ReplayTimer() as timer:
                        times, tokens = _timed_chat(model, seed, args, replay)
                    best[replay] = [min(a, b) for a, b in zip(best[replay], times)] if best[replay] else times
                    if replay:
                        replay_best.append(timer.seconds)
                        replayed_now = tokens
            for replay in (False, True):
                totals[replay] += sum(best[replay])
            replay_seconds += min(replay_best)
            requests += args.turns
            replayed += replayed_now
        off, on = totals[False] / requests * 1e3, totals[True] / requests * 1e3
        replay_ms = replay_seconds / requests * 1e3
        print(f"| {label} | {off:.1f} | {on:.1f} | {replay_ms:.2f} | {replay_ms / off:.1%} | "
              f"{replayed / requests:.1f} |", flush=True)


def _cost_models(args):
    """``(label, model)`` of each tiny family, then of ``--shape`` (a real model shape, random weights)."""
    dtype = getattr(torch, args.dtype)
    for family in args.families:
        yield family, build_model(family, dtype=dtype)
    if args.shape:
        family, shape = args.shape.split(":")
        model, description = build_shape_model(family, shape, args.layers, dtype=dtype)
        yield description, model


def _timed_chat(model, seed: int, args, replay: bool) -> tuple[list[float], int]:
    """Seconds of each turn's ``generate()`` with a fresh cache, and the reply tokens replayed over the chat."""
    g = torch.Generator().manual_seed(seed)
    cache = HybridPrefixCache(model, replay_replies=replay)
    ids = torch.randint(6, VOCAB_SIZE, (1, args.prompt_tokens + seed), generator=g)
    times = []
    for _ in range(args.turns):
        started = time.perf_counter()
        seq, _ = greedy(model, ids, args.new_tokens, cache)
        times.append(time.perf_counter() - started)
        ids = torch.cat([seq, torch.randint(6, VOCAB_SIZE, (1, args.message_tokens), generator=g)], dim=1)
    return times, cache.stats.replayed_reply_tokens


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=["zamba2", "jamba", "qwen3_next"])
    parser.add_argument("--seeds", type=int, default=8, help="chats per family (seeds 0..N-1)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=24, help="greedy tokens per turn")
    parser.add_argument("--prompt-tokens", type=int, default=37, help="turn 1's prompt length (+ the seed)")
    parser.add_argument("--message-tokens", type=int, default=11, help="new tokens each later turn adds")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=3, help="timing runs per chat (the best counts)")
    parser.add_argument("--shape", help="FAMILY:SHAPE of benchmarks/model_shapes.py to add to the cost table")
    parser.add_argument("--layers", type=int, help="cut --shape to its first N layers")
    parser.add_argument("--skip-cost", action="store_true", help="print the flip table only")
    parser.add_argument("--skip-flips", action="store_true", help="print the cost table only")
    args = parser.parse_args(argv)
    args.block_size = 16
    torch.set_num_threads(1)
    if not args.skip_flips:
        flip_table(args)
    if not args.skip_cost:
        cost_table(args)


if __name__ == "__main__":
    main()
