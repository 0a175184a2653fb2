"""Multi-turn chat over HTTP with the ``openai`` client (the shape of SGLang's ``bench_multiturn``): N clients (1, 4,
16) each hold a 6-turn conversation that starts with the same system prompt, against ``python -m
hf_hybridcache.serve`` (prefix cache + continuous-batching engine) and, side by side, the stock sequential server (the
same command with ``--no-cache``: one plain ``generate()`` at a time, no reuse, which is what ``transformers serve``
does for these models without continuous batching).

    PYTHONPATH=. python benchmarks/serve_multiturn.py                       # Jamba-shaped model, 1/4/16 clients
    PYTHONPATH=. python benchmarks/serve_multiturn.py --clients 16 --max-tokens 16 --shape tiny
    PYTHONPATH=. python benchmarks/serve_multiturn.py --dtype bfloat16 --clients 1 4 --system-repeats 2
    PYTHONPATH=. python benchmarks/serve_multiturn.py --speculative ngram --clients 1 4   # a third server speculates

The model is built in code (``benchmarks/concurrency.py``'s Jamba shape: 8 layers, hidden 256, long-memory init;
served in fp32 unless ``--dtype`` says otherwise), saved with the byte tokenizer and loaded by both servers through
``from_pretrained``; both run in their own process. Every client sends its turns one after another with greedy
sampling and streams the reply (SSE). Per level and server: tokens/s (completion tokens over the level's wall time),
TTFT p50 / p95 per turn (request sent to the first chunk with text, seconds) and the token hit rate per turn
(``usage.prompt_tokens_details.cached_tokens`` over prompt tokens). The replies of both servers are compared (they
must be equal). Levels run one after another, stock first; the servers stay up for the whole run (the cache keeps
the shared system prompt, as a running service would). Timing is noisy on a shared machine: compare rows of one run.

With ``--speculative ngram|draft:PATH`` a third server runs the engine with speculation (``--num-speculative-tokens``,
default 4): its replies are compared with the stock server's too, and the per-turn table adds its token hit rate and
the largest difference from the engine's without speculation (issue 44's bar: within 0.01).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time

import openai

from benchmarks.servers import free_port, server_process, usage_counts

SYSTEM = ("You are the support assistant of a small bookshop. You answer questions about opening hours, orders, "
          "returns, gift cards and events. Keep answers short and friendly, and ask for the order number when a "
          "question is about a specific order. ")


@contextlib.contextmanager
def serving(model_dir: str, extra: list[str]):
    """A ``python -m hf_hybridcache.serve`` process on a free port; yields its base URL."""
    port = free_port()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    url = f"http://127.0.0.1:{port}"
    with server_process([sys.executable, "-m", "hf_hybridcache.serve", "--model", model_dir, "--port", str(port),
                         "--served-model-name", "bench", *extra], url, env):
        yield url


def english_question(level: int, index: int, turn: int) -> str:
    """The user message of turn ``turn`` of client ``index`` at ``level`` clients."""
    return (f"[{level}/{index}] Question {turn}: where is my order {1000 * index + turn}, and when do you open on "
            f"day {turn}?")


async def conversation(client, index: int, level: int, turns: int, max_tokens: int, system: str,
                       question=english_question) -> list[dict]:
    """Client ``index`` of ``level``'s chat: ``turns`` user messages (``question(level, index, turn)``), each sent
    when the previous reply has streamed in; a record per turn."""
    messages, record = [{"role": "system", "content": system}], []
    for turn in range(turns):
        messages.append({"role": "user", "content": question(level, index, turn)})
        sent, first, text, usage = time.perf_counter(), None, "", None
        stream = await client.chat.completions.create(model="bench", messages=list(messages), max_tokens=max_tokens,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if first is None and (choice.delta.content or choice.finish_reason):
                    first = time.perf_counter()
                text += choice.delta.content or ""
        record.append({"ttft": first - sent, **usage_counts(usage), "text": text, "messages": list(messages)})
        messages.append({"role": "assistant", "content": text})
    return record


async def run_level(url: str, clients: int, turns: int, max_tokens: int, system: str, question=english_question,
                    http_client=None) -> tuple[float, list]:
    """``clients`` conversations at once; the wall time and each one's records. ``http_client``: the ``openai``
    client's ``httpx.AsyncClient`` (default: its own, which keeps connections alive)."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600,
                                  http_client=http_client) as client:
        started = time.perf_counter()
        records = await asyncio.gather(*(conversation(client, i, clients, turns, max_tokens, system, question)
                                         for i in range(clients)))
        return time.perf_counter() - started, records


def summary(wall: float, records: list, turns: int) -> dict:
    per_turn = [[r[t] for r in records] for t in range(turns)]

    def pct(values, q):
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]

    return {
        "tokens_per_s": sum(x["completion"] for r in records for x in r) / wall,
        "ttft_p50": [pct([x["ttft"] for x in turn], 50) for turn in per_turn],
        "ttft_p95": [pct([x["ttft"] for x in turn], 95) for turn in per_turn],
        "hit_rate": [sum(x["hit"] for x in turn) / sum(x["prompt"] for x in turn) for turn in per_turn],
        "ttft_p50_later": statistics.median(x["ttft"] for turn in per_turn[1:] for x in turn),
        "texts": [[x["text"] for x in r] for r in records],
    }


def save_model(shape: str, path: str) -> None:
    from benchmarks.concurrency import bench_model

    from hf_hybridcache.toy import build_model, byte_tokenizer

    model = build_model("jamba") if shape == "tiny" else bench_model("jamba")
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-repeats", type=int, default=4, help="copies of the system text (~230 tokens each)")
    parser.add_argument("--shape", choices=["jamba", "tiny"], default="jamba")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="both servers' --dtype (bf16 and fp16 store replies from a replay when a request ends)")
    parser.add_argument("--speculative", default=None,
                        help="a third server with this --speculative (ngram, draft:PATH)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    args = parser.parse_args(argv)
    system = SYSTEM * args.system_repeats
    results = {}
    with tempfile.TemporaryDirectory() as model_dir, contextlib.ExitStack() as stack:
        save_model(args.shape, model_dir)
        dtype = ["--dtype", args.dtype]
        servers = [("stock", stack.enter_context(serving(model_dir, ["--no-cache", *dtype]))),
                   ("hf_hybridcache", stack.enter_context(serving(model_dir, dtype)))]
        if args.speculative:
            spec = ["--speculative", args.speculative, "--num-speculative-tokens", str(args.num_speculative_tokens)]
            servers.append((SPECULATIVE, stack.enter_context(serving(model_dir, [*dtype, *spec]))))
        for clients in args.clients:
            for name, url in servers:
                wall, records = asyncio.run(run_level(url, clients, args.turns, args.max_tokens, system))
                results[clients, name] = summary(wall, records, args.turns)
                print(f"{clients} clients, {name}: {wall:.1f} s, "
                      f"{results[clients, name]['tokens_per_s']:.1f} tokens/s", file=sys.stderr, flush=True)
    print_tables(results, args)


#: The third server's name in the tables (``--speculative``).
SPECULATIVE = "hf_hybridcache + speculation"


def differing(stock: list[list[str]], ours: list[list[str]]) -> str:
    """"yes" when every reply is equal, else which conversations first differ at which turn and character."""
    firsts = []
    for client, (a, b) in enumerate(zip(stock, ours)):
        turn = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if turn is not None:
            char = next((i for i, (x, y) in enumerate(zip(a[turn], b[turn])) if x != y), None)
            firsts.append(f"client {client} turn {turn + 1} char {char}")
    return "yes" if not firsts else f"NO ({len(firsts)} of {len(stock)}: {'; '.join(firsts)})"


def print_tables(results: dict, args) -> None:
    spec = (f", {SPECULATIVE}: --speculative {args.speculative} k={args.num_speculative_tokens}"
            if args.speculative else "")
    names = ("stock", "hf_hybridcache", SPECULATIVE) if args.speculative else ("stock", "hf_hybridcache")
    print(f"\nserve_multiturn: {args.shape} model, {args.dtype}, {args.turns} turns, max_tokens {args.max_tokens}, "
          f"greedy, streamed{spec}\n")
    print("| clients | server | tokens/s | vs stock | TTFT p50 turns 2-6 (s) | vs stock | replies equal |")
    print("|---|---|---|---|---|---|---|")
    for clients in args.clients:
        stock = results[clients, "stock"]
        for name in names:
            r = results[clients, name]
            equal = "" if name == "stock" else differing(stock["texts"], r["texts"])
            print(f"| {clients} | {name} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / stock['tokens_per_s']:.2f}x "
                  f"| {r['ttft_p50_later']:.3f} | {r['ttft_p50_later'] / stock['ttft_p50_later']:.2f}x | {equal} |")
    for clients in args.clients:
        stock, ours = results[clients, "stock"], results[clients, "hf_hybridcache"]
        spec = results.get((clients, SPECULATIVE))
        print(f"\n{clients} clients, per turn: TTFT p50 / p95 (s) and token hit rate\n")
        extra = " with speculation hit rate | difference |" if spec else ""
        print(f"| turn | stock TTFT p50 / p95 | hf_hybridcache TTFT p50 / p95 | hf_hybridcache hit rate |{extra}")
        print("|---|---|---|---|" + ("---|---|" if spec else ""))
        for turn in range(args.turns):
            row = (f"| {turn + 1} | {stock['ttft_p50'][turn]:.3f} / {stock['ttft_p95'][turn]:.3f} "
                   f"| {ours['ttft_p50'][turn]:.3f} / {ours['ttft_p95'][turn]:.3f} | {ours['hit_rate'][turn]:.0%} |")
            if spec:
                row += f" {spec['hit_rate'][turn]:.0%} | {abs(spec['hit_rate'][turn] - ours['hit_rate'][turn]):.4f} |"
            print(row)


if __name__ == "__main__":
    main()
