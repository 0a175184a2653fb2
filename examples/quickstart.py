"""Quickstart: a support desk whose long system prompt is reused across generate() calls.

Builds a small Jamba-shaped model in code (seeded, long-memory init, byte-level tokenizer; no downloads) or loads a
real checkpoint with ``--model``, runs the same requests without and with one HybridPrefixCache, and prints per
request the prompt tokens, the hit, TTFT without vs with the cache and whether the generated tokens are identical.

    python examples/quickstart.py                       # built-in model, ~4k-token system prompt, 6 questions
    python examples/quickstart.py --model ai21labs/AI21-Jamba-Mini-1.5 --new-tokens 32
"""

from __future__ import annotations

import argparse
import os
import random
import time

# On a shared, oversubscribed CPU, OpenMP threads that spin at barriers stall every small torch op (set before torch
# loads OpenMP; the same setting as benchmarks/ttft.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

from hf_hybridcache import CACHE_KWARG, DEFAULT_MAX_CACHE_BYTES, HybridPrefixCache, supported_model_types
from hf_hybridcache.config import CacheOptions
from hf_hybridcache.toy import TINY_CONFIGS, build_model, byte_tokenizer

#: Families the built-in model can take: those with a tiny config that the installed transformers serves.
FAMILIES = sorted(set(TINY_CONFIGS) & set(supported_model_types()))

QUESTIONS = [
    "My order arrived with a cracked screen. What are my options?",
    "Can I change the delivery address after the parcel has shipped?",
    "How long does a refund take to reach my card?",
    "The app logs me out every few minutes. How do I fix that?",
    "Do you ship replacement batteries to Norway?",
    "I was charged twice for one subscription month. Please help.",
    "How do I transfer my warranty to a new owner?",
    "Is there a discount for ordering ten units for a school?",
]

_TOPICS = ["returns", "refunds", "shipping", "warranty", "accounts", "billing", "repairs", "privacy"]
_RULES = [
    "Agents must confirm the order number before discussing {t}.",
    "For {t}, answers cite the policy section and the date it took effect.",
    "Escalate {t} cases older than 30 days to a team lead.",
    "Never promise a timeline for {t} that the policy does not state.",
    "Summarize the customer's {t} question in one sentence before answering.",
    "Offer the self-service page for {t} when the customer prefers it.",
]


def support_desk_system_prompt(min_chars: int, seed: int = 0) -> str:
    """A long, deterministic support-desk policy text (about one token per character with the byte tokenizer)."""
    rng = random.Random(seed)
    lines = ["You are the support assistant of Northwind Devices. Follow the policies below.", ""]
    section = 1
    while sum(len(line) + 1 for line in lines) < min_chars:
        topic = rng.choice(_TOPICS)
        lines.append(f"Section {section}: {topic}.")
        lines.extend(rng.choice(_RULES).format(t=topic) for _ in range(4))
        section += 1
    return "\n".join(lines)


class _FirstTokenTimer(BaseStreamer):
    """Records when generate() emits its first new token (the first put after the prompt)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self._puts = 0

    def put(self, value) -> None:
        self._puts += 1
        if self._puts == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass

    @property
    def ttft_seconds(self) -> float:
        return self.first_token_at - self.start


def _retention(text: str) -> int | str:
    """argparse type of --retention: "dense" or a non-negative int (the cache checks it is a multiple of the block)."""
    if text == "dense":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected "dense" or a number of tokens, got {text!r}') from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a retention interval is 0 or a positive multiple of the block, got {value}")
    return value


def _generate(model, ids, new_tokens, cache=None):
    timer = _FirstTokenTimer()
    kwargs = {CACHE_KWARG: cache} if cache is not None else {}
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, streamer=timer, **kwargs)
    return out[:, ids.shape[1] :], timer.ttft_seconds


def load(args):
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto").eval()
        return model, tokenizer
    overrides = {}
    if args.family == "jamba":  # Jamba-shaped: one attention layer per eight, a mixture of experts every other layer
        overrides = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, attn_layer_period=8,
                         attn_layer_offset=4, num_experts=4, num_experts_per_tok=2, mamba_dt_rank=16)
    elif args.family == "zamba":  # Zamba-shaped: the default layout, one shared attention block every six layers
        overrides = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=13, layers_block_type=None,
                         mamba_dt_rank=16, max_position_embeddings=8192)
    return build_model(args.family, seed=args.seed, **overrides), byte_tokenizer()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="path or hub id of a real checkpoint (default: built-in small model)")
    parser.add_argument("--family", default="jamba", choices=FAMILIES,
                        help="family of the built-in model (default: jamba; ignored with --model)")
    parser.add_argument("--system-tokens", type=int, default=4000, help="length of the shared system prompt")
    parser.add_argument("--questions", type=int, default=6, help="number of user questions (requests)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--retention", default="dense", type=_retention,
                        help='"dense", 0 or a multiple of the block size (tokens)')
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    retention = args.retention
    try:  # the cache's own checks, before the cold runs spend a minute
        CacheOptions(args.block_size, retention, DEFAULT_MAX_CACHE_BYTES, True, "flop_aware")
    except ValueError as error:
        parser.error(str(error))

    model, tokenizer = load(args)
    system = support_desk_system_prompt(args.system_tokens, seed=args.seed)
    prompts = [
        tokenizer(f"{system}\n\nCustomer: {q}\nAssistant:", return_tensors="pt").input_ids
        for q in (QUESTIONS * (args.questions // len(QUESTIONS) + 1))[: args.questions]
    ]
    cold = [_generate(model, ids, args.new_tokens) for ids in tqdm(prompts, desc="without the cache", unit="req")]
    cache = HybridPrefixCache(model, block_size=args.block_size, retention_interval=retention)
    rows = []
    for ids, (cold_tokens, cold_ttft) in tqdm(list(zip(prompts, cold)), desc="with the cache", unit="req"):
        tokens, ttft = _generate(model, ids, args.new_tokens, cache)
        rows.append(dict(prompt=ids.shape[1], hit=cache.last_hit_tokens[0], ttft_cold=cold_ttft, ttft_cached=ttft,
                         identical=torch.equal(tokens, cold_tokens)))

    print(f"model: {args.model or f'built-in {args.family} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params)'}"
          f", block_size={args.block_size}, retention_interval={retention!r}")
    print(f"{'request':>7} {'prompt':>7} {'hit':>6} {'replayed':>8} {'TTFT no cache':>14} {'TTFT cached':>12} "
          f"{'speed-up':>8} {'identical':>9}")
    for i, r in enumerate(rows, 1):
        print(f"{i:>7} {r['prompt']:>7} {r['hit']:>6} {r['prompt'] - r['hit']:>8} {r['ttft_cold'] * 1e3:>11.0f} ms "
              f"{r['ttft_cached'] * 1e3:>9.0f} ms {r['ttft_cold'] / r['ttft_cached']:>7.1f}x {r['identical']!s:>9}")
    stats = cache.stats
    print(f"stats: {stats}")
    print(f"token hit rate {stats.token_hit_rate:.1%}, stored {stats.stored_bytes / 2**20:.1f} MiB of "
          f"{stats.max_cache_bytes / 2**20:.0f} MiB")
    return {"rows": rows, "stats": stats}


if __name__ == "__main__":
    main()
