"""The hook points of deterministic mode's Inkling 2 layers (issue 46): what ``models/inkling2_deterministic.py``'s
forwards and ``models/moe_deterministic.py``'s ``inkling2_moe_forward`` read of
``transformers/models/inkling2/modeling_inkling2.py`` (5.23 - 5.25; the attention's parts sit in projection modules
from 5.24 on, inline in 5.23); :mod:`.hook_points_models` lists them with the others.
"""

from __future__ import annotations

from .hook_checks import HookPoint, dotted, parameters, refers_to

_PATH = "transformers.models.inkling2.modeling_inkling2"
_USED_BY = "hf_hybridcache.models.inkling2_deterministic (deterministic mode's Inkling 2 layers)"
_MOE = "hf_hybridcache.models.moe_deterministic: inkling2_moe_forward"


def _point(name: str, names: tuple[str, ...], why: str, versions: str = "", tag: str = "deterministic copy"
           ) -> HookPoint:
    target = f"{_PATH}:{name}"
    return HookPoint(f"{dotted(target)}[{tag}]", refers_to(target, *names), why, versions)


def inkling2_deterministic() -> list[HookPoint]:
    """Inkling 2's short convs, clips, relative bias, output gate, softcaps, block residuals and experts block."""
    return [
        _point("Inkling2ShortConvolution.forward", ("conv1d", "conv_idx", "conv_kernel_size", "sqrt"),
               f"{_USED_BY}: deterministic_forward copies it (float32, residual, scaled by 1 / sqrt(W + 1))"),
        _point("Inkling2DynamicShortConvolution.forward",
               ("weight_proj", "static_weight", "num_heads", "conv_kernel_size", "conv_idx", "sqrt"),
               f"{_USED_BY}: deterministic_forward copies it with the invariant dynamic conv"),
        HookPoint(f"{_PATH}.Inkling2DynamicShortConvolution.forward[tap input second]",
                  parameters(f"{_PATH}:Inkling2DynamicShortConvolution.forward", "hidden_states", "dynamic_input",
                             leading=True),
                  "hf_hybridcache._compat.layers.dynamic_conv_input: the tap input is its second argument"),
        _point("Inkling2L2Clip.forward", ("threshold", "vector_norm"), f"{_USED_BY}: l2_clip_forward"),
        _point("Inkling2ScaledL2Clip.forward", ("threshold", "scale", "vector_norm"), f"{_USED_BY}: l2_clip_forward"),
        _point("Inkling2RelativePositionBias.forward", ("linear", "num_heads", "norm", "proj", "rel_extent", "gather"),
               f"{_USED_BY}: relative_bias_forward copies it with the row-invariant product", ">=5.24.0"),
        _point("Inkling2GatedOutputProjection.forward", ("gate_proj", "sigmoid", "linear"),
               f"{_USED_BY}: gated_output_forward copies it with the invariant sigmoid", ">=5.24.0"),
        _point("Inkling2SlidingAttention.forward", ("ALL_ATTENTION_FUNCTIONS", "sink_proj", "relative_position_bias", "o_proj"),
               f"{_USED_BY}: from 5.24 on it runs as upstream, its parts patched", ">=5.24.0", "parts patched"),
        _point("Inkling2FullAttention.forward", ("ALL_ATTENTION_FUNCTIONS", "sink_proj", "relative_position_bias", "o_proj"),
               f"{_USED_BY}: from 5.24 on it runs as upstream, its parts patched", ">=5.24.0", "parts patched"),
        _point("Inkling2RelativeLogits.forward", ("proj", "rel_extent", "gather"),
               f"{_USED_BY}: relative_logits_forward copies it with the row-invariant product", "<5.24.0"),
        _point("Inkling2FullAttention.forward",
               ("q_proj", "k_proj", "v_proj", "r_proj", "gate_proj", "sink_proj", "k_sconv", "v_sconv", "q_l2_clip",
                "k_l2_clip", "rel_l2_clip", "v_norm", "rel_logits_proj", "get_mask_sizes", "get_query_offset",
                "log_scaling_alpha", "log_scaling_n_floor", "sliding_window", "scaling", "sigmoid", "o_proj"),
               f"{_USED_BY}: _fused_attention_forward copies it (5.23's layout) with the invariant gate", "<5.24.0"),
        _point("Inkling2SlidingAttention.forward",
               ("q_proj", "k_proj", "v_proj", "r_proj", "gate_proj", "sink_proj", "k_sconv", "v_sconv", "q_l2_clip",
                "k_l2_clip", "rel_l2_clip", "v_norm", "rel_logits_proj", "sigmoid", "o_proj"),
               f"{_USED_BY}: _fused_attention_forward copies it (5.23's layout) with the invariant gate", "<5.24.0"),
        _point("Inkling2Softcap.forward", ("softcap", "tanh"), f"{_USED_BY}: softcap_forward"),
        _point("Inkling2SoftcappedSwiGLU.forward", ("gate_softcap", "up_softcap", "sigmoid"),
               f"{_USED_BY}: swiglu_forward"),
        _point("Inkling2BlockAttentionResidual.forward", ("norm", "query"),
               f"{_USED_BY}: block_residual_forward copies it with the invariant block residual"),
        _point("Inkling2TopKRouter.forward",
               ("weight", "score_fn", "e_score_correction_bias", "top_k", "routed_scaling_factor"),
               f"{_MOE} copies its sigmoid router"),
        _point("Inkling2Experts.forward", ("gate_up_proj", "down_proj", "_apply_gate"),
               f"{_MOE} runs its experts through the row-invariant linear"),
        _point("Inkling2SparseMoeBlock.forward", ("gate", "experts"), f"{_MOE} stands in for it"),
        *_loop(),
    ]


def _loop() -> list[HookPoint]:
    """Inkling 2 Loop's copies of the same modules (5.24 on) and its message gate and message residual."""
    path = "transformers.models.inkling2_loop.modeling_inkling2_loop"
    reads = {"ShortConvolution": ("conv1d", "conv_idx", "conv_kernel_size", "sqrt"),
             "DynamicShortConvolution": ("weight_proj", "static_weight", "num_heads", "conv_kernel_size", "sqrt"),
             "L2Clip": ("threshold", "vector_norm"), "ScaledL2Clip": ("threshold", "scale", "vector_norm"),
             "RelativePositionBias": ("linear", "num_heads", "norm", "proj", "rel_extent", "gather"),
             "GatedOutputProjection": ("gate_proj", "sigmoid", "linear"), "Softcap": ("softcap", "tanh"),
             "SoftcappedSwiGLU": ("gate_softcap", "up_softcap", "sigmoid"), "BlockAttentionResidual": ("norm", "query"),
             "MessageGate": ("norm", "down_proj", "forget_gate_proj", "message_gate_proj", "tanh"),
             "MessageAttentionResidual": ("norm", "query"),
             "TopKRouter": ("weight", "score_fn", "e_score_correction_bias", "top_k", "routed_scaling_factor"),
             "Experts": ("gate_up_proj", "down_proj", "_apply_gate"), "SparseMoeBlock": ("gate", "experts")}
    return [HookPoint(f"{path}.Inkling2Loop{name}.forward[deterministic copy]",
                      refers_to(f"{path}:Inkling2Loop{name}.forward", *names),
                      f"{_USED_BY}: its Inkling 2 form stands in for it (Inkling 2 Loop)", ">=5.24.0")
            for name, names in reads.items()]
