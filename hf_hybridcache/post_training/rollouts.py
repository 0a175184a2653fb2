"""A TRL trainer's rollouts served by the engine (:func:`attach`): each rollout samples with a seed of its own, its
logprobs go back to the trainer where it has a place for them, the trainer's optimizer steps are declared to the
cache (:func:`~hf_hybridcache.post_training.steps.weights_step`), and each rollout call is recorded.

Why a seed per rollout: the engine runs a trainer's rollouts side by side, and a shared generator would give each
one draws that depend on what else runs. With its own seed, a rollout is what ``generate()`` gives the same prompt
alone, without the cache, after ``torch.manual_seed(seed)`` (in float32; tests/test_post_training.py checks it), so a
training run is reproducible rollout by rollout.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from transformers import TrainerCallback

from .. import _compat
from .._compat import trl
from ..core import CacheCore
from ..store import last_boundary
from .steps import weights_step


@dataclass(frozen=True)
class Rollout:
    """One completion of a rollout call.

    Attributes:
        prompt_ids: the prompt's token ids.
        completion_ids: the generated ids, its end-of-sequence id included when it ended on one (as the trainer
            reads them).
        seed: the seed its request sampled with.
        logprobs: each generated token's log-probability under the distribution it was drawn from (the logits over
            the generation config's ``temperature``, renormalized to its ``top_k`` / ``top_p`` when set), float32,
            recorded for both trainers and handed back to GRPO only (RLOO's rollout call has no place for them);
            None when the engine returned none.
        hit_tokens: prompt tokens restored from the cache instead of computed.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    seed: int
    logprobs: list[float] | None
    hit_tokens: int


@dataclass(frozen=True)
class RolloutCall:
    """One rollout call of the trainer (its prompts, each ``num_generations`` times) as the cache served it.

    Attributes:
        weights_step: the weights step it ran under (:func:`~hf_hybridcache.post_training.steps.weights_step`).
        rollouts: completions generated.
        prompt_tokens: their prompts' tokens, summed.
        restorable_tokens: the most a hit could restore of each prompt (its last block boundary that leaves the
            cache's ``min_tail_tokens`` to run), summed: G copies of a prompt compute it once when the other G - 1
            restore this much.
        hit_tokens: prompt tokens restored, summed.
        seconds: the call's wall time.
    """

    weights_step: int
    rollouts: int
    prompt_tokens: int
    restorable_tokens: int
    hit_tokens: int
    seconds: float

    @property
    def hit_share(self) -> float:
        """``hit_tokens / restorable_tokens`` (``(G - 1) / G`` when each prompt is computed once)."""
        return self.hit_tokens / max(self.restorable_tokens, 1)


class RolloutLog:
    """What :func:`attach` returns: the rollout calls of one trainer as the cache served them.

    Attributes:
        cache: the :class:`~hf_hybridcache.HybridPrefixCache` serving them.
        calls: a :class:`RolloutCall` per rollout call, in order (a few ints each).
        last: the :class:`Rollout` s of the latest call.
        weights_steps: weights steps declared so far.
        on_rollouts: called with each call's :class:`Rollout` list before the trainer reads it (None: nothing).
    """

    def __init__(self, cache, trainer, seed: int, on_rollouts: Callable[[list[Rollout]], None] | None) -> None:
        self.cache, self._trainer, self._seed = cache, trainer, seed
        self.calls: list[RolloutCall] = []
        self.last: list[Rollout] = []
        self.weights_steps = 0
        self.on_rollouts = on_rollouts

    def seeds(self, count: int) -> list[int]:
        """The seeds of the next call's ``count`` rollouts: distinct, and the same for the same trainer seed and call
        number."""
        call = len(self.calls)
        return [int.from_bytes(hashlib.sha256(f"{self._seed}|{call}|{i}".encode()).digest()[:8], "little") >> 1
                for i in range(count)]

    def rollout_call(self, original: Callable, prompt_ids, *args, **kwargs):
        """The trainer's rollout call (``_generate_single_turn``), run with a seed per rollout; its logprobs take the
        place of the None the trainer's own call returns."""
        seeds = self.seeds(len(prompt_ids))
        started = time.perf_counter()
        with _compat.rollouts(lambda count: seeds[:count]) as captured:
            result = original(prompt_ids, *args, **kwargs)
        if not captured:  # the trainer generated some other way (vLLM, a rollout function of its own)
            return result
        outputs = [output for batch in captured for output in batch.values()]
        failed = next((output for output in outputs if output.error is not None), None)
        if failed is not None:
            raise RuntimeError(f"A rollout failed in hf_hybridcache's engine, so the trainer has no completion for "
                               f"it: {failed.error}")
        completion_ids, logprobs = trl.split_result(self._trainer, result)
        scored = all(len(o.logprobs) == len(o.generated_tokens) for o in outputs)
        self.last = [Rollout(list(o.prompt_ids), list(o.generated_tokens), seed, list(o.logprobs) if scored else None,
                             o.hit_tokens) for o, seed in zip(outputs, seeds)]
        self._record(time.perf_counter() - started)
        if self.on_rollouts is not None:
            self.on_rollouts(self.last)
        if scored and logprobs is None and trl.TRAINERS[trl.trainer_kind(self._trainer)]:
            return trl.join_result(self._trainer, completion_ids, [r.logprobs for r in self.last])
        return result

    def _record(self, seconds: float) -> None:
        options = self.cache.options
        restorable = sum(last_boundary(len(r.prompt_ids) - options.min_tail_tokens, options.block_size)
                         for r in self.last)
        self.calls.append(RolloutCall(self.weights_steps, len(self.last), sum(len(r.prompt_ids) for r in self.last),
                                      restorable, sum(r.hit_tokens for r in self.last), seconds))


class _WeightsSteps(TrainerCallback):
    """Declares the trainer's weights steps to the cache: when training begins and after every optimizer step; when
    it ends, ``cache.clear()`` reads the weights again (and drops the last step's entries)."""

    def __init__(self, log: RolloutLog, retire: bool) -> None:
        self.log, self.retire = log, retire

    def _step(self) -> None:
        self.log.weights_steps = weights_step(self.log.cache, self.retire)

    def on_train_begin(self, args, state, control, **kwargs):
        self._step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._step()

    def on_train_end(self, args, state, control, **kwargs):
        self.log.cache.clear()
        self.log.weights_steps = 0


def attach(trainer, cache, *, retire: bool = True, seed: int | None = None,
           on_rollouts: Callable[[list[Rollout]], None] | None = None) -> RolloutLog:
    """Serve ``trainer``'s rollouts with ``cache``'s engine, exact and bounded over many steps.

    Args:
        trainer: TRL's ``GRPOTrainer`` or ``RLOOTrainer`` made with ``use_transformers_continuous_batching=True``,
            on the model ``cache`` was built for.
        cache: the model's :class:`~hf_hybridcache.HybridPrefixCache`, built after the model was cast to the dtype
            the trainer generates in (``bf16=True``, TRL's default: ``model.to(torch.bfloat16)`` first).
        retire: drop the entries of earlier weights at every optimizer step, so the store holds one step's entries
            (:func:`~hf_hybridcache.post_training.steps.weights_step`).
        seed: the root of the rollouts' seeds (the trainer's ``args.seed`` when None).
        on_rollouts: called with each rollout call's :class:`Rollout` list, before the trainer reads it.

    Returns:
        The :class:`RolloutLog` of the trainer's rollout calls.

    Raises:
        ValueError: not a GRPO or RLOO trainer generating through ``generate_batch``; a trainer on another model; a
            cache built in another dtype than the trainer generates in; attached already.
        TypeError: ``cache`` is not a ``HybridPrefixCache``.
    """
    kind = trl.trainer_kind(trainer)
    if not isinstance(getattr(cache, "core", None), CacheCore):
        raise TypeError(f"attach takes the model's HybridPrefixCache as its second argument (attach(trainer, "
                        f"HybridPrefixCache(model))), got {type(cache).__name__}.")
    if trainer.model is not cache.model:
        raise ValueError(f"This {kind} trains another model than the one the HybridPrefixCache was built for; build "
                         "the cache for the model you pass to the trainer (and keep a reference to both).")
    flag = trl.rollout_cast(trainer)
    if flag is not None and cache.model.dtype != trl.CASTS[flag]:
        name, built = str(trl.CASTS[flag]).removeprefix("torch."), str(cache.model.dtype).removeprefix("torch.")
        raise ValueError(f"The {kind} casts the model to {name} before every rollout ({flag}=True in its config), "
                         f"but the HybridPrefixCache was built for it in {built}; call model.to(torch.{name}) before "
                         f"building the cache, or set {flag}=False to generate in {built}.")
    log = RolloutLog(cache, trainer, trainer.args.seed if seed is None else seed, on_rollouts)
    trl.wrap_rollouts(trainer, log.rollout_call)
    trl.ask_for_logprobs(trainer)
    trainer.add_callback(_WeightsSteps(log, retire))
    return log
