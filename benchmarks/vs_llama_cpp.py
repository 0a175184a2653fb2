"""``python -m hf_hybridcache.serve`` against llama.cpp's ``llama-server`` on the same weights, side by side.

    PYTHONPATH=. python benchmarks/vs_llama_cpp.py                                    # toy Jamba, builds llama-server
    PYTHONPATH=. python benchmarks/vs_llama_cpp.py --shape jamba:tiny-random --rounds 2
    PYTHONPATH=. python benchmarks/vs_llama_cpp.py --llama-server PATH --workloads chat1 prefill

The model (``toy``: the 6.2M-parameter Jamba that ``benchmarks/serve_multiturn.py`` serves; or ``FAMILY:SHAPE`` of
``benchmarks/model_shapes.py``, e.g. ``jamba:tiny-random``, 128M parameters) is saved in float32 with a tokenizer
llama.cpp's converter takes and converted to GGUF f32 (``benchmarks/llama_cpp.py`` says how; ``llama-server`` is
built from the ``llama-cpp-python`` sdist's sources into ``--llama-cpp-dir`` unless ``--llama-server`` names one).
Then:

1. **Agreement**: greedy completions of both servers on a few prompts; where they differ, the gap between the two
   largest logits of the model at the first differing token (a near-tie when it is under 0.1% of the largest logit:
   summation order, which differs between the servers and between batch sizes in llama.cpp, decides those). The
   replies of the workloads below are compared the same way.
2. **Workloads**, each on a fresh server process, one server on the machine at a time, A/B order alternating per
   round; ratios are ours / llama-server's per round, then the median over rounds:

   - ``chat1`` / ``chat8``: 6-turn chats (``serve_multiturn.py``'s clients) of 1 or 8 clients on a shared
     ~1,000-token system prompt: tokens/s, the first turn's TTFT (nothing cached) and TTFT p50 of turns 2-6;
   - ``shared8`` / ``shared32``: 8 or 32 requests at once, each a 1,024-token prefix seen before (one request sent
     first) and 32 tokens of its own: tokens/s and TTFT p50;
   - ``prefill``: one cold prompt of ``--prefill-tokens`` after a short warm-up request: prompt tokens / TTFT.

Servers: ours ``OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE python -m hf_hybridcache.serve --model DIR --dtype float32``
(llama-server: ``OMP_NUM_THREADS=2`` and its own OpenMP wait policy, ``--llama-wait-policy``);
``llama-server -m MODEL.gguf -np N -c 4096*N -t 2`` (N = the workload's concurrency). Every request streams (SSE) on
a new HTTP connection, greedy, ``--max-tokens`` tokens (the special ids' LM-head rows are zero, so no reply stops
early). Timing is noisy on a shared machine: only the ratios of one run are comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import openai
import torch

from benchmarks import llama_cpp
from benchmarks.serve_multiturn import differing, run_level, summary
from benchmarks.servers import (
    LLAMA_WAIT_POLICIES,
    free_port,
    no_keepalive_client,
    server_env,
    server_process,
    streamed_completion,
)

SERVERS = ("hf_hybridcache", "llama-server")
NEAR_TIE = 1e-3  # top-2 logit gap, as a fraction of the top logit, under which summation order may pick either


@dataclass(frozen=True)
class Workload:
    name: str
    slots: int  # requests at once: llama-server's -np
    description: str


WORKLOADS = {w.name: w for w in (
    Workload("chat1", 1, "6-turn chat, 1 client"),
    Workload("chat8", 8, "6-turn chat, 8 clients"),
    Workload("shared8", 8, "8 requests, shared 1,024-token prefix seen before"),
    Workload("shared32", 32, "32 requests, same"),
    Workload("prefill", 1, "cold prefill, one prompt"),
)}
#: metric -> (label, True when higher is better)
METRICS = {
    "tokens_per_s": ("tokens/s", True),
    "first_ttft": ("first turn TTFT, nothing cached (s)", False),
    "ttft_later": ("TTFT p50, turns 2-6 (s)", False),
    "ttft_p50": ("TTFT p50 (s)", False),
    "prefill_per_s": ("prefill tokens/s", True),
}


class Texts:
    """Seeded random texts over the tokenizer's text alphabet: one character per token in both servers."""

    def __init__(self, alphabet: list[str], seed: int) -> None:
        self.alphabet, self.seed = alphabet, seed

    def __call__(self, key: str, num_tokens: int) -> str:
        rng = random.Random(f"{self.seed}:{key}")
        return "".join(rng.choices(self.alphabet, k=num_tokens))


def build_model(shape: str):
    """``toy`` (serve_multiturn's Jamba) or ``FAMILY:SHAPE`` of model_shapes.py, fp32, and a one-line description."""
    if shape == "toy":
        from benchmarks.concurrency import bench_model

        model = bench_model("jamba")
        return model, "toy Jamba (serve_multiturn.py's: 8 layers, hidden 256)"
    from benchmarks.model_shapes import build_shape_model

    family, name = shape.split(":")
    return build_shape_model(family, name)


@contextlib.contextmanager
def serving(server: str, paths: dict, slots: int, log, wait_policy: str = "default"):
    """One fresh process of ``server``; yields its base URL."""
    port = free_port()
    if server == "hf_hybridcache":
        command = [sys.executable, "-m", "hf_hybridcache.serve", "--model", str(paths["model"]), "--dtype", "float32",
                   "--port", str(port), "--served-model-name", "bench"]
    else:
        command = llama_cpp.llama_server_command(paths["llama_server"], paths["gguf"], port, slots)
    env = server_env(server != "hf_hybridcache", wait_policy)
    url = f"http://127.0.0.1:{port}"
    with server_process(command, url, env, log):
        yield url


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600,
                              http_client=no_keepalive_client())


async def _completions(url: str, prompts: list[str], max_tokens: int) -> tuple[float, list[dict]]:
    async with _client(url) as client:
        started = time.perf_counter()
        records = await asyncio.gather(*(streamed_completion(client, p, max_tokens) for p in prompts))
        return time.perf_counter() - started, records


def run_workload(workload: Workload, url: str, texts: Texts, args) -> dict:
    """The workload's metrics on the server at ``url`` (and the reply texts, to compare the servers)."""
    if workload.name.startswith("chat"):
        system = texts("system", args.prefix_tokens - args.question_tokens - 3)

        def question(level: int, index: int, turn: int) -> str:
            return texts(f"question {level}/{index}/{turn}", args.question_tokens)

        wall, records = asyncio.run(run_level(url, workload.slots, args.turns, args.max_tokens, system, question,
                                              http_client=no_keepalive_client()))
        result = summary(wall, records, args.turns)
        return {"tokens_per_s": result["tokens_per_s"], "first_ttft": result["ttft_p50"][0],
                "ttft_later": result["ttft_p50_later"], "texts": result["texts"],
                "sent": [[x["messages"] for x in r] for r in records], "first_prompt_tokens": records[0][0]["prompt"]}
    if workload.name.startswith("shared"):
        prefix = texts("prefix", args.prefix_tokens)
        asyncio.run(_completions(url, [prefix + texts("seen before", args.question_tokens)], 1))
        prompts = [prefix + texts(f"own {i}", args.question_tokens) for i in range(workload.slots)]
        wall, records = asyncio.run(_completions(url, prompts, args.max_tokens))
        return {"tokens_per_s": sum(r["completion"] for r in records) / wall,
                "ttft_p50": statistics.median(r["ttft"] for r in records), "texts": [[r["text"]] for r in records],
                "sent": [[r["prompt_text"]] for r in records]}
    asyncio.run(_completions(url, [texts("warm-up", 16)], 1))
    _, (record,) = asyncio.run(_completions(url, [texts("cold", args.prefill_tokens)], 1))
    return {"prefill_per_s": record["prompt"] / record["ttft"], "prefill_tokens": record["prompt"]}


def top2_gap(model, tokenizer, text: str) -> tuple[float, float]:
    """The gap between the model's two largest next-token logits after ``text``, and the largest."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        top2 = model(ids).logits[0, -1].float().topk(2).values
    return float(top2[0] - top2[1]), float(top2[0])


def shown_gap(gap: tuple[float, float]) -> str:
    """``gap of top``, marked a near-tie under :data:`NEAR_TIE` of the top logit."""
    return f"{gap[0]:.1e} of {gap[1]:.2f}" + (" (near-tie)" if gap[0] < NEAR_TIE * abs(gap[1]) else "")


def _first_difference(ours: str, theirs: str) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def agreement(model, tokenizer, paths: dict, texts: Texts, args, log) -> list[dict]:
    """Greedy completions of both servers on prompts of ``--agree-prompts`` tokens; per prompt the tokens equal and,
    at the first difference, the model's top-2 logit gap there."""
    prompts = [texts(f"agreement {n}", n) for n in args.agree_prompts]
    replies = {}
    for server in SERVERS:
        with serving(server, paths, 1, log, args.llama_wait_policy) as url:
            replies[server] = [asyncio.run(_completions(url, [p], args.agree_tokens))[1][0]["text"] for p in prompts]
    rows = []
    for prompt, ours, theirs in zip(prompts, *replies.values()):
        same = _first_difference(ours, theirs)
        gap = None if ours == theirs else top2_gap(model, tokenizer, prompt + ours[:same])
        rows.append({"prompt_tokens": len(prompt), "equal": same, "of": len(ours), "gap": gap})
    return rows


def reply_gaps(model, tokenizer, ours: dict, theirs: dict, limit: int = 4) -> list[tuple[float, float]]:
    """The top-2 logit gaps where the replies of a workload's clients first differ (at most ``limit``): each client's
    first differing turn had the same prompt on both servers."""
    gaps = []
    for sent, mine, other in zip(ours["sent"], ours["texts"], theirs["texts"]):
        turn = next((t for t, (a, b) in enumerate(zip(mine, other)) if a != b), None)
        if turn is not None and len(gaps) < limit:
            prompt = sent[turn] if isinstance(sent[turn], str) else tokenizer.apply_chat_template(
                sent[turn], tokenize=False, add_generation_prompt=True)
            gaps.append(top2_gap(model, tokenizer, prompt + mine[turn][:_first_difference(mine[turn], other[turn])]))
    return gaps


def run_rounds(paths: dict, texts: Texts, args, log) -> dict:
    """``results[workload][server]``: one metrics dict per round."""
    results = {name: {server: [] for server in SERVERS} for name in args.workloads}
    for round_index in range(args.rounds):
        order = SERVERS if round_index % 2 == 0 else SERVERS[::-1]
        for name in args.workloads:
            for server in order:
                with serving(server, paths, WORKLOADS[name].slots, log, args.llama_wait_policy) as url:
                    results[name][server].append(run_workload(WORKLOADS[name], url, texts, args))
                shown = {k: round(v, 3) for k, v in results[name][server][-1].items() if k in METRICS}
                print(f"round {round_index + 1} {name} {server}: {shown}", file=sys.stderr, flush=True)
    return results


def print_agreement(rows: list[dict]) -> None:
    print("\n| prompt tokens | greedy tokens equal | top-2 logit gap of the top logit at the first difference |")
    print("|---:|---:|---|")
    for row in rows:
        gap = "" if row["gap"] is None else shown_gap(row["gap"])
        print(f"| {row['prompt_tokens']:,} | {row['equal']} of {row['of']} | {gap} |")


def ratio_rows(results: dict) -> list[dict]:
    """Per workload and metric: both servers' medians, the median of the per-round ratios (ours / theirs), the
    per-round ratios and which server the metric favours."""
    rows = []
    for name, by_server in results.items():
        ours, theirs = by_server["hf_hybridcache"], by_server["llama-server"]
        for metric, (label, higher_better) in METRICS.items():
            if metric not in ours[0]:
                continue
            ratios = [a[metric] / b[metric] for a, b in zip(ours, theirs)]
            ratio = statistics.median(ratios)
            rows.append({"workload": WORKLOADS[name].description, "metric": label, "ratios": ratios, "ratio": ratio,
                         "ours": statistics.median(r[metric] for r in ours),
                         "theirs": statistics.median(r[metric] for r in theirs),
                         "favours": "hf_hybridcache" if (ratio > 1) == higher_better else "llama-server"})
    return rows


def print_results(results: dict, args, description: str, gap=None) -> None:
    """The ratio table, then per workload whether the replies of round 1 were equal; ``gap(ours, theirs)``: the top-2
    logit gaps where they differ (:func:`reply_gaps`)."""
    print(f"\nvs_llama_cpp: {description}, float32, {args.rounds} interleaved rounds, medians; max_tokens "
          f"{args.max_tokens}, greedy, streamed\n")
    print("| workload | metric | hf_hybridcache | llama-server | ratio (ours / llama-server) | per round | favours |")
    print("|---|---|---:|---:|---:|---|---|")
    for row in ratio_rows(results):
        per_round = " ".join(f"{r:.2f}" for r in row["ratios"])
        print(f"| {row['workload']} | {row['metric']} | {row['ours']:.2f} | {row['theirs']:.2f} | {row['ratio']:.2f}x "
              f"| {per_round} | {row['favours']} |")
    for name, by_server in results.items():
        first, theirs = by_server["hf_hybridcache"][0], by_server["llama-server"][0]
        if "texts" in first:
            equal = differing(first["texts"], theirs["texts"])
            if gap is not None and equal != "yes":
                gaps = ", ".join(shown_gap(g) for g in gap(first, theirs))
                equal += f"; top-2 logit gap of the top logit at the first differences: {gaps}"
            print(f"- {name}: replies equal between the servers (round 1): {equal}")
        for key in ("first_prompt_tokens", "prefill_tokens"):
            if key in first:
                print(f"- {name}: {key.replace('_', ' ')} {first[key]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shape", default="toy", help="toy, or FAMILY:SHAPE of benchmarks/model_shapes.py")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3, help="interleaved A/B rounds")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per reply")
    parser.add_argument("--prefix-tokens", type=int, default=1024, help="the shared prefix / first chat prompt")
    parser.add_argument("--question-tokens", type=int, default=32, help="each request's own tokens")
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--agree-prompts", type=int, nargs="*", default=[8, 100, 700, 1500],
                        help="prompt lengths of the agreement check (none: skip it)")
    parser.add_argument("--agree-tokens", type=int, default=32)
    parser.add_argument("--llama-server", help="a llama-server binary (default: build it in --llama-cpp-dir)")
    parser.add_argument("--llama-cpp-dir", default=str(llama_cpp.DEFAULT_DIR),
                        help="where the llama-cpp-python sdist is unpacked and llama-server built (the converter comes from "
                        "here unless --llama-server sits in a llama.cpp build tree)")
    parser.add_argument("--work-dir", help="the saved model, the GGUF and the servers' log (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0, help="of the texts")
    parser.add_argument("--llama-wait-policy", choices=LLAMA_WAIT_POLICIES, default="default",
                        help="llama-server's OpenMP wait policy (benchmarks/servers.py, server_env)")
    parser.add_argument("--json", help="also write every round's metrics and replies to this file")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def prepare(args, work: Path, log) -> tuple:
    """Save and convert the model, find or build llama-server; the model, its tokenizer, the paths and the texts."""
    from transformers import AutoTokenizer

    model, description = build_model(args.shape)
    llama_cpp.save_for_gguf(model, work / "model")
    beside = args.llama_server and llama_cpp.sources_of(args.llama_server)
    source_dir = beside or llama_cpp.sources(args.llama_cpp_dir)
    paths = {"model": work / "model", "gguf": llama_cpp.convert(source_dir, work / "model", work / "model.gguf", log)}
    paths["llama_server"] = args.llama_server or llama_cpp.build_llama_server(source_dir, log)
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    return model, description, tokenizer, paths, Texts(llama_cpp.text_alphabet(tokenizer), args.seed)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        work = Path(args.work_dir or stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        log = stack.enter_context(open(work / "servers.log", "ab"))
        print(f"work dir {work} (the servers' output: {work / 'servers.log'})", file=sys.stderr, flush=True)
        model, description, tokenizer, paths, texts = prepare(args, work, log)
        if args.agree_prompts:
            print(f"\nGreedy agreement, {description}, {args.agree_tokens} tokens per prompt:")
            print_agreement(agreement(model, tokenizer, paths, texts, args, log))
        results = run_rounds(paths, texts, args, log)
        print_results(results, args, description, lambda ours, theirs: reply_gaps(model, tokenizer, ours, theirs))
        if args.json:
            Path(args.json).write_text(json.dumps({"description": description, "args": vars(args), "results": results}))
        return results


if __name__ == "__main__":
    main()
