"""Post-training on hybrids: a trainer's rollouts through the engine, and weights that change every step.

``attach(trainer, cache)`` serves a TRL ``GRPOTrainer`` or ``RLOOTrainer`` (made with
``use_transformers_continuous_batching=True``) with the cache's engine: the ``num_generations`` rollouts of a prompt
compute it once, each rollout samples with a seed of its own (what ``generate()`` gives it alone, without the cache),
GRPO gets the sampler's logprobs, and the trainer's optimizer steps are declared to the cache
(``weights_step``: one weights state per step, nothing read, earlier entries dropped). Recipes: docs/post-training.md.

Modules: ``steps`` (:func:`weights_step`), ``rollouts`` (:func:`attach` and what it records).
"""

from .rollouts import Rollout, RolloutCall, RolloutLog, attach
from .steps import weights_step

__all__ = ["Rollout", "RolloutCall", "RolloutLog", "attach", "weights_step"]
