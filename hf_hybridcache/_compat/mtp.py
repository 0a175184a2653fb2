"""Multi-token prediction (MTP) heads that checkpoints ship and transformers drops at load
(``_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]``), rebuilt from transformers' own layers, and the target's final
hidden states they draft from.

A Qwen3.5 MTP head (the layout of Qwen/Qwen3.5 checkpoints' ``mtp.*`` keys, as vLLM's ``qwen3_5_mtp.py`` loads them)
predicts the token after next: for the target's final hidden state ``h_i`` at position ``i`` (the one that predicted
token ``x_{i+1}``) and the embedding of ``x_{i+1}``::

    u = fc(cat(pre_fc_norm_embedding(embed(x_{i+1})), pre_fc_norm_hidden(h_i)))     # [.., 2H] -> [.., H]
    m = norm(layers(u, position i))                                                 # full-attention decoder layers
    logits of x_{i+2} = lm_head(m)                                                  # the target's embed and lm_head

and ``m`` stands in for ``h_{i+1}`` when it drafts one more token. Heads of one layer (the released checkpoints'
``mtp_num_hidden_layers``) are built for Qwen3.5, Qwen3.5-MoE and Qwen3-Next (and a wrapper's text model); their
routed experts, stored one by one in the checkpoint, are fused as transformers' loader fuses the main model's
(:func:`fuse_experts`). Nemotron-H's head, a block list of its own (``mtp_layers_block_type``), is not built.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import re

import torch
from torch import nn

from .cache_kwargs import CACHE_KWARG_NAMES

#: ``model_type`` of a text config -> (its modeling module, decoder layer, RMS norm and rotary embedding classes).
MTP_FAMILIES = {
    "qwen3_5_text": ("qwen3_5", "Qwen3_5DecoderLayer", "Qwen3_5RMSNorm", "Qwen3_5TextRotaryEmbedding"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeDecoderLayer", "Qwen3_5MoeRMSNorm", "Qwen3_5MoeTextRotaryEmbedding"),
    "qwen3_next": ("qwen3_next", "Qwen3NextDecoderLayer", "Qwen3NextRMSNorm", "Qwen3NextRotaryEmbedding"),
}
#: ``model_type`` of the text configs whose MTP head :class:`MTPHead` builds.
MTP_MODEL_TYPES = tuple(MTP_FAMILIES)
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def text_config(config):
    """The text decoder's config of ``config`` (a wrapper's ``text_config``, else ``config`` itself)."""
    return getattr(config, "text_config", None) or config


def mtp_support_error(config) -> str | None:
    """Why no MTP head is built for a model of ``config`` (one sentence), or None."""
    text = text_config(config)
    if text.model_type not in MTP_FAMILIES:
        return (f"MTP heads are read for Qwen3.5, Qwen3.5-MoE and Qwen3-Next ({', '.join(MTP_MODEL_TYPES)}) only, "
                f"not {text.model_type}; use the n-gram drafter or a draft model.")
    num_layers = getattr(text, "mtp_num_hidden_layers", 1)
    if num_layers != 1:  # vLLM runs layer (draft step % n) of n, each over its own keys: not built here
        return (f"MTP heads of one layer are read (Qwen3.5 and Qwen3-Next ship one); this config has "
                f"mtp_num_hidden_layers={num_layers}; use the n-gram drafter or a draft model.")
    return None


def fuse_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with routed experts stored one by one (``layers.L.mlp.experts.E.{gate,up,down}_proj.weight``, as
    checkpoints hold them) fused as transformers' MoE blocks hold them: ``experts.gate_up_proj`` ``[E, 2I, H]`` (each
    expert's gate rows, then its up rows) and ``experts.down_proj`` ``[E, H, I]``."""
    out, experts = {}, {}
    for name, tensor in weights.items():
        found = _EXPERT.match(name)
        if found is None:
            out[name] = tensor
        else:
            experts.setdefault(found.group(1), {}).setdefault(int(found.group(2)), {})[found.group(3)] = tensor
    for prefix, by_expert in experts.items():
        ordered = [by_expert[e] for e in sorted(by_expert)]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([w["gate"], w["up"]]) for w in ordered])
        out[f"{prefix}.down_proj"] = torch.stack([w["down"] for w in ordered])
    return out


class MTPHead(nn.Module):
    """An MTP head of one layer (``mtp.fc``, ``mtp.layers.0``, ``mtp.norm``, ``mtp.pre_fc_norm_hidden``,
    ``mtp.pre_fc_norm_embedding``; its parameter names are the checkpoint's without ``mtp.``, routed experts fused:
    :func:`fuse_experts`), built from the family's own decoder layer (a full-attention one; Qwen3-Next's and
    Qwen3.5-MoE's with their routed and shared experts).

    Args:
        config: the target's config (a wrapper's text config is taken; ``mtp_num_hidden_layers`` 1 or unset).

    Raises:
        ValueError: the family has no head built here (:func:`mtp_support_error`).
    """

    def __init__(self, config) -> None:
        super().__init__()
        problem = mtp_support_error(config)
        if problem is not None:
            raise ValueError(problem)
        text = copy.deepcopy(text_config(config))
        folder, layer_class, norm_class, rotary_class = MTP_FAMILIES[text.model_type]
        modeling = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
        text.num_hidden_layers, text.layer_types = 1, ["full_attention"]
        text._attn_implementation = "sdpa"
        hidden, eps = text.hidden_size, text.rms_norm_eps
        norm = getattr(modeling, norm_class)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([getattr(modeling, layer_class)(text, 0)])
        self.norm = norm(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm(hidden, eps=eps)
        self.pre_fc_norm_embedding = norm(hidden, eps=eps)
        self.rotary_emb = getattr(modeling, rotary_class)(text)
        parameters = inspect.signature(getattr(modeling, layer_class).forward).parameters
        self._cache_name = next(n for n in CACHE_KWARG_NAMES if n in parameters)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, cache) -> torch.Tensor:
        """The head's output ``m`` ``[B, T, H]`` for token embeddings and target hidden states ``[B, T, H]`` (the
        model's dtype) at ``position_ids`` ``[B, T]`` int64, continuing over ``cache`` (a transformers
        ``DynamicCache`` of this head's layers, updated in place)."""
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        position_embeddings = self.rotary_emb(u, position_ids)
        for layer in self.layers:  # mask None: causal over a multi-token call, every key for one token
            u = layer(u, position_embeddings=position_embeddings, attention_mask=None, position_ids=position_ids,
                      **{self._cache_name: cache})
        return self.norm(u[0] if isinstance(u, tuple) else u)


def new_head_cache():
    """An empty ``DynamicCache`` for an :class:`MTPHead`'s layers."""
    from transformers import DynamicCache

    return DynamicCache()


def cut_head_cache(cache, num_tokens: int) -> None:
    """Cut ``cache`` (:func:`new_head_cache`'s) back to its first ``num_tokens`` tokens. A negative ``crop`` removes
    that many tokens on every version; 5.25 refuses the positive one (the length to keep) that 5.23 took."""
    cache.crop(-max(cache.get_seq_length() - num_tokens, 0))


@contextlib.contextmanager
def final_hidden_states(model):
    """Within the block, ``captured[0]`` is the final (normed) hidden states ``[B, T, H]`` of ``model``'s last
    forward: its decoder's ``last_hidden_state`` (``model.get_decoder()``), what its ``lm_head`` reads."""
    captured: list[torch.Tensor] = []

    def keep(module, args, output) -> None:
        captured[:] = [output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]]

    handle = model.get_decoder().register_forward_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()
