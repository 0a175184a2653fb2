"""The hook points of training: TRL's trainers as :mod:`.trl` wraps them (TRL 1.16), and what ``model.train()`` changes
in transformers that :mod:`.training` reads (activation checkpointing's cache handling, each family's dropout)."""

from __future__ import annotations

import inspect
import re

from .hook_checks import HookPoint, parameters, resolve, source_mentions
from .hook_points_models import FAMILIES

_TRL = "hf_hybridcache._compat.trl"
_TRAINING = "hf_hybridcache._compat.training"
#: How the supported modeling files apply dropout, whitespace removed: ``eager_attention_forward``'s parameter and its
#: call, the attention modules' ``attention_dropout`` (read when ``self.training``), a literal 0.0, ``nn.Dropout``.
_KNOWN_DROPOUT = (
    re.compile(r"^dropout:float=0\.0,?$"),
    re.compile(r"^attn_weights=nn\.functional\.dropout\(attn_weights,p=dropout,training=module\.training\)$"),
    re.compile(r"^self\.attention_dropout=(config\.attention_dropout|0\.0)$"),
    re.compile(r"^dropout=0\.0(ifnotself\.trainingelseself\.attention_dropout)?,?$"),
    re.compile(r"nn\.Dropout\("),
)


def _dropout_known(module: str):
    """Every line of ``module``'s code that applies dropout does it in one of the ways :data:`_KNOWN_DROPOUT` lists,
    which :func:`~hf_hybridcache._compat.training.dropout_probability` reads."""

    def check():
        lines = ["".join(line.split("#")[0].split()) for line in inspect.getsource(resolve(module)).splitlines()]
        code = [line for line in lines if "dropout" in line and not line.startswith(('"', "'", "r\""))]
        unknown = [line for line in code if not any(p.search(line) for p in _KNOWN_DROPOUT)
                   and not line.endswith(("=config.attention_dropout", ":float"))]
        return f"applies dropout in a way the package does not read: {unknown[:3]}" if unknown else None

    return check


def _trainer_points(name: str, module: str, takes: tuple[str, ...], returns: str) -> list[HookPoint]:
    target = f"trl.trainer.{module}:{name}"
    dotted = target.replace(":", ".")
    used = f"{_TRL} (wraps it per trainer: a seed per rollout, the outputs it generates)"
    return [
        HookPoint(f"{dotted}._generate_single_turn", parameters(f"{target}._generate_single_turn", *takes,
                                                                leading=True), used),
        HookPoint(f"{dotted}._generate_single_turn[generate_batch]",
                  source_mentions(f"{target}._generate_single_turn", "elif self.use_transformers_continuous_batching:",
                                  "unwrapped_model.generate_batch(", "self.continuous_batching_config",
                                  "if self.args.bf16:", "unwrapped_model.to(torch.bfloat16)", "all_outputs.values()"),
                  f"{_TRL} (the rollouts of one call are one generate_batch call, in prompt order; the cast is "
                  "rollout_cast's)"),
        HookPoint(f"{dotted}._generate[_generate_single_turn]",
                  source_mentions(f"{target}._generate", f"{returns} = self._generate_single_turn("),
                  f"{_TRL}.split_result, join_result (what the rollout call returns)"),
        HookPoint(f"{dotted}.__init__[continuous_batching_config]",
                  source_mentions(f"{target}.__init__", "self.continuous_batching_config = ContinuousBatchingConfig(",
                                  "self.use_transformers_continuous_batching"),
                  f"{_TRL}.trainer_kind, ask_for_logprobs"),
    ]


def _trl() -> list[HookPoint]:
    grpo = "trl.trainer.grpo_trainer:GRPOTrainer"
    return [
        *_trainer_points("GRPOTrainer", "grpo_trainer", ("prompt_ids", "images", "multimodal_fields",
                                                         "num_generations"), "completion_ids, logprobs"),
        *_trainer_points("RLOOTrainer", "rloo_trainer", ("prompt_ids", "images", "multimodal_fields"),
                         "completion_ids"),
        HookPoint(f"{grpo.replace(':', '.')}._generate_and_score_completions[sampling_per_token_logps]",
                  source_mentions(f"{grpo}._generate_and_score_completions", "sampling_per_token_logps_list,",
                                  'output["sampling_per_token_logps"] = sampling_per_token_logps'),
                  f"{_TRL}.ask_for_logprobs (the rollouts' logprobs reach the trainer's inputs)"),
        HookPoint("transformers.trainer_callback.TrainerCallback.on_optimizer_step",
                  source_mentions("transformers.trainer", "self.callback_handler.on_optimizer_step("),
                  "hf_hybridcache.post_training.rollouts (declares a weights step after each optimizer step)"),
    ]


def _training() -> list[HookPoint]:
    layer = "transformers.modeling_layers:GradientCheckpointingLayer.__init_subclass__"
    points = [HookPoint(f"{layer.replace(':', '.')}[is_grad_enabled]",
                        source_mentions(layer, "self.gradient_checkpointing and self.training and "
                                               "torch.is_grad_enabled()"),
                        f"{_TRAINING}.CHECKPOINTING_KEEPS_CACHE_WITHOUT_GRAD (the cache survives activation "
                        "checkpointing without autograd)", ">=5.24.0")]
    points += [HookPoint(f"{family.module}[dropout]", _dropout_known(family.module),
                         f"{_TRAINING}.dropout_probability (a training-mode forward may store only without dropout)",
                         family.versions) for family in FAMILIES]
    return points


TRAINING_HOOK_POINTS: tuple[HookPoint, ...] = (*_trl(), *_training())
