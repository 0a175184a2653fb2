"""Speculative decoding through ``generate()`` on a multi-turn chat: transformers' own rollback against the same
drafts with a HybridPrefixCache, which also restores each turn's prefix.

transformers 5.25 runs prompt lookup and assistant models on hybrid models by itself: its cache layers record the
recurrent state after each draft token and roll rejected drafts back (``activate_past_recording``), but every call
starts from an empty cache, so each turn prefills the whole chat again. With a ``HybridPrefixCache`` the same call
restores the chat so far (the previous turn's prompt and reply) and runs only the new message, then speculates with
the package's own per-token states. Before 5.25 transformers refuses speculative decoding on hybrids; the table then
shows the cached runs only.

Each trial is one chat on one model: turn 1 is a document quoted in a prompt (repetitive, so prompt lookup drafts
well) and a question; turn k is turn k-1's prompt + its reply + a new question. Per turn the two ways run interleaved
(best of ``--repeats``, each on its own copy of the model with the same weights; each cached repeat on its own salted
view of the cache, which has seen the earlier turns once), and both are compared with plain greedy decoding of a cold
model (``identical``: every generated token equal). Times are whole ``generate()`` calls (prefill + speculative
decoding): ``native s`` is transformers alone, ``cached s`` the package restoring the chat so far, and ``no reuse s``
the package on a view that has never seen the chat (a miss): on a CPU the package's own fp32 scan is faster than
transformers' fallback, so ``native / cached`` mixes that with the reuse, and ``no reuse / cached`` is the reuse alone.
The machine is shared: read the ratios, measured side by side, not the absolute times.

Usage::

    PYTHONPATH=. python benchmarks/speculative_multiturn.py                          # prompt lookup, toy Jamba
    PYTHONPATH=. python benchmarks/speculative_multiturn.py --drafter assistant      # a small hybrid drafts
    PYTHONPATH=. python benchmarks/speculative_multiturn.py --shape qwen3_5_text:small --turns 3
"""

from __future__ import annotations

import argparse
import os
import time

# Sleeping OpenMP threads instead of spinning ones: a shared CPU otherwise stalls every small op (see ttft.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import transformers
from packaging.version import Version

from benchmarks.model_shapes import build_shape_model
from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.toy import build_model, byte_tokenizer

#: transformers runs speculative decoding on hybrid models itself from this release on.
NATIVE_SINCE = Version("5.25.0")

DOCUMENT = (
    "Meeting notes, 3 March. The team agreed to ship the parser on Friday. Ana owns the release checklist; "
    "Bo fixes the two open crashes; Cy writes the upgrade guide. Next meeting: Tuesday at ten.\n"
)
QUESTIONS = ["Rewrite the notes as a list:\n", "Who owns the checklist?\n", "Repeat the notes once more:\n",
             "What ships on Friday?\n", "Summarize the notes:\n", "List the owners again:\n"]


def _model(args, seed: int = 0):
    """The target model: a built-in toy Jamba whose greedy output settles into cycles (default init, as
    examples/prompt_lookup.py), or ``--shape family:shape`` from benchmarks/model_shapes.py."""
    if args.shape:
        family, shape = args.shape.split(":")
        return build_shape_model(family, shape, args.layers, seed=seed)[0]
    return build_model("jamba", seed=seed, long_memory=False, initializer_range=0.02, hidden_size=128,
                       intermediate_size=256, num_hidden_layers=8, attn_layer_period=8, attn_layer_offset=4,
                       mamba_dt_rank=16)


def _drafting(args, vocab_size: int) -> dict:
    if args.drafter == "prompt_lookup":
        return {"prompt_lookup_num_tokens": args.draft_tokens}
    # A small hybrid assistant with the target's vocabulary (its drafts are mostly rejected with random weights: the
    # table then measures the rollback's cost, the worst case for speculation).
    assistant = build_model("qwen3_5_text", seed=11, vocab_size=vocab_size)
    return {"assistant_model": assistant, "num_assistant_tokens": args.draft_tokens}


def _timed(model, ids, new_tokens: int, **kwargs):
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    return out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", choices=["prompt_lookup", "assistant"], default="prompt_lookup")
    parser.add_argument("--draft-tokens", type=int, default=5)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--document-repeats", type=int, default=6, help="copies of the document in turn 1")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per turn and way (the best is kept)")
    parser.add_argument("--shape", default=None, help="family:shape of benchmarks/model_shapes.py (default: toy)")
    parser.add_argument("--layers", type=int, default=None, help="cut --shape to its first N layers")
    args = parser.parse_args(argv)

    tokenizer = byte_tokenizer()
    native_model, cached_model, cold_model = _model(args), _model(args), _model(args)
    drafting = _drafting(args, cold_model.config.vocab_size)
    native = Version(transformers.__version__) >= NATIVE_SINCE
    # One salted view of one cache per repeat: each sees every turn once, as a chat's one cache would, so every timed
    # cached call restores the chat so far (a second call on one view would hit the turn's own prompt).
    cache = HybridPrefixCache(cached_model)
    views = [cache.with_salt(f"repeat {i}") for i in range(args.repeats)]
    ids = tokenizer(DOCUMENT * args.document_repeats + QUESTIONS[0], return_tensors="pt").input_ids
    label = args.shape or "toy jamba"
    print(f"{label}, {args.drafter} ({args.draft_tokens} draft tokens), {args.new_tokens} new tokens per turn, "
          f"best of {args.repeats}, transformers {transformers.__version__}")
    if not native:
        print(f"transformers {transformers.__version__} refuses speculative decoding on hybrid models (native "
              f"rollback is new in {NATIVE_SINCE}): cached runs only")
    print("| turn | prompt tokens | hit tokens | native s | native / cached | no reuse s | no reuse / cached | "
          "cached s | identical (native, package) |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for turn in range(args.turns):
        reference, _ = _timed(cold_model, ids, args.new_tokens)
        native_runs, fresh_runs, cached_runs = [], [], []
        for repeat, view in enumerate(views):
            if native:
                native_runs.append(_timed(native_model, ids, args.new_tokens, **drafting))
            fresh = cache.with_salt(f"turn {turn} repeat {repeat}")  # a salt no call used before: a miss
            fresh_runs.append(_timed(cached_model, ids, args.new_tokens, **{CACHE_KWARG: fresh}, **drafting))
            cached_runs.append(_timed(cached_model, ids, args.new_tokens, **{CACHE_KWARG: view}, **drafting))
            hit = view.last_hit_tokens[0]
        cached_out, cached_s = min(cached_runs, key=lambda run: run[1])
        fresh_out, fresh_s = min(fresh_runs, key=lambda run: run[1])
        native_out, native_s = min(native_runs, key=lambda run: run[1]) if native_runs else (None, float("nan"))
        row = dict(turn=turn + 1, prompt_tokens=ids.shape[1], hit_tokens=hit, native_s=native_s, fresh_s=fresh_s,
                   cached_s=cached_s, native_identical=None if native_out is None else torch.equal(native_out, reference),
                   cached_identical=torch.equal(cached_out, reference) and torch.equal(fresh_out, reference))
        rows.append(row)
        native_cells = f"{native_s:.2f} | {native_s / cached_s:.2f}x" if native else "- | -"
        print(f"| {row['turn']} | {row['prompt_tokens']} | {hit} | {native_cells} | {fresh_s:.2f} | "
              f"{fresh_s / cached_s:.2f}x | {cached_s:.2f} | {row['native_identical']}, {row['cached_identical']} |")
        question = tokenizer(QUESTIONS[(turn + 1) % len(QUESTIONS)], return_tensors="pt").input_ids
        ids = torch.cat([reference, question], dim=1)
    return rows


if __name__ == "__main__":
    main()
