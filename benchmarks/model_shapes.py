"""Real model shapes for the TTFT benchmark: the configs of small public hybrid checkpoints, built with random weights.

Each shape is written from the checkpoint's public ``config.json`` (named in its comment) and keeps what decides the
cost of a prefill and of a cache entry: widths, heads, state sizes, conv widths, chunk sizes and the layer pattern.
µP multipliers, token ids and rope scaling are left at transformers' defaults: they change no cost. Weights are
random (transformers' own init from a fixed seed); nothing is downloaded.

``--layers N`` cuts a shape to its first N layers, which keeps the layer pattern (``layer_types`` is truncated, or
Jamba's attention/expert periods stay as they are); the benchmark prints the cut so that a table says so. Shapes too
large for a CPU in full carry a default cut (``layers``) and fewer routed experts (``experts``, top-k kept, so each
token's compute is the checkpoint's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: One Qwen3.5 / Qwen3-Next block: three gated delta net layers, then one gated attention layer.
_GDN_PATTERN = ["linear_attention"] * 3 + ["full_attention"]


@dataclass(frozen=True)
class Shape:
    """A model shape: the checkpoint it comes from and the config settings (on top of transformers' defaults)."""

    checkpoint: str
    config: dict
    layers: int | None = None  # default cut (first N layers), None = all
    notes: tuple[str, ...] = field(default=())


#: family (``config.model_type``) -> transformers config class name.
CONFIG_CLASSES = {
    "qwen3_5_text": "Qwen3_5TextConfig",
    "qwen3_next": "Qwen3NextConfig",
    "lfm2": "Lfm2Config",
    "falcon_h1": "FalconH1Config",
    "granitemoehybrid": "GraniteMoeHybridConfig",
    "jamba": "JambaConfig",
    "mamba": "MambaConfig",
    "mamba2": "Mamba2Config",
    "zamba2": "Zamba2Config",
}

#: What every ``small`` benchmark shape shares: hidden 512, 8 layers of which 2 hold attention (8 q / 2 kv heads of
#: 64), MLP 1024, a 32k vocabulary; a model of tens of MB whose costs a CPU measures in milliseconds.
_SMALL = dict(vocab_size=32768, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=65536)
_SMALL_NAME = "(benchmark shape: hidden 512, 8 layers, 2 with attention)"

SHAPES: dict[str, dict[str, Shape]] = {
    "qwen3_5_text": {
        # Qwen/Qwen3.5-0.8B (text config): 24 layers = 6 x (3 GDN + 1 gated attention), GDN 16 q/k and 16 v heads of
        # 128, attention 8 q / 2 kv heads of 256 with a quarter rotated, FFN 3584, tied embeddings.
        "0.8b": Shape(
            "Qwen/Qwen3.5-0.8B",
            dict(
                vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                layer_types=_GDN_PATTERN * 6, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=262144,
            ),
        ),
        # 2 x (3 GDN + 1 gated attention); GDN 4 q/k and 8 v heads of 64.
        "small": Shape(
            _SMALL_NAME,
            dict(_SMALL, layer_types=_GDN_PATTERN * 2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                 linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4),
        ),
        # Not a checkpoint: 110M parameters (hidden 768, 2 x (3 GDN + 1 gated attention), GDN 8 heads of 96, a 32k
        # vocabulary), the size a CPU trains a few GRPO steps of at 1,000-token prompts (benchmarks/grpo_rollouts.py).
        "100m": Shape(
            "(benchmark shape: hidden 768, 8 layers, 2 with attention, 110M parameters)",
            dict(
                vocab_size=32768, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                layer_types=_GDN_PATTERN * 2, num_attention_heads=8, num_key_value_heads=2, head_dim=96,
                linear_num_key_heads=8, linear_num_value_heads=8, linear_key_head_dim=96, linear_value_head_dim=96,
                linear_conv_kernel_dim=4, tie_word_embeddings=False, max_position_embeddings=65536,
            ),
        ),
        # Not a checkpoint: a few-MB model of the same layer pattern, for the benchmark's smoke test.
        "tiny": Shape(
            "(test shape)",
            dict(
                vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, layer_types=_GDN_PATTERN,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                max_position_embeddings=16384,
            ),
        ),
    },
    "qwen3_next": {
        # Qwen/Qwen3-Next-80B-A3B-Instruct: 48 layers = 12 x (3 GDN + 1 gated attention), GDN 16 q/k and 32 v heads
        # of 128, attention 16 q / 2 kv heads of 256, 512 routed experts (top 10) of 512 + a shared expert of 512.
        # Cut to 8 layers and 32 experts (top 10 kept): 80B parameters do not fit a CPU box.
        "80b-a3b": Shape(
            "Qwen/Qwen3-Next-80B-A3B-Instruct",
            dict(
                vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
                layer_types=_GDN_PATTERN * 12, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
                moe_intermediate_size=512, shared_expert_intermediate_size=512, tie_word_embeddings=False,
                max_position_embeddings=262144,
            ),
            layers=8,
            notes=("32 of 512 routed experts (top 10 kept)",),
        ),
    },
    "lfm2": {
        # LiquidAI/LFM2-350M: 16 layers, 10 short-conv (window 3) and 6 attention (16 q / 8 kv heads of 64), FFN
        # 6656 auto-adjusted to 4608, tied embeddings.
        "350m": Shape(
            "LiquidAI/LFM2-350M",
            dict(
                vocab_size=65536, hidden_size=1024, intermediate_size=6656, num_hidden_layers=16,
                layer_types=["conv", "conv", "full_attention"] * 3 + ["conv", "full_attention"] * 3 + ["conv"],
                num_attention_heads=16, num_key_value_heads=8, conv_L_cache=3, block_auto_adjust_ff_dim=True,
                block_ffn_dim_multiplier=1.0, block_multiple_of=256, tie_word_embeddings=True,
                max_position_embeddings=128000,
            ),
        ),
        # Short convs (window 3) on 6 layers, attention at 2 and 6.
        "small": Shape(
            _SMALL_NAME,
            dict(_SMALL, layer_types=["conv", "conv", "full_attention", "conv"] * 2, conv_L_cache=3,
                 block_auto_adjust_ff_dim=False),
        ),
    },
    "falcon_h1": {
        # tiiuae/Falcon-H1-0.5B-Base: 36 layers, each with attention (8 q / 2 kv heads of 64) and Mamba-2 (24 heads
        # of 64, d_ssm 1536, state 128, 1 group, chunks of 128) side by side, MLP 2048.
        "0.5b": Shape(
            "tiiuae/Falcon-H1-0.5B-Base",
            dict(
                vocab_size=32784, hidden_size=1024, intermediate_size=2048, num_hidden_layers=36,
                num_attention_heads=8, num_key_value_heads=2, head_dim=64, mamba_d_ssm=1536, mamba_n_heads=24,
                mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=128,
                mamba_rms_norm=False, mamba_norm_before_gate=False, max_position_embeddings=16384,
            ),
        ),
    },
    "granitemoehybrid": {
        # ibm-granite/granite-4.0-h-350m: 32 layers, 28 Mamba-2 (48 heads of 32, state 128, 1 group, chunks of 256)
        # and 4 attention at 10, 13, 17, 27 (12 q / 4 kv heads, no position embedding), dense MLP 2048.
        "h-350m": Shape(
            "ibm-granite/granite-4.0-h-350m",
            dict(
                vocab_size=100352, hidden_size=768, shared_intermediate_size=2048, intermediate_size=2048,
                num_local_experts=0, num_experts_per_tok=0, num_hidden_layers=32,
                layer_types=[
                    "attention" if i in (10, 13, 17, 27) else "mamba" for i in range(32)
                ],
                num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=48, mamba_d_head=32,
                mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
                position_embedding_type="nope", tie_word_embeddings=True, max_position_embeddings=32768,
            ),
        ),
    },
    "mamba": {
        # state-spaces/mamba-130m-hf: 24 Mamba-1 layers of hidden 768 (intermediate 1536), state 16, conv 4, dt rank
        # 48, a 50280-token vocabulary, tied embeddings; no attention and no MLP.
        "130m": Shape(
            "state-spaces/mamba-130m-hf",
            dict(vocab_size=50280, hidden_size=768, num_hidden_layers=24, state_size=16, expand=2, conv_kernel=4,
                 time_step_rank=48, tie_word_embeddings=True),
        ),
    },
    "mamba2": {
        # state-spaces/mamba2-130m: 24 Mamba-2 layers of hidden 768 (24 heads of 64, one group), state 128, conv 4,
        # chunks of 256, a 50288-token vocabulary, tied embeddings; no attention and no MLP.
        "130m": Shape(
            "state-spaces/mamba2-130m",
            dict(vocab_size=50288, hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64, state_size=128,
                 n_groups=1, expand=2, conv_kernel=4, chunk_size=256, tie_word_embeddings=True),
        ),
    },
    "jamba": {
        # ai21labs/Jamba-tiny-random: AI21's smallest public Jamba (a test checkpoint): 8 layers, attention at 2 and 6
        # (2 q / 1 kv heads), Mamba-1 (expand 2, state 16), 4 experts (top 2) of 14336 on every other layer.
        "tiny-random": Shape(
            "ai21labs/Jamba-tiny-random",
            dict(
                vocab_size=65536, hidden_size=128, intermediate_size=14336, num_hidden_layers=8, attn_layer_period=4,
                attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1, mamba_d_state=16,
                mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, tie_word_embeddings=False,
            ),
        ),
        # ai21labs/Jamba-v0.1 (52B): 32 layers = 4 x (7 Mamba-1 + 1 attention at offset 4), 16 experts (top 2) of
        # 14336 on every other layer. Cut to one 8-layer period with 2 experts (top 2 kept): ~12 GB in fp32.
        "v0.1": Shape(
            "ai21labs/Jamba-v0.1",
            dict(
                vocab_size=65536, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2, expert_layer_offset=1,
                num_experts=16, num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8,
                mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=256, tie_word_embeddings=False,
            ),
            layers=8,
            notes=("2 of 16 experts (top 2 kept)",),
        ),
        # Mamba-1 (expand 2, state 16) on 6 layers, attention at 2 and 6, dense MLPs.
        "small": Shape(
            _SMALL_NAME,
            dict(_SMALL, attn_layer_period=4, attn_layer_offset=2, num_experts=1, mamba_d_state=16, mamba_d_conv=4,
                 mamba_expand=2, mamba_dt_rank=32),
        ),
    },
    "zamba2": {
        # Mamba-2 (16 heads of 64, state 64, chunks of 256) on every layer, the shared attention block (8 heads of 128
        # over the doubled width) on 2 and 6.
        "small": Shape(
            _SMALL_NAME,
            dict(_SMALL, layers_block_type=["linear_attention"] * 2 + ["hybrid"] + ["linear_attention"] * 3
                 + ["hybrid", "linear_attention"], num_mem_blocks=1, use_shared_attention_adapter=False,
                 n_mamba_heads=16, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, chunk_size=256),
        ),
    },
}

#: Routed experts kept by shapes cut for a CPU (top-k unchanged).
_EXPERT_CUTS = {("qwen3_next", "80b-a3b"): 32, ("jamba", "v0.1"): 2}


def shape_config(family: str, shape: str, layers: int | None = None):
    """The transformers config of ``SHAPES[family][shape]``, cut to its first ``layers`` layers (default: the shape's
    own cut, else all), and a one-line description of it (checkpoint, cuts).

    Raises:
        ValueError: unknown family or shape, or ``layers`` outside ``1..num_hidden_layers``.
    """
    if family not in SHAPES or shape not in SHAPES[family]:
        known = "; ".join(f"{f}: {', '.join(s)}" for f, s in SHAPES.items())
        raise ValueError(f"No shape {shape!r} for family {family!r}; known shapes: {known}.")
    import transformers

    spec = SHAPES[family][shape]
    settings = dict(spec.config)
    total = settings["num_hidden_layers"]
    layers = layers or spec.layers or total
    if not 1 <= layers <= total:
        raise ValueError(f"--layers {layers}: {spec.checkpoint} has {total} layers; pass 1..{total}.")
    settings["num_hidden_layers"] = layers
    if "layer_types" in settings:
        settings["layer_types"] = settings["layer_types"][:layers]
    cuts = list(spec.notes)
    if (family, shape) in _EXPERT_CUTS:
        settings["num_experts"] = _EXPERT_CUTS[family, shape]
    if layers < total:
        cuts.insert(0, f"first {layers} of {total} layers (pattern kept)")
    description = spec.checkpoint + (f" [{'; '.join(cuts)}]" if cuts else "")
    return getattr(transformers, CONFIG_CLASSES[family])(**settings), description


def build_shape_model(family: str, shape: str, layers: int | None = None, seed: int = 0,
                      dtype: torch.dtype = torch.float32):
    """``(model, description)``: a random-init ``*ForCausalLM`` of the shape in eval mode (seeded)."""
    from transformers import AutoModelForCausalLM

    config, description = shape_config(family, shape, layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), description
