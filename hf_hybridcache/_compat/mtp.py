"""Multi-token prediction (MTP) heads that checkpoints ship and transformers drops at load
(``_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]``), rebuilt from transformers' own layers, and the target's final
hidden states they draft from.

A Qwen3.5 MTP head (the layout of Qwen/Qwen3.5 checkpoints' ``mtp.*`` keys, as vLLM's ``qwen3_5_mtp.py`` loads them)
predicts the token after next: for the target's final hidden state ``h_i`` at position ``i`` (the one that predicted
token ``x_{i+1}``) and the embedding of ``x_{i+1}``::

    u = fc(cat(pre_fc_norm_embedding(embed(x_{i+1})), pre_fc_norm_hidden(h_i)))     # [.., 2H] -> [.., H]
    m = norm(layers(u, position i))                                                 # full-attention decoder layers
    logits of x_{i+2} = lm_head(m)                                                  # the target's embed and lm_head

and ``m`` stands in for ``h_{i+1}`` when it drafts one more token. Only dense Qwen3.5 heads of one layer
(``qwen3_5_text`` and the wrapper ``qwen3_5``'s text model; the released checkpoints' ``mtp_num_hidden_layers`` is 1)
are built here; Qwen3-Next's and Qwen3.5-MoE's heads hold routed experts stored per
expert (a conversion transformers' loader does for the main model) and Nemotron-H's a block list of its own
(``mtp_layers_block_type``).
"""

from __future__ import annotations

import contextlib
import copy
import inspect

import torch
from torch import nn

from .cache_kwargs import CACHE_KWARG_NAMES

#: ``model_type`` of the text configs whose MTP head :class:`MTPHead` builds.
MTP_MODEL_TYPES = ("qwen3_5_text",)


def text_config(config):
    """The text decoder's config of ``config`` (a wrapper's ``text_config``, else ``config`` itself)."""
    return getattr(config, "text_config", None) or config


def mtp_support_error(config) -> str | None:
    """Why no MTP head is built for a model of ``config`` (one sentence), or None."""
    text = text_config(config)
    if text.model_type not in MTP_MODEL_TYPES:
        return (f"MTP heads are read for dense Qwen3.5 ({', '.join(MTP_MODEL_TYPES)}) only, not "
                f"{text.model_type}; use the n-gram drafter or a draft model.")
    num_layers = getattr(text, "mtp_num_hidden_layers", 1)
    if num_layers != 1:  # vLLM runs layer (draft step % n) of n, each over its own keys: not built here
        return (f"MTP heads of one layer are read (Qwen3.5 ships one); this config has mtp_num_hidden_layers="
                f"{num_layers}; use the n-gram drafter or a draft model.")
    return None


class MTPHead(nn.Module):
    """A dense Qwen3.5 MTP head (``mtp.fc``, ``mtp.layers.0``, ``mtp.norm``, ``mtp.pre_fc_norm_hidden``,
    ``mtp.pre_fc_norm_embedding``; its parameter names are the checkpoint's without ``mtp.``).

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
        from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

        text = copy.deepcopy(text_config(config))
        num_layers = 1
        text.num_hidden_layers, text.layer_types = num_layers, ["full_attention"] * num_layers
        text._attn_implementation = "sdpa"
        hidden, eps = text.hidden_size, text.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(qwen.Qwen3_5DecoderLayer(text, i) for i in range(num_layers))
        self.norm = qwen.Qwen3_5RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = qwen.Qwen3_5RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_embedding = qwen.Qwen3_5RMSNorm(hidden, eps=eps)
        self.rotary_emb = qwen.Qwen3_5TextRotaryEmbedding(text)
        parameters = inspect.signature(qwen.Qwen3_5DecoderLayer.forward).parameters
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
        return self.norm(u)


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
