"""GRPO on a hybrid: rollouts through the engine (``hf_hybridcache.post_training.attach``) against TRL's plain
``generate()`` path, side by side in one run, and what the cache spends per optimizer step on the weights.

Part 1 (``--shape``, default ``qwen3_5_text:100m`` of ``benchmarks/model_shapes.py``: 110M parameters, random
weights from a fixed seed, float32). TRL's ``GRPOTrainer`` trains the same model (same initial weights, same trainer
seed, same prompts) for ``--steps`` steps both ways, alternating step by step (one ``train()`` call per step, so
a busy spell of a shared machine slows both):

- ``engine``: ``use_transformers_continuous_batching=True`` with a ``HybridPrefixCache`` attached: the G completions
  of a prompt compute it once (the G - 1 others restore it), in packed steps;
- ``generate``: ``use_transformers_continuous_batching=False``, TRL's own path: ``model.generate()`` on the
  left-padded batch of the G copies, no cache.

Each step generates G = ``--generations`` completions of one prompt of ``--prompt-tokens`` tokens (at most
``--completion-tokens`` each; the reward is a toy) and trains on them. Columns, per step (mean over the steps):

- ``rollout s``: TRL's rollout call (``_generate_single_turn``), timed the same way both ways;
- ``gen tok/s``: completion tokens generated per second of rollout; ``prompt tok/s``: prompt tokens of the G
  rollouts per second of rollout (what padded batches compute G times);
- ``hit share``: prompt tokens restored / restorable (``(G - 1) / G`` when each prompt is computed once);
- ``step s``: the whole trainer step (rollouts, rewards, the loss's forward and backward, the optimizer);
- ``x``: the ``generate`` row's time over the ``engine`` row's, for the rollouts and for the step.

The engine saves prompt work only: decode is the same G rows both ways, so the rollout speed-up falls toward 1 as
completions grow longer than the prompt's share of the work (``--completion-tokens``).

Part 2 (``--identity-shape``, default ``qwen3_5_text:0.8b``, float32). What the cache spends per optimizer step to
know the weights changed, beside a lower bound of a trainer step on that shape:

- ``identity s``: ``weights_identity`` (every element read: what the first request after a step pays without a
  declared step);
- ``declared ms``: ``post_training.weights_step`` (what ``attach`` calls after each optimizer step: O(1), and requests
  read no weight until the next);
- ``step s``: one forward and backward of G x ``--identity-step-tokens`` tokens and an SGD update of every weight: a
  real GRPO step at G = 8 runs 8 rows of ~1,000 tokens and an AdamW update, so the shares printed are upper bounds.

Usage (about 8 minutes on a 2-core CPU; ``OMP_WAIT_POLICY=PASSIVE``, see benchmarks/ttft.py)::

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/grpo_rollouts.py
    PYTHONPATH=. python benchmarks/grpo_rollouts.py --steps 4 --completion-tokens 128 --no-identity
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/ttft.py

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from benchmarks.model_shapes import build_shape_model
from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.core import weights_identity
from hf_hybridcache.post_training import attach, weights_step
from hf_hybridcache.toy import byte_tokenizer

COLUMNS = ("way", "steps", "rollout s", "gen tok/s", "prompt tok/s", "hit share", "step s", "x rollout", "x step")
IDENTITY_COLUMNS = ("shape", "params", "identity s", "declared ms", "step s", "identity/step", "declared/step")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3_5_text:100m", help="family:shape of benchmarks/model_shapes.py")
    parser.add_argument("--steps", type=int, default=2, help="trainer steps each way (one prompt per step)")
    parser.add_argument("--generations", type=int, default=8, help="G, completions per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--identity-shape", default="qwen3_5_text:0.8b")
    parser.add_argument("--identity-step-tokens", type=int, default=32, help="tokens per row of part 2's step")
    parser.add_argument("--no-identity", action="store_true", help="skip part 2")
    return parser.parse_args(argv)


def prompts(count: int, tokens: int) -> list[str]:
    """``count`` distinct prompts of ``tokens`` byte tokens (seeded words)."""
    rng = random.Random(45)
    words = ["state", "cache", "prefix", "block", "token", "model", "layer", "reward", "policy", "sample", "step"]
    out = []
    for i in range(count):
        text = f"Task {i}:"
        while len(text) < tokens:
            text += " " + rng.choice(words)
        out.append(text[:tokens])
    return out


class _StepTimes(TrainerCallback):
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._started = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._started)


def _time_rollouts(trainer, record: list) -> None:
    """Time ``trainer``'s rollout call (after ``attach`` where it wraps it, so both ways are timed alike)."""
    inner = trainer._generate_single_turn

    def timed(prompt_ids, *args, **kwargs):
        started = time.perf_counter()
        result = inner(prompt_ids, *args, **kwargs)
        completions = result[0] if isinstance(result, tuple) else result
        record.append((time.perf_counter() - started, sum(map(len, prompt_ids)), sum(map(len, completions))))
        return result

    trainer._generate_single_turn = timed


class Way:
    """One way's trainer (engine or generate()), run one step per ``train()`` call so the two ways alternate."""

    def __init__(self, engine: bool, args, initial: dict, first_prompt: str) -> None:
        import trl

        family, shape = args.shape.split(":")
        self.engine, self.model = engine, build_shape_model(family, shape)[0]
        self.model.load_state_dict(initial)
        config = trl.GRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="grpo_rollouts_"), per_device_train_batch_size=args.generations,
            num_generations=args.generations, max_completion_length=args.completion_tokens, max_steps=1,
            use_transformers_continuous_batching=engine, bf16=False, use_cpu=True, seed=0, report_to=[],
            save_strategy="no", disable_tqdm=True, logging_strategy="no",
        )
        self.trainer = trl.GRPOTrainer(model=self.model, reward_funcs=_reward, args=config,
                                       train_dataset=_dataset(first_prompt), processing_class=byte_tokenizer())
        self.cache = HybridPrefixCache(self.model) if engine else None
        self.log = attach(self.trainer, self.cache) if engine else None
        self.rollouts, self.steps, self.shares = [], _StepTimes(), []
        _time_rollouts(self.trainer, self.rollouts)
        self.trainer.add_callback(self.steps)
        self.trainer.remove_callback(PrinterCallback)  # its end-of-training metrics dict would fill the output

    def step(self, prompt: str) -> None:
        """One trainer step on ``prompt``: its G rollouts, the loss, the optimizer (a fresh optimizer each call, as
        the other way has)."""
        self.trainer.train_dataset = _dataset(prompt)
        self.trainer.train()
        if self.log is not None:
            self.shares.append(self.log.calls[-1].hit_share)

    def row(self) -> dict:
        seconds = sum(r[0] for r in self.rollouts)
        return {"way": "engine" if self.engine else "generate", "steps": len(self.steps.seconds),
                "rollout s": seconds / len(self.rollouts), "gen tok/s": sum(r[2] for r in self.rollouts) / seconds,
                "prompt tok/s": sum(r[1] for r in self.rollouts) / seconds,
                "hit share": statistics.mean(self.shares) if self.shares else 0.0,
                "step s": statistics.mean(self.steps.seconds)}


def _reward(completions, **kwargs) -> list[float]:
    return [float(len(set(completion))) for completion in completions]


def _dataset(prompt: str):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [prompt]})


def rollout_table(args) -> list[dict]:
    family, shape = args.shape.split(":")
    model, description = build_shape_model(family, shape)
    params = sum(p.numel() for p in model.parameters())
    print(f"part 1: {args.shape} {description}, {params / 1e6:.0f}M parameters, float32; G = {args.generations}, "
          f"{args.prompt_tokens}-token prompts, at most {args.completion_tokens} completion tokens, "
          f"{args.steps} steps each way, alternating", flush=True)
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    del model
    texts = prompts(args.steps, args.prompt_tokens)
    ways = [Way(True, args, initial, texts[0]), Way(False, args, initial, texts[0])]
    for text in texts:  # the ways alternate step by step, so a busy spell of the shared machine slows both
        for way in ways:
            way.step(text)
    rows = [way.row() for way in ways]
    plain = rows[1]
    for row in rows:
        row["x rollout"] = plain["rollout s"] / row["rollout s"]
        row["x step"] = plain["step s"] / row["step s"]
    return rows


def identity_row(args) -> dict:
    """Part 2 on ``--identity-shape``."""
    family, shape = args.identity_shape.split(":")
    model, description = build_shape_model(family, shape)
    params = sum(p.numel() for p in model.parameters())
    print(f"part 2: {args.identity_shape} {description}, {params / 1e9:.2f}B parameters, float32", flush=True)
    started = time.perf_counter()
    identity = weights_identity(model)
    identity_s = time.perf_counter() - started
    cache = HybridPrefixCache(model)
    declared = []
    for _ in range(20):
        started = time.perf_counter()
        weights_step(cache)
        declared.append(time.perf_counter() - started)
    declared_s = statistics.median(declared)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (args.generations, args.identity_step_tokens), generator=generator)
    model.train()
    started = time.perf_counter()
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.add_(parameter.grad, alpha=-1e-6)
    step_s = time.perf_counter() - started
    assert len(identity) == 64, identity
    del cache, model
    gc.collect()
    return {"shape": args.identity_shape, "params": f"{params / 1e9:.2f}B", "identity s": f"{identity_s:.2f}",
            "declared ms": f"{declared_s * 1e3:.3f}", "step s": f"{step_s:.1f}",
            "identity/step": f"{identity_s / step_s:.1%}", "declared/step": f"{declared_s / step_s:.4%}"}


def print_table(rows: list[dict], columns: tuple[str, ...]) -> None:
    """A Markdown table of ``rows`` (floats to 2 decimals)."""
    cells = [[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    print("|-" + "-|-".join("-" * w for w in widths) + "-|")
    for row in cells:
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |")


def main(argv: list[str] | None = None) -> tuple[list[dict], dict | None]:
    args = parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs (CPU, shared machine)")
    rows = rollout_table(args)
    print_table(rows, COLUMNS)
    identity = None if args.no_identity else identity_row(args)
    if identity is not None:
        print_table([identity], IDENTITY_COLUMNS)
    return rows, identity


if __name__ == "__main__":
    main()
