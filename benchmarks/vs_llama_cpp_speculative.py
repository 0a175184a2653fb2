"""One chat, speculating: ``python -m hf_hybridcache.serve`` against ``llama-server`` on the same weights, with every
draft accepted and ``k`` drafts a step (issue 44's bars: at least 1.5x llama-server without speculation, at least
1.0x llama-server with its own speculation at the same acceptance).

    PYTHONPATH=. python benchmarks/vs_llama_cpp_speculative.py --llama-server PATH             # the toy Jamba
    PYTHONPATH=. python benchmarks/vs_llama_cpp_speculative.py --llama-server PATH --shape jamba:tiny-random
    PYTHONPATH=. python benchmarks/vs_llama_cpp_speculative.py --llama-server PATH --streams 8   # 8 chats at once

The model is saved and converted as ``benchmarks/vs_llama_cpp.py`` does (the same ``--shape`` values). Every way's
server runs at once (each idle while another is measured), after a short warm-up request each; one client then
sends ``--prompts`` completions (``--prompt-tokens`` random one-character tokens each, greedy, ``--max-tokens`` new
tokens, streamed), each prompt to every way in turn before the next prompt, ``--rounds`` times, the order of the
ways reversed every other round: two ways' requests on one prompt ran seconds apart, which is what a shared
machine's load allows to compare. How each way is accepted:

- ``ours plain`` / ``llama plain``: no speculation.
- ``ours replay``: ``benchmarks/replay_server.py``: the server's engine drafts each prompt's own greedy
  continuation, recorded by a plain engine run before the server listens (``--replay-rate`` 1: every draft true; r:
  each draft token true with probability r, else wrong). The engine verifies every draft, so replies are the model's.
- ``llama synth``: ``--spec-type draft-simple`` with a draft model of the same vocabulary (a Jamba of 2 layers,
  hidden 32, random weights: the cheapest drafter it has that drafts every step) and ``--spec-draft-n-min/-n-max k``,
  ``--spec-synth-rates`` r, r^2, .., r^k (llama-server's benchmark mode: per position, a draft is accepted with
  that probability whatever the target says; its log warns the output is not valid).
- ``ours draft model`` / ``llama draft model``: the target itself as the draft model (``--speculative draft:DIR``;
  ``--spec-type draft-simple -md MODEL.gguf``): every draft accepted by the model itself, valid, ``k`` draft
  forwards paid per step.

Measured per request from the stream: decode tokens/s = (completion tokens - 1) / (last text chunk - first text
chunk), so the prefill is left out; ``end-to-end`` = completion tokens / (last chunk - request sent). ``accepted`` =
accepted / drafted tokens over the measured requests, from each server's own counters (ours: ``/metrics``'
``hf_hybridcache_spec_decode_{draft,accepted}_tokens_total``; llama-server: each response's ``timings.draft_n`` and
``draft_n_accepted``). Ratios are taken per request pair (the same prompt and round), then the median over pairs;
tokens/s are medians over requests. With ``--streams N``, each measurement is N prompts streamed at once (N clients;
llama-server gets N slots, ``-np N``): decode tokens/s is all streams' tokens after their first over the span from the
first stream's first text to the last one's last, end-to-end all tokens over the span from sending. Threads: 2 each (``OMP_NUM_THREADS=2``; ours ``OMP_WAIT_POLICY=PASSIVE``, llama-server its own OpenMP wait
policy unless ``--llama-wait-policy passive``: ``benchmarks/servers.py``'s ``server_env``; llama-server
``-t 2``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks import llama_cpp
from benchmarks.servers import LLAMA_WAIT_POLICIES, free_port, server_env, server_process
from benchmarks.vs_llama_cpp import prepare

#: (ours, theirs) pairs whose ratio is printed, per round then the median
RATIOS = (("ours plain", "llama plain"), ("ours replay 1.0", "llama plain"), ("ours replay 1.0", "llama synth 1.0"),
          ("ours replay 0.8", "llama synth 0.8"), ("ours draft model", "llama draft model"),
          ("ours replay 1.0", "ours plain"), ("llama synth 1.0", "llama plain"))


def way_names(args) -> list[str]:
    """The ways this run measures."""
    names = ["ours plain", "llama plain"]
    for rate in args.rates:
        names += [f"ours replay {rate:.1f}", f"llama synth {rate:.1f}"]
    return names + (["ours draft model", "llama draft model"] if args.draft_model else [])


def command(way: str, paths: dict, port: int, args) -> list[str]:
    """The server process of ``way``."""
    k = str(args.num_speculative_tokens)
    if way.startswith("ours"):
        serve = ["--model", str(paths["model"]), "--dtype", "float32", "--port", str(port), "--served-model-name",
                 "bench"]
        if way == "ours plain":
            return [sys.executable, "-m", "hf_hybridcache.serve", *serve]
        if way == "ours draft model":
            return [sys.executable, "-m", "hf_hybridcache.serve", *serve, "--speculative", f"draft:{paths['model']}",
                    "--num-speculative-tokens", k]
        return [sys.executable, "-m", "benchmarks.replay_server", "--replay-prompts", str(paths["prompts"]),
                "--replay-tokens", str(args.max_tokens), "--replay-rate", way.split()[-1],
                "--num-speculative-tokens", k, *serve]
    base = llama_cpp.llama_server_command(paths["llama_server"], paths["gguf"], port, args.streams)
    if way == "llama plain":
        return base
    spec = ["--spec-type", "draft-simple", "--spec-draft-n-min", k, "--spec-draft-n-max", k]
    if way == "llama draft model":
        return [*base, *spec, "-md", str(paths["gguf"])]
    rate = float(way.split()[-1])
    rates = ",".join(f"{rate ** (i + 1):.6g}" for i in range(args.num_speculative_tokens))
    return [*base, *spec, "-md", str(paths["draft_gguf"]), "--spec-synth-rates", rates]


def stream(url: str, prompt: str, max_tokens: int, timed: bool = False) -> dict:
    """One greedy streamed ``/v1/completions`` request: decode and end-to-end tokens/s, and llama-server's draft
    counts (``timings``, when the stream carries them); ``timed``: also the clock at its first and last text."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    first = last = usage = timings = None
    text = ""
    with httpx.Client(timeout=3600) as client:
        sent = time.perf_counter()
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                usage, timings = chunk.get("usage") or usage, chunk.get("timings") or timings
                piece = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                if piece:
                    first, last, text = first or time.perf_counter(), time.perf_counter(), text + piece
    tokens = usage["completion_tokens"]
    timings = timings or {}
    record = {"decode": (tokens - 1) / (last - first), "end_to_end": tokens / (last - sent), "tokens": tokens,
              "text": text, "drafted": timings.get("draft_n", 0), "accepted": timings.get("draft_n_accepted", 0)}
    return {**record, "first": first, "last": last} if timed else record


def batch(url: str, prompts: list[str], max_tokens: int) -> dict:
    """``prompts`` streamed at once (one client each): the batch's decode tokens/s (every stream's tokens after its
    first, over the span from the first stream's first text to the last stream's last) and end-to-end tokens/s (all
    tokens over the span from the requests sent to the last text), the streams' texts and draft counts."""
    if len(prompts) == 1:
        return stream(url, prompts[0], max_tokens)
    sent = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        records = list(pool.map(lambda prompt: stream(url, prompt, max_tokens, timed=True), prompts))
    first, last = min(r["first"] for r in records), max(r["last"] for r in records)
    return {"decode": sum(r["tokens"] - 1 for r in records) / (last - first),
            "end_to_end": sum(r["tokens"] for r in records) / (last - sent),
            "tokens": sum(r["tokens"] for r in records), "text": tuple(r["text"] for r in records),
            "drafted": sum(r["drafted"] for r in records), "accepted": sum(r["accepted"] for r in records)}


def our_counters(url: str) -> tuple[float, float]:
    """``(drafted, accepted)`` tokens so far from our server's ``/metrics`` (0, 0 without speculation)."""
    text = httpx.get(f"{url}/metrics").text
    found = [re.search(rf"^hf_hybridcache_spec_decode_{name}_tokens_total (\S+)$", text, re.M)
             for name in ("draft", "accepted")]
    return tuple(float(m.group(1)) if m else 0.0 for m in found)


def run_ways(names: list[str], paths: dict, prompts: list[str], args, log) -> dict:
    """Every way's server at once (idle between its requests), then ``--rounds`` rounds of the prompts, each prompt
    sent to every way in turn (the order reversed every other round), so the requests any ratio compares ran seconds
    apart. ``results[way]``: ``samples`` (one dict per round and prompt), ``accepted`` and round 1's ``texts``."""
    with contextlib.ExitStack() as stack:
        urls = {}
        for name in names:
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            env = {**server_env(name.startswith("llama"), args.llama_wait_policy), "PYTHONPATH": os.getcwd()}
            stack.enter_context(server_process(command(name, paths, port, args), urls[name], env, log))
            stream(urls[name], prompts[0], 16)  # warm-up
        before = {name: our_counters(url) for name, url in urls.items() if name.startswith("ours")}
        samples = {name: [] for name in names}
        groups = [prompts[i:i + args.streams] for i in range(1, len(prompts), args.streams)]
        for index in range(args.rounds):
            for group in groups:
                for name in names if index % 2 == 0 else names[::-1]:
                    samples[name].append(batch(urls[name], group, args.max_tokens))
            shown = {name: round(statistics.median(r["decode"] for r in samples[name]), 1) for name in names}
            print(f"round {index + 1}, decode tokens/s so far (medians): {shown}", file=sys.stderr, flush=True)
        after = {name: our_counters(urls[name]) for name in before}
    results = {}
    for name, records in samples.items():
        drafted = sum(r["drafted"] for r in records) + (after[name][0] - before[name][0] if name in before else 0)
        accepted = sum(r["accepted"] for r in records) + (after[name][1] - before[name][1] if name in before else 0)
        results[name] = {"samples": records, "accepted": accepted / drafted if drafted else None,
                         "texts": [r["text"] for r in records[: len(groups)]]}
    return results


def print_tables(results: dict, args, description: str) -> None:
    """The per-way table (with whether round 1's replies equal the same server's plain ones), then the ratios (per
    round, median)."""
    streams = "one stream" if args.streams == 1 else f"{args.streams} streams at once (tokens/s of all together)"
    print(f"\nvs_llama_cpp_speculative: {description}, float32, {streams}, {args.prompt_tokens}-token prompts, "
          f"{args.max_tokens} new tokens, greedy, k={args.num_speculative_tokens}, {args.rounds} rounds "
          f"(medians), 2 threads each\n")
    print("| way | accepted | decode tokens/s | end-to-end tokens/s | replies equal its server's plain ones |")
    print("|---|---:|---:|---:|---|")
    for name, result in results.items():
        shown = "-" if result["accepted"] is None else f"{result['accepted']:.2f}"
        plain = results.get(f"{name.split()[0]} plain", result)["texts"]
        equal = "" if name.endswith("plain") else "yes" if result["texts"] == plain else "no"
        samples = result["samples"]
        print(f"| {name} | {shown} | {statistics.median(r['decode'] for r in samples):.1f} | "
              f"{statistics.median(r['end_to_end'] for r in samples):.1f} | {equal} |")
    print("\n| ours / theirs | decode ratio (median) | per request | end-to-end ratio (median) |")
    print("|---|---:|---|---:|")
    for ours, theirs in RATIOS:
        if ours in results and theirs in results:
            pairs = list(zip(results[ours]["samples"], results[theirs]["samples"]))
            decode = [a["decode"] / b["decode"] for a, b in pairs]
            whole = [a["end_to_end"] / b["end_to_end"] for a, b in pairs]
            print(f"| {ours} / {theirs} | {statistics.median(decode):.2f}x | {' '.join(f'{r:.2f}' for r in decode)} "
                  f"| {statistics.median(whole):.2f}x |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shape", default="toy", help="toy, or FAMILY:SHAPE of benchmarks/model_shapes.py")
    parser.add_argument("--llama-server", help="a llama-server binary (default: build it, as vs_llama_cpp.py does)")
    parser.add_argument("--llama-cpp-dir", default=str(llama_cpp.DEFAULT_DIR))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=3, help="measured requests (batches) per way and round")
    parser.add_argument("--streams", type=int, default=1,
                        help="requests sent at once per measurement (llama-server gets as many slots, -np)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 0.8], help="per-token acceptance")
    parser.add_argument("--draft-model", action="store_true", help="also the target as both servers' draft model")
    parser.add_argument("--work-dir", help="the saved models, GGUFs and the servers' log (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llama-wait-policy", choices=LLAMA_WAIT_POLICIES, default="default",
                        help="llama-server's OpenMP wait policy (benchmarks/servers.py, server_env)")
    return parser.parse_args(argv)


def draft_model(vocab_size: int):
    """The 2-layer, hidden-32 Jamba of ``vocab_size`` ids that drafts for ``llama synth`` (random weights)."""
    from benchmarks.concurrency import bench_model

    return bench_model("jamba", vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, mamba_dt_rank=4, attn_layer_period=2,
                       attn_layer_offset=1)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    setup = argparse.Namespace(shape=args.shape, llama_server=args.llama_server, llama_cpp_dir=args.llama_cpp_dir,
                               seed=args.seed)
    with contextlib.ExitStack() as stack:
        work = Path(args.work_dir or stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        log = stack.enter_context(open(work / "servers.log", "ab"))
        print(f"work dir {work} (the servers' output: {work / 'servers.log'})", file=sys.stderr, flush=True)
        model, description, _, paths, texts = prepare(setup, work, log)
        llama_cpp.save_for_gguf(draft_model(model.config.vocab_size), work / "draft")
        paths["draft_gguf"] = llama_cpp.convert(llama_cpp.sources_of(paths["llama_server"]) or
                                                llama_cpp.sources(args.llama_cpp_dir), work / "draft",
                                                work / "draft.gguf", log)
        prompts = [texts(f"spec {i}", args.prompt_tokens) for i in range(args.prompts * args.streams + 1)]
        paths["prompts"] = work / "prompts.json"
        paths["prompts"].write_text(json.dumps(prompts))
        results = run_ways(way_names(args), paths, prompts, args, log)
        print_tables(results, args, description)
        return results


if __name__ == "__main__":
    main()
