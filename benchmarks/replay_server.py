"""``python -m hf_hybridcache.serve`` with drafts at a set acceptance, for ``benchmarks/vs_llama_cpp_speculative.py``.

    PYTHONPATH=. python -m benchmarks.replay_server --replay-prompts PROMPTS.json --replay-tokens 256 \\
        --replay-rate 1.0 --num-speculative-tokens 4 --model DIR --dtype float32 --port 8000

Benchmark-only: the server is built from the package's public pieces (``load``, ``HybridPrefixCache``,
``EngineBackend``, ``build_app``, ``serve.lifecycle.run``) with a
:class:`~benchmarks.engine_speculative.SynthDrafter` as its drafter. Before it listens, it runs the prompts of
``PROMPTS.json`` (a JSON list of strings, tokenized as ``/v1/completions`` tokenizes a string prompt) through the
engine without speculation, greedy, ``--replay-tokens`` new tokens each (under a cache salt of its own, so the
server's requests hit nothing of it), and keeps each prompt's continuation. A request with one of those prompts then
gets drafts of its own greedy continuation, each draft token true with probability ``--replay-rate`` (1.0: every
draft accepted) and wrong otherwise. The engine verifies every draft as usual, so every reply is the model's own
greedy reply whatever the drafts (a request with another prompt, or past its recorded tokens, gets no drafts).
Every other flag is ``python -m hf_hybridcache.serve``'s (``--speculative`` must be left out).
"""

from __future__ import annotations

import argparse
import json
import sys

from hf_hybridcache.serve.__main__ import parse_args


def replay_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """``(replay flags, the server's own flags)`` of ``argv``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replay-prompts", required=True, help="a JSON list of the prompts to record, as strings")
    parser.add_argument("--replay-tokens", type=int, required=True, help="new tokens recorded per prompt")
    parser.add_argument("--replay-rate", type=float, default=1.0, help="probability that a draft token is true")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="k: draft tokens per step")
    replay, rest = parser.parse_known_args(argv)
    return replay, parse_args(rest)


def make_app(args: argparse.Namespace, replay: argparse.Namespace):
    """The app of ``args`` (as ``hf_hybridcache.serve`` makes it) whose engine speculates with replayed drafts."""
    from benchmarks.engine_speculative import SynthDrafter, run_engine
    from hf_hybridcache import HybridPrefixCache
    from hf_hybridcache.engine import Speculation
    from hf_hybridcache.serve.app import build_app
    from hf_hybridcache.serve.backends import EngineBackend
    from hf_hybridcache.serve.loading import load

    model, tokenizer = load(args.model, args.dtype, args.device_map, args.tokenizer)
    cache = HybridPrefixCache(model, args.block_size, args.retention_interval, args.max_cache_bytes)
    with open(replay.replay_prompts) as file:
        prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in json.load(file)]
    recorded = run_engine(cache, prompts, replay.replay_tokens, None, "replay_server: recording")["tokens"]
    vocab_size = model.get_input_embeddings().num_embeddings
    drafter = SynthDrafter({tuple(p): t for p, t in zip(prompts, recorded)}, replay.replay_rate, vocab_size)
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    backend = EngineBackend(cache, eos, args.max_running_requests, args.max_batch_tokens, args.max_model_len,
                            Speculation(drafter, replay.num_speculative_tokens))
    return build_app(backend, tokenizer, args.served_model_name or args.model, cache, args.max_tokens)


def main(argv: list[str] | None = None) -> None:
    from hf_hybridcache.serve.lifecycle import run

    replay, args = replay_args(argv)
    if args.speculative is not None:
        sys.exit("replay_server: leave --speculative out; the drafts are replayed (--replay-rate).")
    failure = run(args, lambda parsed: make_app(parsed, replay))
    if failure is not None:
        sys.exit(f"replay_server: {failure}")


if __name__ == "__main__":
    main()
