"""Small seeded models and a byte-level tokenizer made in code, for examples, tests and benchmarks (no hub access).

``long_memory_init_`` gives every Mamba mixer a slow decay so that the SSM state carries the prefix far enough to
drive the logits: with transformers' default init a tiny random model forgets its prefix within a few tokens, and a
broken restore could go unnoticed.
"""

from __future__ import annotations

import importlib.util
import itertools
import math

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .configs import _INKLING, COMMON, TINY_CONFIGS

#: Inkling 2 Loop is new in transformers 5.24: its tiny config exists where the installed transformers has it (its
#: tests skip on 5.23 with that reason). Six Inkling 2 layers whose layers 2-3 (one sliding, one full) run three
#: times, so the cache holds 6 + 2 * 2 layers; attention residual blocks of two layers.
#: Families whose tiny config needs a newer transformers than the oldest of the window: family -> (module, release).
NEWER_FAMILIES = {"inkling2_loop_text": ("inkling2_loop", "5.24"), "lara_mini": ("lara_mini", "5.24")}
if importlib.util.find_spec("transformers.models.inkling2_loop") is not None:
    TINY_CONFIGS["inkling2_loop_text"] = ("Inkling2LoopTextConfig", dict(
        _INKLING, num_hidden_layers=6, layer_types=["hybrid_sliding", "hybrid"] * 3, n_layers_per_attn_res_block=2,
        loop_layer_index_start=2, loop_layer_index_end=4, loop_num_passes=3, loop_gate_rank=8))

#: Lara Mini is new in transformers 5.24 too: gated delta net layers (grouped value heads), a sliding-window attention
#: layer (window 24) and a full attention layer, routed and shared experts.
if importlib.util.find_spec("transformers.models.lara_mini") is not None:
    TINY_CONFIGS["lara_mini"] = ("LaraMiniConfig", dict(
        num_hidden_layers=4, sliding_window=24, head_dim=16,
        layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, tie_word_embeddings=False, max_position_embeddings=16384))

_HEADS = ("num_attention_heads", "num_key_value_heads")
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
#: Byte-level vocabulary: the special tokens, then one token per byte.
VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (one token per UTF-8 byte) with ``<pad>``/``<s>``/``</s>`` and a chat template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(family: str = "jamba", **overrides):
    """A small config of ``family`` (a key of :data:`~hf_hybridcache.toy.configs.TINY_CONFIGS`) sized for CPU tests;
    ``overrides`` win.

    Raises:
        ValueError: no tiny config for ``family``.
    """
    if family in NEWER_FAMILIES and family not in TINY_CONFIGS:
        import transformers

        raise ValueError(f"No tiny config for family {family!r} on transformers {transformers.__version__}: the family "
                         f"is new in transformers {NEWER_FAMILIES[family][1]}; install a newer release of the window.")
    if family not in TINY_CONFIGS:
        raise ValueError(f"No tiny config for family {family!r}; available: {', '.join(sorted(TINY_CONFIGS))}.")
    import transformers

    class_name, settings = TINY_CONFIGS[family]
    config_class = getattr(transformers, class_name)
    # unpadded_vocab_size: the LM head's width where a config separates it from the (padded) embedding (Inkling 2
    # from transformers 5.24); other configs keep it as an unused attribute.
    vocab = {"vocab_size": VOCAB_SIZE, "unpadded_vocab_size": VOCAB_SIZE}
    # A config without attention heads (Mamba's) gets none, as a published one has none.
    common = {k: v for k, v in COMMON.items() if k not in _HEADS or k in config_class.__dataclass_fields__}
    return config_class(**{**common, **vocab, **settings, **overrides})


def long_memory_init_(
    model: torch.nn.Module, a_log: float = -3.0, step: float = 0.2, x_proj_std: float = 0.3
) -> torch.nn.Module:
    """Give every Mamba mixer ``A_log = a_log`` and a dt bias with ``softplus(bias) = step`` (in place); gated delta
    nets and KDA forget gates get ``A_log = -4``, ``dt_bias = -1``, bounded (safe) gates ``A_log = 0``,
    ``dt_bias = -8``, so that their state carries the prefix for 150+ tokens. Short convs have no decay to set.
    ZAYA's key scale (``ZayaQKNorm.temp``) starts at zero, which makes every attention score zero and its q|k conv
    window powerless; it is set to 1.

    Zamba's mixer has no norm on B and C (Jamba's has), so with ``initializer_range`` 0.1 its SSM states stay near 0.07
    and barely reach the logits; its per-head ``x_proj_weight`` is redrawn with std ``x_proj_std`` (from the global
    RNG) so that the SSM state is O(1) and a zeroed state moves the logits by about 0.5 instead of 0.08.
    """
    dt_bias = math.log(math.expm1(step))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log"):
                module.A_log.fill_(a_log)
                if hasattr(module, "x_proj_weight"):
                    module.x_proj_weight.normal_(0.0, x_proj_std)
                dt_proj = getattr(module, "dt_proj", None)
                if dt_proj is not None and dt_proj.bias is not None:
                    dt_proj.bias.fill_(dt_bias)
                elif hasattr(module, "dt_proj_bias"):  # Zamba keeps one dt bias per head as a bare parameter
                    module.dt_proj_bias.fill_(dt_bias)
                elif hasattr(module, "dt_bias"):
                    module.dt_bias.fill_(dt_bias)
            if type(module).__name__ == "ZayaQKNorm":
                module.temp.fill_(1.0)
            if hasattr(module, "A_log") and type(module).__name__.endswith(("GatedDeltaNet", "ForgetGate")):
                if getattr(module, "safe_gate", False):
                    # Bounded gate: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)); A_log = 0, dt_bias = -8
                    # make g about -5 * sigmoid(-8) = -1.7e-3 per token (a memory of several hundred tokens).
                    module.A_log.fill_(0.0)
                    module.dt_bias.fill_(-8.0)
                else:
                    # Gated delta rule / KDA: g = -exp(A_log) * softplus(a + dt_bias); A_log = -4, dt_bias = -1 decay
                    # the state by exp(-softplus(-1) / e^4) per token: it carries a prefix for ~150 tokens.
                    module.A_log.fill_(-4.0)
                    module.dt_bias.fill_(-1.0)
    return model


def build_model(
    family: str = "jamba", seed: int = 0, long_memory: bool = True, dtype: torch.dtype = torch.float32, **overrides
):
    """A seeded random-init ``*ForCausalLM`` of ``family`` in eval mode (long-memory init unless told otherwise)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if long_memory:
        long_memory_init_(model)
    model = model.to(dtype)
    # As from_pretrained does: the weights a family keeps in float32 in every dtype stay float32 (Inkling's short
    # convs and router; Inkling 2 fails in bf16 without it).
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if any(key in name for key in keep):
            tensor.data = tensor.data.float()
    return model.eval()
