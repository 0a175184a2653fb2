"""Whether forwards of a model in training mode may restore and store cached states: what ``model.train()``
changes in the supported families, read from the modules.

A stored entry must be what an inference forward computes from its tokens alone. ``model.train()`` changes three
things in the supported modeling files, and none of them is a mixer's arithmetic (no Mamba, gated delta net, KDA or
short-conv mixer has a dropout):

- dropout: the attention modules apply ``attention_dropout`` (from the config; 0.0 in every supported family's
  default) when ``self.training``, and ``torch.nn.Dropout`` modules are active in training mode. With any probability
  above 0 a forward is random: its states are not its tokens' states, so nothing is restored (each forward draws its
  own masks, as it does without the cache) and nothing is stored;
- the Mamba mixers' fused training kernel (``mamba_split_conv1d_scan_combined``), taken only when no cache is passed:
  never with this package's caches;
- activation checkpointing: ``GradientCheckpointingLayer`` drops the cache in training mode, on transformers 5.23
  even without autograd (5.24 and later only while autograd records).

So a forward without autograd, in training mode with every dropout at 0 (the rollouts of TRL's trainers:
``model.train()`` and ``torch.no_grad()``), computes what it computes in eval mode, and restores and stores as in
eval mode. A forward with autograd in training mode is a training forward and stores nothing.
"""

from __future__ import annotations

import torch
import transformers
from packaging.version import Version

#: transformers >= 5.24 keeps the cache under activation checkpointing while autograd records nothing
#: (``GradientCheckpointingLayer``, ``modeling_layers.py``); 5.23 drops it in training mode whatever autograd does.
CHECKPOINTING_KEEPS_CACHE_WITHOUT_GRAD = Version(transformers.__version__) >= Version("5.24.0")


def dropout_probability(model: torch.nn.Module) -> float:
    """The largest dropout probability a forward of ``model`` applies now: of its ``torch.nn.Dropout`` modules and of
    the ``attention_dropout`` its attention modules read, each counted only while its module is in training mode."""
    largest = 0.0
    for module in model.modules():
        if not module.training:
            continue
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            largest = max(largest, float(module.p))
        attention = getattr(module, "attention_dropout", None)
        if isinstance(attention, (int, float)) and not isinstance(attention, bool):
            largest = max(largest, float(attention))
    return largest


def uncached_cause(model: torch.nn.Module, grad: bool | None = None) -> str | None:
    """Why forwards of ``model`` may not restore or store cached states now (a key of
    :data:`~hf_hybridcache.core.NOT_CACHEABLE`), or None when they may (eval mode, or training mode without
    autograd and with every dropout at 0). ``grad``: whether autograd records (the current state when None).

    - ``"training"``: training mode with autograd on (a training forward);
    - ``"gradient_checkpointing"``: training mode with activation checkpointing on transformers 5.23, whose layers
      drop the cache;
    - ``"dropout"``: training mode with a dropout probability above 0 (:func:`dropout_probability`).
    """
    if not model.training:
        return None
    if torch.is_grad_enabled() if grad is None else grad:
        return "training"
    if not CHECKPOINTING_KEEPS_CACHE_WITHOUT_GRAD and getattr(model, "is_activation_checkpointing", False):
        return "gradient_checkpointing"
    return "dropout" if dropout_probability(model) > 0 else None
