"""Batched generate() where every row reuses its own prefix.

Three customers ask at once; two share a long product manual, one continues an earlier chat. The batch is
left-padded as usual; each row restores its own hit (they differ), replays its own tail, and the rows then decode
together. The script checks every row against that row run alone without the cache and prints the time of the
batched call with and without the cache.

    python examples/batch.py
"""

from __future__ import annotations

import argparse
import os
import time

# Spinning OpenMP threads stall small torch ops on a shared CPU: set before torch loads OpenMP, as every script here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.toy import build_model, byte_tokenizer

MANUAL = "Northwind X2 manual. " + " ".join(
    f"Step {i}: check the {part} and tighten it if it moves." for i, part in
    enumerate(["hinge", "latch", "battery door", "stand", "cable clip", "fan grill", "foot pad"] * 4)
)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    tokenizer = byte_tokenizer()
    model = build_model("jamba", hidden_size=128, intermediate_size=256, num_hidden_layers=8, attn_layer_period=8,
                        attn_layer_offset=4, mamba_dt_rank=16)
    cache = HybridPrefixCache(model, retention_interval=64)
    chat = "Customer: my X2 does not charge.\nAgent: Which cable do you use?\nCustomer: "
    warmup = [MANUAL + "\nQ: How do I open the latch?", chat + "the blue one."]
    for text in warmup:  # earlier requests that left their prefixes in the cache
        model.generate(**tokenizer(text, return_tensors="pt"), **{CACHE_KWARG: cache}, max_new_tokens=4)

    prompts = [MANUAL + "\nQ: Where is the fan grill?", MANUAL + "\nQ: What does step 12 say?",
               chat + "the blue one. It is frayed."]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False)

    start = time.perf_counter()
    cold = model.generate(**batch, **kwargs)
    cold_seconds = time.perf_counter() - start
    start = time.perf_counter()
    cached = model.generate(**batch, **{CACHE_KWARG: cache}, **kwargs)
    cached_seconds = time.perf_counter() - start

    width = batch["input_ids"].shape[1]
    print(f"{'row':>3} {'prompt':>7} {'hit':>6} {'replayed':>8} {'identical to the row alone, cold':>33}")
    identical = []
    for i, text in enumerate(prompts):
        ids = tokenizer(text, return_tensors="pt")
        alone = model.generate(**ids, **kwargs)[0, ids["input_ids"].shape[1] :]
        row = cached[i, width:]  # a row that stopped at EOS early is padded to the batch's length
        identical.append(torch.equal(row[: len(alone)], alone) and bool((row[len(alone) :] == tokenizer.pad_token_id).all()))
        length = int(batch["attention_mask"][i].sum())
        print(f"{i:>3} {length:>7} {cache.last_hit_tokens[i]:>6} {length - cache.last_hit_tokens[i]:>8} "
              f"{identical[-1]!s:>33}")
    print(f"batched generate: {cold_seconds:.2f} s without the cache, {cached_seconds:.2f} s with it "
          f"({cold_seconds / cached_seconds:.1f}x); same tokens as the uncached batch: {torch.equal(cold, cached)}")
    return {"hits": list(cache.last_hit_tokens), "identical": identical, "speedup": cold_seconds / cached_seconds}


if __name__ == "__main__":
    main()
