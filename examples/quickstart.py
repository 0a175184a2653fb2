"""Quickstart: a support desk whose long system prompt is reused across generate() calls.

Builds a small Jamba-shaped model in code (seeded, long-memory init, byte-level tokenizer; no downloads) or loads a
real checkpoint with ``--model``, runs the same requests three times: through transformers alone (the reference
outputs), cold (through the same patched model with an emptied cache, so every request is a miss: the baseline
TTFT) and with one HybridPrefixCache kept across requests. It prints per request the prompt tokens, the hit, the
cold and cached TTFT, the largest first-step logit difference of the cached run from the reference, and whether the
cached run is exact (identical tokens, and in float32 those logits within 1e-4: docs/exactness.md).

    python examples/quickstart.py                       # built-in model, ~4k-token system prompt, 6 questions
    python examples/quickstart.py --model ai21labs/AI21-Jamba-Mini-1.5 --new-tokens 32
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import NamedTuple

# On a shared, oversubscribed CPU, OpenMP threads that spin at barriers stall every small torch op (set before torch
# loads OpenMP; the same setting as benchmarks/ttft.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

from hf_hybridcache import CACHE_KWARG, DEFAULT_MAX_CACHE_BYTES, HybridPrefixCache, supported_model_types
from hf_hybridcache.config import CacheOptions
from hf_hybridcache.toy import TINY_CONFIGS, build_model, byte_tokenizer

#: The bound on a cached run's first-step logits against a cold run that the package states, per dtype
#: (docs/exactness.md); other dtypes are judged by their tokens alone.
LOGIT_TOLERANCE = {torch.float32: 1e-4}

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


def support_desk_system_prompt(num_tokens: int, tokenizer, seed: int = 0) -> str:
    """A deterministic support-desk policy text of ``num_tokens`` tokens of ``tokenizer`` (special tokens aside): whole
    policy sections cut at that token (the cut decoded and encoded again may merge a token or two of a BPE
    tokenizer; the byte tokenizer keeps it exact)."""
    rng = random.Random(seed)
    lines = ["You are the support assistant of Northwind Devices. Follow the policies below.", ""]
    section = 1
    # ASCII text has no more tokens than characters: tokenize only once the characters would do
    while sum(len(line) + 1 for line in lines) < num_tokens or len(_ids(tokenizer, lines)) < num_tokens:
        topic = rng.choice(_TOPICS)
        lines.append(f"Section {section}: {topic}.")
        lines.extend(rng.choice(_RULES).format(t=topic) for _ in range(4))
        section += 1
    return tokenizer.decode(_ids(tokenizer, lines)[:num_tokens])


def _ids(tokenizer, lines: list[str]) -> list[int]:
    return tokenizer("\n".join(lines), add_special_tokens=False).input_ids


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


def _positive(text: str) -> int:
    """argparse type of --system-tokens: a positive int."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"the system prompt needs at least 1 token, got {value}")
    return value


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


class Run(NamedTuple):
    """One greedy ``generate()``: its new tokens ``[1, new_tokens]``, the logits of its first step (the prompt's
    last position) ``[1, V]`` in the model's dtype, and its time to first token."""

    tokens: torch.Tensor
    first_logits: torch.Tensor
    ttft_seconds: float


def _generate(model, ids, new_tokens, cache=None) -> Run:
    timer = _FirstTokenTimer()
    kwargs = {CACHE_KWARG: cache} if cache is not None else {}
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, streamer=timer, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
    return Run(out.sequences[:, ids.shape[1] :], out.logits[0], timer.ttft_seconds)


def _cold_runs(model, prompts, args) -> list[Run]:
    """Misses by construction, the TTFT baseline: each prompt through the same patched model and kernels as a cached
    request, into a cache emptied first (it stores the same checkpoints as a miss of the kept cache)."""
    emptied = HybridPrefixCache(model, block_size=args.block_size, retention_interval=args.retention)
    runs = []
    for ids in tqdm(prompts, desc="cold", unit="req"):
        emptied.clear()
        runs.append(_generate(model, ids, args.new_tokens, emptied))
    emptied.clear()
    return runs


def _cached_rows(model, prompts, args, reference: list[Run], cold: list[Run]) -> tuple[list[dict], HybridPrefixCache]:
    """Each prompt through one kept cache, compared with transformers alone (tokens, first-step logits) and timed
    against its cold run."""
    cache = HybridPrefixCache(model, block_size=args.block_size, retention_interval=args.retention)
    tolerance = LOGIT_TOLERANCE.get(model.dtype)
    rows = []
    for ids, ref, cold_run in tqdm(list(zip(prompts, reference, cold)), desc="with the cache", unit="req"):
        run = _generate(model, ids, args.new_tokens, cache)
        identical = torch.equal(run.tokens, ref.tokens)
        dlogit = (run.first_logits.float() - ref.first_logits.float()).abs().max().item()
        rows.append(dict(prompt=ids.shape[1], hit=cache.last_hit_tokens[0], ttft_cold=cold_run.ttft_seconds,
                         ttft_cached=run.ttft_seconds, identical=identical, max_abs_dlogit=dlogit,
                         exact=identical and (tolerance is None or dlogit <= tolerance)))
    return rows, cache


def _print_table(rows: list[dict], reference: list[Run], args, dtype: torch.dtype) -> None:
    print(f"{'request':>7} {'prompt':>7} {'hit':>6} {'replayed':>8} {'TTFT cold':>10} {'TTFT cached':>12} "
          f"{'speed-up':>8} {'max|dlogit|':>11} {'exact':>5}")
    for i, r in enumerate(rows, 1):
        print(f"{i:>7} {r['prompt']:>7} {r['hit']:>6} {r['prompt'] - r['hit']:>8} {r['ttft_cold'] * 1e3:>7.0f} ms "
              f"{r['ttft_cached'] * 1e3:>9.0f} ms {r['ttft_cold'] / r['ttft_cached']:>7.1f}x "
              f"{r['max_abs_dlogit']:>11.1e} {r['exact']!s:>5}")
    tolerance = LOGIT_TOLERANCE.get(dtype)
    bound = f" and max|dlogit| <= {tolerance:.0e}" if tolerance else f" (tokens only: no logit bound stated in {dtype})"
    stock = [run.ttft_seconds * 1e3 for run in reference]
    print(f"TTFT cold: the same model through an emptied cache (a miss, as request 1 is); speed-up = cold / cached.\n"
          f"max|dlogit|: the first generated token's logits (the prompt's last position), cached run against "
          f"transformers' generate() without the package; exact: the {args.new_tokens} tokens identical{bound}.\n"
          f"transformers without the package took {min(stock):.0f}-{max(stock):.0f} ms to the first token: its own "
          f"kernels, where a cold request above runs the package's.")


def load(args):
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
        if os.path.isdir(args.model) and not any(os.path.exists(os.path.join(args.model, f)) for f in files):
            raise SystemExit(f"--model {args.model} holds no tokenizer: save one beside the model with "
                             "tokenizer.save_pretrained(path).")
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        if not tokenizer("a").input_ids:
            raise SystemExit(f"--model {args.model}: its tokenizer encodes nothing; save the model's own tokenizer "
                             "beside it with tokenizer.save_pretrained(path).")
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
    parser.add_argument("--system-tokens", type=_positive, default=4000,
                        help="tokens in the shared system prompt (each request adds its question; the cache "
                             "reuses the shared part up to its last full block)")
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
    system = support_desk_system_prompt(args.system_tokens, tokenizer, seed=args.seed)
    prompts = [
        tokenizer(f"{system}\n\nCustomer: {q}\nAssistant:", return_tensors="pt").input_ids
        for q in (QUESTIONS * (args.questions // len(QUESTIONS) + 1))[: args.questions]
    ]
    reference = [_generate(model, ids, args.new_tokens) for ids in tqdm(prompts, desc="transformers alone", unit="req")]
    cold = _cold_runs(model, prompts, args)  # before the kept cache: a model's continuous batching uses the last built
    rows, cache = _cached_rows(model, prompts, args, reference, cold)

    size = f"built-in {args.family} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params)"
    print(f"model: {args.model or size}, {model.dtype}, block_size={args.block_size}, retention_interval={retention!r}")
    _print_table(rows, reference, args, model.dtype)
    stats = cache.stats
    print(f"stats: {stats}")
    print(f"token hit rate {stats.token_hit_rate:.1%}, stored {stats.stored_bytes / 2**20:.1f} MiB of "
          f"{stats.max_cache_bytes / 2**20:.0f} MiB")
    return {"rows": rows, "stats": stats}


if __name__ == "__main__":
    main()
