"""Tiny configs of every supported family for CPU tests, examples and benchmarks, built by
:func:`~hf_hybridcache.toy.tiny_config` (which adds the byte tokenizer's ``vocab_size``): each family's layer pattern
and state kinds at a few thousand parameters per layer."""

from __future__ import annotations

#: Settings every tiny config shares (``tiny_config`` adds the vocabulary size and each family's own on top).
COMMON = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)

#: What Inkling and Inkling 2's tiny configs share: sliding-window (window 24) and full attention layers, each with four
#: short convs (width 3), and routed experts.
_INKLING = dict(
    num_hidden_layers=4,
    layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
    sliding_window_size=24,
    head_dim=16,
    swa_head_dim=16,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    d_rel=4,
    rel_extent=64,
    conv_kernel_size=3,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    max_position_embeddings=16384,
)

#: family -> (transformers config class, the family's own settings).
TINY_CONFIGS = {
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
    # LFM3: short-conv layers, a sliding-window attention layer (window of 24 tokens, longer than a 16-token block and
    # shorter than the prompts the tests reuse) and a full attention layer.
    "lfm3": (
        "Lfm3Config",
        dict(
            num_hidden_layers=4,
            layer_types=["conv", "sliding_attention", "full_attention", "conv"],
            sliding_window=24,
            head_dim=16,
            conv_L_cache=3,
            tie_word_embeddings=False,
            max_position_embeddings=16384,
        ),
    ),
    # Inkling: _INKLING with dense MLPs.
    "inkling_text": (
        "InklingTextConfig",
        dict(
            _INKLING,
            mlp_layer_types=["dense"] * 4,
            logits_mup_width_multiplier=1.0,  # upstream divides the logits by 24: too flat for the power tests
        ),
    ),
    # Inkling 2: as Inkling, with dynamic short convs on the full-attention layers' keys and values.
    "inkling2_text": ("Inkling2TextConfig", dict(_INKLING)),
    # Mixers only, no attention layer: Mamba-1 (Falcon-Mamba's with norms on dt, B and C) and Mamba-2, whose
    # ``chunk_size=24`` is neither a divisor nor a multiple of the default ``block_size`` 16.
    "mamba": ("MambaConfig", dict(num_hidden_layers=4, time_step_rank=8, tie_word_embeddings=False)),
    "falcon_mamba": ("FalconMambaConfig", dict(num_hidden_layers=4, time_step_rank=8, tie_word_embeddings=False)),
    "mamba2": ("Mamba2Config", dict(num_hidden_layers=4, num_heads=4, head_dim=32, state_size=16, n_groups=2,
                                    chunk_size=24)),
    # ZAYA: CCA attention layers (conv window of 2 q|k inputs, one delayed value), sliding (window 24) and full.
    "zaya": (
        "ZayaConfig",
        dict(
            num_hidden_layers=4,
            layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
            sliding_window=24,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            router_hidden_size=16,
            tie_word_embeddings=False,
            max_position_embeddings=16384,
        ),
    ),
}
