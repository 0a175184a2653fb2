"""The hook points of deterministic mode's LFM2 / LFM2-MoE / LFM3 and Inkling layers (issue 46): what its copies of
their forwards read (``models/short_conv_deterministic.py`` with LFM3's ``head_gated_forward``,
``models/hybrid_deterministic.py``'s ``swiglu_forward`` and ``sigmoid_moe_forward``, ``models/inkling_deterministic.py``)
and the attention calls it routes; :mod:`.hook_points_models` lists them with the others.
"""

from __future__ import annotations

from .hook_checks import HookPoint, exists, parameters, refers_to

_DETERMINISTIC = "hf_hybridcache.models.hybrid_deterministic (deterministic mode's hybrid layers)"


def short_conv_deterministic() -> list[HookPoint]:
    """LFM2's, LFM2-MoE's and LFM3's mixer, MLP and attention forwards, LFM2-MoE's router, LFM3's head gate."""
    points = []
    for module, prefix in (("lfm2", "Lfm2"), ("lfm2_moe", "Lfm2Moe"), ("lfm3", "Lfm3")):
        path = f"transformers.models.{module}.modeling_{module}"
        points += [HookPoint(f"{path}.{prefix}ShortConv.forward[deterministic copy]",
                             refers_to(f"{path}:{prefix}ShortConv.forward", "in_proj", "chunk", "conv", "out_proj"),
                             "hf_hybridcache.models.short_conv_deterministic: the mixer forward it copies op for op"),
                   HookPoint(f"{path}.{prefix}MLP.forward[SwiGLU copy]",
                             refers_to(f"{path}:{prefix}MLP.forward", "w1", "w2", "w3", "silu"),
                             f"{_DETERMINISTIC}: swiglu_forward copies it with the invariant SiLU"),
                   HookPoint(f"{path}.{prefix}Attention.forward[attention interface]",
                             refers_to(f"{path}:{prefix}Attention.forward", "ALL_ATTENTION_FUNCTIONS", "get_interface",
                                       "scaling"),
                             f"{_DETERMINISTIC}: its attention calls reach the routed function")]
    path = "transformers.models.lfm2_moe.modeling_lfm2_moe"
    points.append(HookPoint(f"{path}.Lfm2MoeSparseMoeBlock.forward[sigmoid router copy]",
                            refers_to(f"{path}:Lfm2MoeTopKRouter.forward", "sigmoid", "topk", "gather",
                                      "norm_topk_prob", "routed_scaling_factor", "use_expert_bias"),
                            f"{_DETERMINISTIC}: sigmoid_moe_forward copies its router (and reads expert_bias)"))
    path = "transformers.models.lfm3.modeling_lfm3"
    points.append(HookPoint(f"{path}.Lfm3Attention.forward[head-gated copy]",
                            refers_to(f"{path}:Lfm3Attention.forward", "q_proj", "k_proj", "v_proj", "q_norm",
                                      "k_norm", "apply_rotary_pos_emb", "sliding_window", "g_proj", "sigmoid",
                                      "o_proj"),
                            "hf_hybridcache.models.short_conv_deterministic: head_gated_forward copies it with the "
                            "invariant sigmoid"))
    return points + _inkling()


def _inkling() -> list[HookPoint]:
    """Inkling's short convolution, attention and relative logits, as ``models/inkling_deterministic.py`` copies
    them (transformers 5.23 - 5.25)."""
    path = "transformers.models.inkling.modeling_inkling"
    used_by = "hf_hybridcache.models.inkling_deterministic"
    return [HookPoint(f"{path}.InklingShortConvolution.forward[deterministic copy]",
                      parameters(f"{path}:InklingShortConvolution.forward", "hidden_states", "conv_mask"),
                      f"{used_by}: deterministic_forward copies it (float32, padding zeroed by conv_mask, residual)"),
            HookPoint(f"{path}.InklingAttention.forward[deterministic copy]",
                      refers_to(f"{path}:InklingAttention.forward", "q_proj", "k_proj", "v_proj", "r_proj",
                                "k_sconv", "v_sconv", "q_norm", "k_norm", "get_mask_sizes", "get_query_offset",
                                "rel_logits_proj", "log_scaling_n_floor", "log_scaling_alpha", "is_sliding",
                                "sliding_window", "scaling", "ALL_ATTENTION_FUNCTIONS", "o_proj"),
                      f"{used_by}: attention_forward copies it op for op"),
            HookPoint(f"{path}.InklingRelativeLogits.forward[positional call]",
                      parameters(f"{path}:InklingRelativeLogits.forward", "relative_states", "query_positions",
                                 "key_positions", leading=True),
                      f"{used_by}: attention_forward calls it with the relative states and positions"),
            HookPoint(f"{path}.InklingMoE", exists(f"{path}:InklingMoE"),
                      "hf_hybridcache.models.hybrid_deterministic: an Inkling holding one is refused by its name")]
