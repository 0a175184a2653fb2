"""Multi-turn chats with images on the tiny vision-language wrappers: TTFT and vision-tower time with and without
the cache (issue 34).

Two chats per family, each turn a ``generate()`` call on the whole conversation so far:

- ``screenshots``: a new screenshot every turn (an agent that looks at the screen after each action): without the
  cache every turn prefills the whole chat and encodes every screenshot so far; with it a turn restores the chat up
  to the last turn's reply and encodes only the new screenshot.
- ``one image``: one image, asked about five times (a chat about one document): with the cache only the first turn
  encodes it.

Each turn runs cold (no cache) and cached (one ``HybridPrefixCache`` for the chat) on the same prompt; both are timed
to their first new token through a streamer (``TTFT``), and the vision tower's forwards are timed by a hook on it
(``tower``). The reply the cached run gives (checked equal to the cold one) joins the next turn's prompt. Every time
is the median over ``--repeats`` runs of the whole chat, each with a fresh cache. Images are drawn in code
(``hf_hybridcache.toy.vision.toy_image``), models are seeded random-init (``build_vlm``), so nothing is downloaded.

``--size realistic`` (the default) builds each wrapper with a tower of 6 layers of width 128 (tens to hundreds of ms
per image here) and a decoder of width 256, so that a tower's and a prefill's costs outweigh a forward's fixed Python
overhead, as in a real model; ``--size tiny`` runs the test shapes (towers of a few ms, decoders of width 64, whose
prefill of a few hundred tokens costs about what a hit's fixed overhead does). ``margin`` is issue 34's bar per turn after the first: the time the hit saves
(cold TTFT - hit TTFT) minus the tower time it skips (cold tower - hit tower); the bar holds where it is >= 0, and the
last line counts the turns where it held, over every repeat.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/image_chat.py
    PYTHONPATH=. python benchmarks/image_chat.py --families qwen3_5 --turns 3 --repeats 1 --image 96x64 --size tiny
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as every benchmark here (see ttft.py)

import torch
from transformers.generation.streamers import BaseStreamer

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.toy import VOCAB_SIZE
from hf_hybridcache.toy.vision import TINY_WRAPPERS, SIZES, build_vlm, toy_image, vision_tower, vlm_inputs

SYSTEM = "<|system|>You are a computer-use agent. Describe what you see and say what to click next.</s>"


class FirstToken(BaseStreamer):
    """Records when ``generate()`` hands over its first new token (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.puts, self.at = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


class Tower:
    """The vision tower's forwards and their wall time (a hook on the module)."""

    def __init__(self, model) -> None:
        self.seconds, self.calls, self._started = 0.0, 0, 0.0
        tower = vision_tower(model)
        tower.register_forward_pre_hook(lambda *args: setattr(self, "_started", time.perf_counter()))
        tower.register_forward_hook(lambda *args: self._done())

    def _done(self) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - self._started


def _run(model, tower: Tower, inputs: dict, new_tokens: int, cache=None):
    """One call: (reply ids, TTFT s, tower s, tower calls)."""
    streamer, seconds, calls = FirstToken(), tower.seconds, tower.calls
    kwargs = {CACHE_KWARG: cache} if cache is not None else {}
    started = time.perf_counter()
    out = model.generate(**inputs, **kwargs, max_new_tokens=new_tokens, do_sample=False, streamer=streamer)
    reply = out[0, inputs["input_ids"].shape[1]:].tolist()
    return reply, streamer.at - started, tower.seconds - seconds, tower.calls - calls


def chat(model, tower: Tower, family: str, scenario: str, turns: int, size: tuple[int, int], new_tokens: int):
    """One run of a chat: per turn a dict of its numbers."""
    cache = HybridPrefixCache(model)
    parts, rows = [SYSTEM], []
    for turn in range(turns):
        question = f"Step {turn + 1}: what should I click now?</s><|assistant|>"
        if scenario == "screenshots" or turn == 0:
            parts = parts + ["<|user|>", toy_image(100 + turn, *size), question]
        else:
            parts = parts + ["<|user|>" + question]
        inputs = vlm_inputs(family, parts)
        cold = _run(model, tower, inputs, new_tokens)
        cached = _run(model, tower, inputs, new_tokens, cache)
        assert cold[0] == cached[0], f"{family} {scenario} turn {turn + 1}: the cached reply differs from the cold one"
        rows.append(dict(turn=turn + 1, tokens=inputs["input_ids"].shape[1], hit=cache.last_hit_tokens[0],
                         images=cache.last_images.items, encoded=cache.last_images.encoded,
                         cold_ttft=cold[1], cold_tower=cold[2], hit_ttft=cached[1], hit_tower=cached[2]))
        # The random model may emit a placeholder id; the chat keeps its reply as text.
        parts = parts + [[t if t < VOCAB_SIZE else 6 for t in cached[0]], "</s>"]
    return rows


def margin(row: dict) -> float:
    """The bar of a turn with a hit: seconds the hit saves minus the tower seconds it skips (>= 0: met)."""
    return (row["cold_ttft"] - row["hit_ttft"]) - (row["cold_tower"] - row["hit_tower"])


def _median_rows(runs: list[list[dict]]) -> list[dict]:
    rows = []
    for turn_rows in zip(*runs):
        row = dict(turn_rows[0])
        for key in ("cold_ttft", "cold_tower", "hit_ttft", "hit_tower"):
            row[key] = statistics.median(r[key] for r in turn_rows)
        row["margin"] = statistics.median(margin(r) for r in turn_rows)
        row["met"] = sum(margin(r) >= 0 for r in turn_rows) if row["turn"] > 1 else 0
        row["repeats"] = len(turn_rows) if row["turn"] > 1 else 0
        rows.append(row)
    return rows


def table(results: list[tuple[str, str, list[dict]]]) -> str:
    """The printed table: one line per turn, and per chat a line of its sums."""
    head = (f"{'family':<17}{'chat':<12}{'turn':>5}{'tokens':>8}{'hit':>6}{'images':>8}{'encoded':>9}"
            f"{'cold TTFT ms':>14}{'cold tower ms':>15}{'hit TTFT ms':>13}{'hit tower ms':>14}{'speedup':>9}"
            f"{'margin ms':>11}")
    lines = [head, "-" * len(head)]
    for family, scenario, rows in results:
        for r in rows + [_sums(rows)]:
            lines.append(
                f"{family:<17}{scenario:<12}{r['turn']!s:>5}{r['tokens']:>8}{r['hit']:>6}{r['images']:>8}"
                f"{r['encoded']:>9}{r['cold_ttft'] * 1e3:>14.1f}{r['cold_tower'] * 1e3:>15.1f}"
                f"{r['hit_ttft'] * 1e3:>13.1f}{r['hit_tower'] * 1e3:>14.1f}{r['cold_ttft'] / r['hit_ttft']:>8.2f}x"
                + (f"{r['margin'] * 1e3:>11.1f}" if r["turn"] not in (1, "all") else "")
            )
    met, turns = (sum(r[key] for _, _, rows in results for r in rows) for key in ("met", "repeats"))
    lines.append(f"bar (a hit saves at least the tower time it skips): met on {met} of {turns} turns after the first")
    return "\n".join(lines)


def _sums(rows: list[dict]) -> dict:
    total = {key: sum(r[key] for r in rows) for key in ("tokens", "hit", "images", "encoded", "cold_ttft",
                                                         "cold_tower", "hit_ttft", "hit_tower")}
    return dict(total, turn="all", met=0, repeats=0)


def main(argv: list[str] | None = None) -> list[tuple[str, str, list[dict]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(sorted(TINY_WRAPPERS)),
                        help="comma-separated tiny wrappers (hf_hybridcache.toy.vision.TINY_WRAPPERS)")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16, help="reply tokens per turn")
    parser.add_argument("--image", default="192x128", help="WIDTHxHEIGHT of each screenshot in pixels")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--size", default="realistic", choices=sorted(SIZES),
                        help="model size (hf_hybridcache.toy.vision.SIZES): realistic for figures, tiny for tests")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = tuple(int(v) for v in args.image.split("x"))
    results = []
    with torch.no_grad():
        for family in args.families.split(","):
            model = build_vlm(family, size=args.size)
            tower = Tower(model)
            for scenario in ("screenshots", "one image"):
                runs = [chat(model, tower, family, scenario, args.turns, size, args.new_tokens)
                        for _ in range(args.repeats)]
                results.append((family, scenario, _median_rows(runs)))
    print(table(results))
    return results


if __name__ == "__main__":
    main()
