"""Where an engine decode step's time goes, beside stock ``generate()``'s decode on the same model.

For each model and each count of running requests (1, 8, 32 by default) the engine is stepped directly (no loop
thread, no server) until every request decodes; then ``--steps`` decode steps are timed, each split into:

- **schedule + admit**: the scheduler's choice of chunks (admission's store lookups included);
- **segments**: building each request's segment (its KV pages allocated);
- **plan + views**: the step plan (packed ids, positions, page tables, masks) and the step cache views;
- **forward: <kind>**: the model forward, split by the kind of each decoder layer's direct children (Mamba mixers,
  gated delta nets, short convs, attention, MLP / experts, norms), timed with forward hooks; **forward: rest** is the
  embedding, final norm, LM head and the time between the layers;
- **sampling**: what the step runner does after the forward (masks, processors, argmax, the host copy of the tokens);
- **store**: what the step leaves in the store (blocks by reference, checkpoints, the weights check);
- **other**: the step's time outside all of these (its Python bookkeeping);
- **of which: linear layers** (not a phase of its own, inside the forward's): every ``F.linear`` call of the step,
  the products that read the weights (the floor of a step whose weights are read once).

With ``--speculative K`` each step is a verify step instead: every request drafts its own greedy continuation
(recorded by a plain engine run first, as ``engine_speculative.py``'s ``ceiling``), so all ``K`` drafts are kept and a
step emits ``K + 1`` tokens per request; the table adds ms per emitted token.

``stock generate()`` is the same model's ``generate()`` without any cache on the same number of equal-length prompts
(a padded batch), its decode time per step: the bar an engine step must meet. It runs on a copy of the model taken
before the engine patches it, so it is transformers' code alone. With ``--rounds R`` the engine and
stock runs alternate R times; the table shows the median step of each and the median of the per-round ratios (the
phases are averaged over the rounds), so that a machine shared with other work moves both sides alike. ``--clock
cpu`` times with the process's CPU time instead of the wall clock: with ``--threads 1`` it leaves out the time the
process waited for a core that other work held, which on a shared machine is most of the noise.

Run (``OMP_WAIT_POLICY=PASSIVE`` as for every timing run)::

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.step_profile                         # toy shapes, quick
    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.step_profile --models jamba:small qwen3_5_text:0.8b:8 lfm2:350m
    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.step_profile --running 1 --rounds 5   # medians of 5 A/B rounds
    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.step_profile --threads 1 --clock cpu --rounds 5   # a shared machine
    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.step_profile --models bench:jamba --running 1 --speculative 4
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import time

import torch

from benchmarks.model_shapes import build_shape_model
from hf_hybridcache import HybridPrefixCache, _compat
from hf_hybridcache.engine import EngineLimits, Speculation
from hf_hybridcache.engine import engine as engine_module
from hf_hybridcache.engine.engine import Engine
from hf_hybridcache.engine.requests import EngineRequest
from hf_hybridcache.engine.runner import StepRunner
from hf_hybridcache.toy import build_model

PROMPT_TOKENS = 64
#: The row of every ``F.linear`` call, inside the forward's phases (not added to the step's sum).
LINEARS = "of which: linear layers"
#: ``--clock``: seconds as the wall clock or the process's CPU time counts them.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_now = time.perf_counter


class Clock:
    """Seconds spent per phase while ``on``."""

    def __init__(self) -> None:
        self.spent: collections.Counter[str] = collections.Counter()
        self.on = False
        self._undo: list = []

    def wrap(self, owner, name: str, phase: str) -> None:
        """Time ``owner.name`` (a method or function) as ``phase``."""
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = _now()
            try:
                return original(*args, **kwargs)
            finally:
                if self.on:
                    self.spent[phase] += _now() - start

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def hook_layers(self, model) -> None:
        """Forward hooks on each decoder layer's direct children, timed by the child's kind."""
        starts: dict[int, float] = {}
        for layer in _compat.decoder_layers(model):
            for child in layer.children():
                kind = _kind(child)

                def before(module, args, kind=kind):
                    starts[id(module)] = _now()

                def after(module, args, output, kind=kind):
                    if self.on and id(module) in starts:
                        self.spent[f"forward: {kind}"] += _now() - starts.pop(id(module))

                handles = (child.register_forward_pre_hook(before), child.register_forward_hook(after))
                self._undo.extend(handle.remove for handle in handles)

    def restore(self) -> None:
        """Undo every wrap and hook."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def _kind(module: torch.nn.Module) -> str:
    name = type(module).__name__.lower()
    kinds = (("mamba", "Mamba mixer"), ("gateddelta", "gated delta net"), ("linearattention", "linear attn"),
             ("conv", "short conv"), ("attention", "attention"), ("attn", "attention"), ("moe", "MLP / experts"),
             ("expert", "MLP / experts"), ("mlp", "MLP / experts"), ("norm", "norms"))
    for key, kind in kinds:
        if key in name:
            return kind
    return type(module).__name__


def build(spec: str) -> tuple[torch.nn.Module, str]:
    """``toy:FAMILY`` (the tests' tiny config), ``bench:FAMILY`` (the serving benchmarks' model of
    benchmarks/concurrency.py: ``bench:jamba`` is the toy Jamba set against llama-server) or
    ``FAMILY:SHAPE[:LAYERS]`` of benchmarks/model_shapes.py."""
    if spec.startswith("toy:"):
        return build_model(spec[4:], seed=0), f"{spec} (tiny test config)"
    if spec.startswith("bench:"):
        from benchmarks.concurrency import bench_model

        model = bench_model(spec[6:])
        params = sum(p.numel() for p in model.parameters()) / 1e6
        return model, f"{spec} (the serving benchmarks' model, {params:.1f}M parameters)"
    family, shape, *layers = spec.split(":")
    model, description = build_shape_model(family, shape, int(layers[0]) if layers else None)
    return model, description


def _prompts(model, running: int) -> list[list[int]]:
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(running)
    return [torch.randint(6, vocab, (PROMPT_TOKENS,), generator=generator).tolist() for _ in range(running)]


def _ceiling(cache, prompts: list[list[int]], new_tokens: int, k: int) -> Speculation:
    """Speculation whose drafts are each prompt's own greedy continuation (every draft kept)."""
    from benchmarks.engine_speculative import SynthDrafter, run_engine

    recorded = run_engine(cache, prompts, new_tokens, None, "step_profile: recording")["tokens"]
    vocab = cache.model.get_input_embeddings().num_embeddings
    return Speculation(SynthDrafter({tuple(p): t for p, t in zip(prompts, recorded)}, 1.0, vocab), k)


def profile_engine(model, running: int, steps: int, clock: Clock, keep: bool = False,
                   speculative: int = 0) -> tuple[float, float]:
    """Mean seconds per decode step of ``running`` requests (a verify step of ``speculative`` drafts each, all kept,
    when above 0), and the tokens a request got per timed step (``keep``: add to the clock's phases instead of
    starting them afresh)."""
    cache = HybridPrefixCache(model)
    limits = EngineLimits(max_running_requests=max(running, 1), max_batch_tokens=max(512, running * 2))
    prompts = _prompts(model, running)
    max_new_tokens = (steps + 64) * (speculative + 1)
    speculation = _ceiling(cache, prompts, max_new_tokens, speculative) if speculative else None
    manager = cache.init_continuous_batching(limits=limits)  # installs the engine's attention routing
    runner = StepRunner(model, manager.processors, do_sample=False, return_logprobs=False, seed=0)
    engine = Engine(cache, manager.limits, runner, speculation)
    for i, prompt in enumerate(prompts):
        engine.add(EngineRequest(f"r{i}", prompt, max_new_tokens=max_new_tokens, eos_token_ids=frozenset()))
    with torch.no_grad():
        while any(r.past < len(r.prompt) for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()  # prefill every request first
        for _ in range(3):
            engine.step()  # warm up the decode path
        if not keep:
            clock.spent.clear()
        generated = sum(len(r.generated) for r in engine.scheduler.running)
        clock.on = True
        start = _now()
        for _ in range(steps):
            engine.step()
        total = _now() - start
        clock.on = False
        generated = sum(len(r.generated) for r in engine.scheduler.running) - generated
    engine.close()
    return total / steps, generated / steps / running


def stock_decode(model, batch: int, steps: int) -> float:
    """Seconds per decode step of stock ``generate()`` (no cache) on ``batch`` equal-length prompts."""
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(6, vocab, (batch, PROMPT_TOKENS), generator=torch.Generator().manual_seed(7))
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        start = _now()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill = _now() - start
        start = _now()
        model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, **kwargs)
        return (_now() - start - prefill) / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["toy:jamba", "toy:qwen3_5_text", "toy:lfm2"],
                        help="toy:FAMILY, bench:FAMILY or FAMILY:SHAPE[:LAYERS] (benchmarks/model_shapes.py)")
    parser.add_argument("--running", nargs="+", type=int, default=[1, 8, 32], help="requests decoding at once")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per run")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating engine / stock runs (medians shown)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="wall clock or process CPU time")
    parser.add_argument("--speculative", type=int, default=0, metavar="K",
                        help="time verify steps of K drafts per request, every draft kept (0: decode steps)")
    args = parser.parse_args(argv)
    global _now
    _now = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    for spec in args.models:
        model, description = build(spec)
        clock = Clock()
        clock.wrap(engine_module.Scheduler, "choose", "schedule + admit")
        clock.wrap(Engine, "_segment", "segments")
        clock.wrap(engine_module, "StepPlan", "plan + views")
        clock.wrap(engine_module, "StepCache", "plan + views")
        clock.wrap(StepRunner, "run", "runner")
        clock.wrap(StepRunner, "_sample", "sampling")
        clock.wrap(Engine, "_settle", "store")
        clock.wrap(torch.nn.functional, "linear", LINEARS)
        stock_model = copy.deepcopy(model)  # unpatched: transformers' own forward and decode
        clock.hook_layers(model)
        clock.hook_layers(stock_model)
        columns, stock, ratios = {}, {}, {}
        for running in args.running:
            clock.spent.clear()
            engine_steps, stock_steps, emitted = [], [], []
            for _ in range(args.rounds):
                seconds, tokens = profile_engine(model, running, args.steps, clock, True, args.speculative)
                engine_steps.append(seconds)
                emitted.append(tokens)
                stock_steps.append(stock_decode(stock_model, running, args.steps))
            per_step = statistics.median(engine_steps)
            spent = {phase: seconds / args.steps / args.rounds for phase, seconds in clock.spent.items()}
            runner = spent.pop("runner", 0.0)
            linears = spent.pop(LINEARS, 0.0)
            layers = sum(v for k, v in spent.items() if k.startswith("forward: "))
            spent["forward: rest"] = runner - spent.get("sampling", 0.0) - layers
            spent["other"] = statistics.mean(engine_steps) - sum(spent.values())
            spent[LINEARS] = linears
            columns[running] = (per_step, spent, statistics.mean(emitted))
            stock[running] = statistics.median(stock_steps)
            ratios[running] = statistics.median(e / s for e, s in zip(engine_steps, stock_steps))
        clock.restore()
        _print(description, args, columns, stock, ratios)


def _print(description: str, args, columns: dict, stock: dict, ratios: dict) -> None:
    first = columns[args.running[0]][1]
    phases = sorted({p for _, spent, _ in columns.values() for p in spent} - {LINEARS}, key=lambda p: -first.get(p, 0))
    phases.append(LINEARS)
    rounds = f", median of {args.rounds} rounds" if args.rounds > 1 else ""
    clock = ", CPU time" if args.clock == "cpu" else ""
    kind = f"verify step ({args.speculative} drafts a request, all kept)" if args.speculative else "decode step"
    print(f"\n### {description}: ms per {kind} ({torch.get_num_threads()} threads, {args.steps} steps{rounds}"
          f"{clock})\n")
    print("| phase | " + " | ".join(f"{n} running" for n in args.running) + " |")
    print("|---|" + "---:|" * len(args.running))
    for phase in phases:
        cells = [f"{spent.get(phase, 0) * 1e3:.2f} ({spent.get(phase, 0) / per_step:.0%})"
                 for per_step, spent, _ in (columns[n] for n in args.running)]
        print(f"| {phase} | " + " | ".join(cells) + " |")
    print("| **engine step** | " + " | ".join(f"**{columns[n][0] * 1e3:.2f}**" for n in args.running) + " |")
    if args.speculative:
        print("| tokens a request got per step | " + " | ".join(f"{columns[n][2]:.2f}" for n in args.running) + " |")
        print("| engine step per token | "
              + " | ".join(f"{columns[n][0] * 1e3 / columns[n][2] / n:.2f}" for n in args.running) + " |")
    print("| stock generate() decode step | " + " | ".join(f"{stock[n] * 1e3:.2f}" for n in args.running) + " |")
    if args.speculative:  # a verify step gives a request K + 1 tokens, a stock step one
        print("| engine per token / stock | "
              + " | ".join(f"{ratios[n] / columns[n][2]:.2f}x" for n in args.running) + " |")
    else:
        print("| engine / stock | " + " | ".join(f"{ratios[n]:.2f}x" for n in args.running) + " |")


if __name__ == "__main__":
    main()
