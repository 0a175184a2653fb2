"""Small seeded models and a byte-level tokenizer made in code, for examples, tests and benchmarks (no hub access).

``long_memory_init_`` gives every Mamba mixer a slow decay so that the SSM state carries the prefix far enough to
drive the logits: with transformers' default init a tiny random model forgets its prefix within a few tokens, and a
broken restore could go unnoticed.
"""

from __future__ import annotations

import math

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

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


#: Settings every tiny config shares (``tiny_config`` adds each family's own on top).
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

#: family -> (transformers config class, the family's own settings).
_TINY_CONFIGS = {
    "jamba": (
        "JambaConfig",
        dict(
            num_hidden_layers=4,
            attn_layer_period=4,
            attn_layer_offset=2,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=8,
            tie_word_embeddings=False,
        ),
    ),
    # Mamba-1 layers with two heads each and two hybrid layers, so the shared transformer block writes KV at two
    # layer indices.
    "zamba": (
        "ZambaConfig",
        dict(
            num_hidden_layers=5,
            layers_block_type=["linear_attention", "linear_attention", "hybrid", "linear_attention", "hybrid"],
            n_mamba_heads=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=8,
            # Tied embeddings make this tiny model repeat the last prompt token forever (the input embedding
            # dominates the residual stream), which leaves greedy comparisons and stop strings nothing to check.
            # transformers ties the shared block's copies only when this is True, so here each hybrid layer has its
            # own block; the cache layout (KV on each hybrid layer index) is the same either way.
            tie_word_embeddings=False,
        ),
    ),
    # Mamba-2 layers and two hybrid layers sharing one attention block (with rotary embeddings and per-layer
    # adapters). ``chunk_size=12`` is neither a divisor nor a multiple of the default ``block_size`` 16, so block
    # boundaries fall inside chunks.
    "zamba2": (
        "Zamba2Config",
        dict(
            num_hidden_layers=4,
            layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
            # transformers 5.23's adapters project to the full attention width, so they need as many KV heads as
            # query heads (as in the published Zamba2 checkpoints that use them).
            num_key_value_heads=4,
            num_mem_blocks=1,
            use_shared_attention_adapter=True,
            adapter_rank=8,
            use_mem_rope=True,
            n_mamba_heads=4,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_ngroups=2,
            chunk_size=12,
            max_position_embeddings=16384,  # the quickstart's prompts exceed the 2048/4096 defaults
        ),
    ),
    # Attention and Mamba-2 side by side in every layer, with non-trivial µP multipliers. ``mamba_chunk_size=32`` is
    # a multiple of the default ``block_size`` 16: every other block boundary is a chunk boundary.
    "falcon_h1": (
        "FalconH1Config",
        dict(
            num_hidden_layers=3,
            mamba_d_ssm=128,
            mamba_n_heads=4,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_n_groups=2,
            mamba_chunk_size=32,
            ssm_in_multiplier=1.5,
            ssm_multipliers=[1.0, 1.2, 0.8, 1.0, 1.1],
        ),
    ),
    # Mamba-2 layers around one attention layer; ``mamba_chunk_size=8`` divides the default ``block_size`` 16.
    "bamba": (
        "BambaConfig",
        dict(
            num_hidden_layers=4,
            attn_layer_indices=[2],
            mamba_n_heads=4,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_n_groups=2,
            mamba_chunk_size=8,
        ),
    ),
    # Mamba-2 layers around one attention layer, dense MLPs (no experts), no position embedding as in Granite 4.0-H;
    # ``mamba_chunk_size=16`` equals the default ``block_size``.
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        dict(
            shared_intermediate_size=128,
            num_local_experts=0,
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            mamba_n_heads=4,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_n_groups=2,
            mamba_chunk_size=16,
            max_position_embeddings=16384,  # the quickstart's prompts exceed the 2048/4096 defaults
        ),
    ),
    # Mamba-2, MLP and attention layers; ``chunk_size=20`` is neither a divisor nor a multiple of the default
    # ``block_size`` 16.
    "nemotron_h": (
        "NemotronHConfig",
        dict(
            layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"],
            head_dim=16,
            mamba_num_heads=4,
            mamba_head_dim=32,
            ssm_state_size=16,
            n_groups=2,
            conv_kernel=4,
            chunk_size=20,
            max_position_embeddings=16384,  # the quickstart's prompts exceed the 2048/4096 defaults
        ),
    ),
    # Gated delta net layers around one gated attention layer, with grouped value heads (4 value heads over 2 key
    # heads) and MoE MLPs; GDN's chunked kernel uses chunks of 64 tokens, so block boundaries fall inside chunks.
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            max_position_embeddings=16384,
        ),
    ),
    # Qwen3.5's text decoder: GDN layers with separate q|k|v, z, b and a projections, dense MLPs.
    "qwen3_5_text": (
        "Qwen3_5TextConfig",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            max_position_embeddings=16384,
        ),
    ),
    # Qwen3.5-MoE's text decoder: as Qwen3.5 with routed + shared experts.
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            max_position_embeddings=16384,
        ),
    ),
    # GDN decoder layers and attention decoder layers; beta up to 2 (``linear_allow_neg_eigval``, the default).
    "olmo_hybrid": (
        "OlmoHybridConfig",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=False,
            max_position_embeddings=16384,
        ),
    ),
    # KDA layers around one MLA layer (NoPE): the cache holds a 32-wide latent as keys and an 8-wide rope key as
    # values. MoE MLPs after the first layer; MLA expands its latent to every head, so as many KV heads as heads.
    "kimi_linear": (
        "KimiLinearConfig",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            num_key_value_heads=4,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            linear_num_heads=4,
            linear_head_dim=16,
            linear_conv_kernel_dim=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=32,
            tie_word_embeddings=False,
            max_position_embeddings=16384,
        ),
    ),
    # Ling (bailing_hybrid): KDA layers with the bounded ("safe") forget gate around one MLA layer with interleaved
    # rotary embeddings on the rope key (a 32-wide latent as keys, a 16-wide rope key as values), gated output.
    # ``head_dim`` is the KDA head dim (the config then sets ``head_dim = qk_rope_head_dim``; equal here, so a
    # save_pretrained round trip cannot change either).
    "bailing_hybrid": (
        "BailingHybridConfig",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            num_key_value_heads=4,
            head_dim=16,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
            short_conv_kernel_size=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=32,
            tie_word_embeddings=False,
            max_position_embeddings=16384,
        ),
    ),
    # Short-conv layers (conv window of 3 tokens) around one attention layer.
    "lfm2": (
        "Lfm2Config",
        dict(
            num_hidden_layers=4,
            layer_types=["conv", "conv", "full_attention", "conv"],
            block_auto_adjust_ff_dim=False,
            tie_word_embeddings=False,
            max_position_embeddings=16384,
        ),
    ),
    # LFM2-MoE: short-conv and attention layers, the first dense, the rest with routed experts.
    "lfm2_moe": (
        "Lfm2MoeConfig",
        dict(
            num_hidden_layers=4,
            layer_types=["conv", "conv", "full_attention", "conv"],
            conv_L_cache=3,
            num_dense_layers=1,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            tie_word_embeddings=False,
            max_position_embeddings=16384,
        ),
    ),
}


def tiny_config(family: str = "jamba", **overrides):
    """A small config of ``family`` (a key of ``_TINY_CONFIGS``) sized for CPU tests; ``overrides`` win.

    Raises:
        ValueError: no tiny config for ``family``.
    """
    if family not in _TINY_CONFIGS:
        raise ValueError(f"No tiny config for family {family!r}; available: {', '.join(sorted(_TINY_CONFIGS))}.")
    import transformers

    class_name, settings = _TINY_CONFIGS[family]
    return getattr(transformers, class_name)(**{**_COMMON, **settings, **overrides})


def long_memory_init_(
    model: torch.nn.Module, a_log: float = -3.0, step: float = 0.2, x_proj_std: float = 0.3
) -> torch.nn.Module:
    """Give every Mamba mixer ``A_log = a_log`` and a dt bias with ``softplus(bias) = step`` (in place); gated delta
    nets and KDA forget gates get ``A_log = -4``, ``dt_bias = -1``, bounded (safe) gates ``A_log = 0``,
    ``dt_bias = -8``, so that their state carries the prefix for 150+ tokens. Short convs have no decay to set.

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
    return model.to(dtype).eval()
