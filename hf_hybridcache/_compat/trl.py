"""TRL's trainers, as :mod:`hf_hybridcache.post_training` uses them: which trainers generate their rollouts through
``model.generate_batch`` (the engine), where one rollout call is wrapped, and where it asks for logprobs.

TRL 1.16's ``GRPOTrainer`` and ``RLOOTrainer`` with ``use_transformers_continuous_batching=True`` generate each batch
of rollouts in ``_generate_single_turn`` (``trainer/grpo_trainer.py``, ``trainer/rloo_trainer.py``): under
``torch.no_grad()``, with the model left in training mode, after casting it in place to bfloat16 (``args.bf16``, the
default) or float16 (``args.fp16``), one ``unwrapped_model.generate_batch(prompt_ids, generation_config=...,
continuous_batching_config=self.continuous_batching_config, progress_bar=False)`` whose outputs it reads in prompt
order (``all_outputs.values()``); each prompt is repeated ``num_generations`` times in ``prompt_ids``. GRPO's returns
``(completion_ids, logprobs)``, with ``logprobs=None`` on this path (its vLLM path returns the sampler's), and RLOO's
returns ``completion_ids``. The wrapper is an instance attribute (this trainer only), and the trainer's
``continuous_batching_config`` asks for logprobs (``return_logprobs``), which the wrapper hands back to GRPO in place of
None and records for both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

#: The trainers whose rollouts run through ``generate_batch``, and whether their ``_generate_single_turn`` returns
#: ``(completion_ids, logprobs)`` (True) or ``completion_ids`` (False).
TRAINERS = {"GRPOTrainer": True, "RLOOTrainer": False}
#: Where a wrapped trainer keeps its original rollout call.
_WRAPPED_ATTR = "_hf_hybridcache_rollout_call"


def trainer_kind(trainer) -> str:
    """The TRL trainer class ``trainer`` is or derives from (a key of :data:`TRAINERS`).

    Raises:
        ValueError: not a GRPO or RLOO trainer, or one that does not generate with ``generate_batch``.
    """
    kind = next((c.__name__ for c in type(trainer).__mro__ if c.__name__ in TRAINERS), None)
    if kind is None:
        raise ValueError(f"{type(trainer).__name__} is not one of TRL's {' or '.join(TRAINERS)}, whose rollouts "
                         "hf_hybridcache.post_training serves; pass a GRPOTrainer or an RLOOTrainer.")
    if not getattr(trainer, "use_transformers_continuous_batching", False):
        raise ValueError(f"This {kind} generates its rollouts without generate_batch, so the engine never sees them; "
                         f"set use_transformers_continuous_batching=True in its config.")
    return kind


#: The config flags with which a trainer casts the model before every rollout, and the dtype it casts to.
CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def rollout_cast(trainer) -> str | None:
    """The flag of :data:`CASTS` with which ``trainer`` casts the model before every rollout (``args.bf16``, TRL's
    default, checked first as TRL does), or None."""
    return next((flag for flag in CASTS if getattr(trainer.args, flag, False)), None)


def ask_for_logprobs(trainer) -> bool:
    """Make ``trainer``'s rollouts return each token's logprob (its ``continuous_batching_config``, which both
    trainers pass to ``generate_batch``); returns whether its rollout call has a place to hand them back (GRPO), where
    RLOO's has none (they are still recorded)."""
    trainer.continuous_batching_config.return_logprobs = True
    return TRAINERS[trainer_kind(trainer)]


def wrap_rollouts(trainer, impl: Callable) -> None:
    """Route ``trainer._generate_single_turn(prompt_ids, ...)`` through ``impl(original, prompt_ids, ...)`` on this
    instance; ``impl`` returns what the original returns.

    Raises:
        ValueError: this trainer's rollouts are wrapped already.
    """
    if _WRAPPED_ATTR in vars(trainer):
        raise ValueError("hf_hybridcache.post_training.attach was called on this trainer already; attach once.")
    original = functools.partial(type(trainer)._generate_single_turn, trainer)
    vars(trainer)[_WRAPPED_ATTR] = original
    trainer._generate_single_turn = functools.partial(impl, original)


def split_result(trainer, result) -> tuple[list, list | None]:
    """``(completion_ids, logprobs)`` of what ``trainer``'s ``_generate_single_turn`` returned (logprobs None for
    RLOO)."""
    return result if TRAINERS[trainer_kind(trainer)] else (result, None)


def join_result(trainer, completion_ids: list, logprobs: list | None):
    """What ``trainer``'s ``_generate_single_turn`` returns for ``completion_ids`` and ``logprobs``."""
    return (completion_ids, logprobs) if TRAINERS[trainer_kind(trainer)] else completion_ids
