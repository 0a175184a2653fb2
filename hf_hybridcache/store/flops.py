"""Prefill FLOPs of a hybrid model: what a restored prefix saves, for FLOP-aware eviction.

A token at position ``t`` (0-based, so it attends to ``t + 1`` keys) costs, summed over the decoder layers::

    flops(t) = 2 * W  +  SCAN_FLOPS_PER_STATE_ELEMENT * S  +  4 * A * (t + 1)

- ``W``: weights one token is multiplied with — every linear and conv weight of every decoder layer (attention
  projections, Mamba in/x/dt/out projections and conv, MLPs); for mixture-of-experts layers only the routed share,
  ``num_experts_per_tok / num_experts`` of the expert weights. A weight costs a multiply and an add. A module shared
  by several layers (Zamba2's shared attention block) counts once per layer that runs it. The embedding lookup and the
  LM head are left out: prefill computes logits for the last token only.
- ``S``: elements of all recurrent states (Mamba SSM states ``[I, N]`` / ``[H, D, N]``, gated-delta-rule states
  ``[Hv, Dk, Dv]``; a short conv has none); a selective scan or delta rule does about
  ``SCAN_FLOPS_PER_STATE_ELEMENT`` operations per state element and token (decay the state, read it with the key,
  write the correction, read it out).
- ``A``: the sum over attention layers of ``num_attention_heads * (Dk + Dv) / 2`` (``num_attention_heads * D`` where
  keys and values have one width); the scores ``q.k`` and the weighted sum of values cost 2 FLOPs per dimension each,
  per query and key. For MLA layers ``Dk`` and ``Dv`` are the cached widths (latent and rope key), which stand in
  for the expanded head dims (within a factor of two for Kimi Linear's and Ling's shapes). A sliding-window layer
  attends to at most ``sliding_window`` keys, so it is counted as that many keys per token in the
  position-independent part instead.

So the prefill of tokens ``[0, n)`` costs ``n * (2W + scan) + 4A * n (n + 1) / 2``: linear in ``n`` for the
projections, MLPs and Mamba layers, quadratic for attention. The accounting follows the per-layer FLOP counts of the
Marconi paper (Pan et al., "Marconi: Prefix Caching for the Era of Hybrid LLMs", MLSys 2025); counting the weights
of the built model (on the meta device if need be) instead of re-deriving them from each family's config fields keeps
one model for every supported family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _compat
from ..config import ModelStateSpec

#: Operations per SSM state element and token of a selective scan (exp of the step, decay, input, readout).
SCAN_FLOPS_PER_STATE_ELEMENT = 6


@dataclass(frozen=True)
class FlopModel:
    """Prefill FLOPs as a function of position.

    Attributes:
        flops_per_token: FLOPs of one token that do not depend on its position (projections, MLPs, Mamba layers).
        flops_per_key: attention FLOPs per key a token attends to (``4 * A`` above).
    """

    flops_per_token: float
    flops_per_key: float

    def prefill_flops(self, num_tokens: int) -> float:
        """FLOPs to prefill tokens ``[0, num_tokens)`` from scratch."""
        return num_tokens * self.flops_per_token + self.flops_per_key * num_tokens * (num_tokens + 1) / 2

    def span_flops(self, start_tokens: int, end_tokens: int) -> float:
        """FLOPs of tokens ``[start_tokens, end_tokens)`` after a prefix of ``start_tokens``: what restoring a state
        at ``end_tokens`` instead of one at ``start_tokens`` saves."""
        return self.prefill_flops(end_tokens) - self.prefill_flops(start_tokens)

    @classmethod
    def from_model(cls, model: torch.nn.Module, spec: ModelStateSpec) -> FlopModel:
        """Count the model's per-token weights and state sizes (works on a model built on the meta device)."""
        config = model.config.get_text_config(decoder=True)
        top_k = getattr(config, "num_experts_per_tok", None) or 1
        layers = _decoder_layers(model, config)
        # A looped layer (Inkling 2 Loop) multiplies its weights once per pass.
        passes = [*range(len(layers)), *_compat.loop_cache_layers(model.config).values()]
        weights = sum(_weights_per_token(layers[idx], top_k) for idx in passes)
        state_elements = sum(_numel(m.ssm.shape) for m in spec.mamba)
        heads = config.num_attention_heads if spec.attention else 0  # Mamba's config has no attention heads
        per_key = sum(2 * heads * (a.head_dim + a.value_head_dim) for a in spec.attention if a.sliding_window is None)
        sliding = sum(
            2 * heads * (a.head_dim + a.value_head_dim) * a.sliding_window
            for a in spec.attention
            if a.sliding_window is not None
        )
        return cls(2 * weights + SCAN_FLOPS_PER_STATE_ELEMENT * state_elements + sliding, per_key)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _decoder_layers(model: torch.nn.Module, config) -> torch.nn.ModuleList:
    """The list of decoder layers: the first ``ModuleList`` with ``num_hidden_layers`` entries (of the language model
    in a vision-language wrapper, whose vision tower may have as many layers)."""
    language = getattr(getattr(model, "model", None), "language_model", None) or getattr(model, "language_model", None)
    for module in (language or model).modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == config.num_hidden_layers:
            return module
    raise ValueError(f"Cannot find the {config.num_hidden_layers} decoder layers of {type(model).__name__}.")


def _weights_per_token(layer: torch.nn.Module, top_k: int) -> float:
    """Weights one token multiplies in ``layer``: linear and conv weights, routed experts' share of expert weights."""
    total = 0.0
    for module in layer.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d)):
            total += module.weight.numel()
        num_experts = getattr(module, "num_experts", None)
        if isinstance(num_experts, int) and num_experts > 0:
            for param in module.parameters(recurse=False):
                if param.dim() == 3 and param.shape[0] == num_experts:
                    total += param.numel() * min(top_k, num_experts) / num_experts
    return total
