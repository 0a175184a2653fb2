"""The hook points of deterministic mode's KDA hybrids, Kimi Linear and Ling (issue 46): what its copies of their
forwards read (``models/kda_deterministic.py``: the KDA mixer, the forget gates, the sigmoid-gated output norm and
Ling's gated MLA attention; ``models/hybrid_deterministic.py``'s ``grouped_moe_forward``: the grouped sigmoid router
and the routed + shared experts) and the attention calls it routes; :mod:`.hook_points_models` lists them with the
others.
"""

from __future__ import annotations

from .hook_checks import HookPoint, exists, refers_to

_KDA = "hf_hybridcache.models.kda_deterministic (deterministic mode's KDA mixer and Ling's attention)"
_HYBRID = "hf_hybridcache.models.hybrid_deterministic (deterministic mode's hybrid layers)"
#: modeling module -> (class prefix, the mixer's forget-gate and output-gate projections).
_FAMILIES = {"kimi_linear": ("KimiLinear", ("f_a_proj", "f_b_proj"), ("g_a_proj", "g_b_proj")),
             "bailing_hybrid": ("BailingHybrid", ("f_proj", "safe_gate", "lower_bound"), ("g_proj",))}


def kda_deterministic() -> list[HookPoint]:
    """Kimi Linear's and Ling's KDA mixer, forget gate, output norm, MLA attention and experts block forwards."""
    points = []
    for module, (prefix, forget, output) in _FAMILIES.items():
        path = f"transformers.models.{module}.modeling_{module}"
        points += [
            HookPoint(f"{path}.{prefix}DeltaAttention.forward[deterministic copy]",
                      refers_to(f"{path}:{prefix}DeltaAttention.forward", "q_proj", "k_proj", "v_proj",
                                "forget_gate", "b_proj", "sigmoid", "o_norm", "o_proj", *output),
                      f"{_KDA}: the mixer forward it copies op for op"),
            HookPoint(f"{path}.{prefix}ForgetGate.forward[deterministic copy]",
                      refers_to(f"{path}:{prefix}ForgetGate.forward", "A_log", "dt_bias", "exp", *forget),
                      f"{_KDA}: _forget_gate copies it with the sigmoid / softplus from exp"),
            HookPoint(f"{path}.{prefix}RMSNormGated.forward[deterministic copy]",
                      refers_to(f"{path}:{prefix}RMSNormGated.forward", "weight", "variance_epsilon", "activation"),
                      f"{_KDA}: sigmoid_gated_rms_norm_invariant copies it with the sigmoid from exp"),
            HookPoint(f"{path}.{prefix}MoE.forward[routed + shared experts]",
                      refers_to(f"{path}:{prefix}MoE.forward", "gate", "experts", "shared_experts"),
                      f"{_HYBRID}: grouped_moe_forward copies it"),
            HookPoint(f"{path}.{prefix}TopkRouter.forward[grouped sigmoid router copy]",
                      refers_to(f"{path}:{prefix}TopkRouter.forward", "sigmoid", "e_score_correction_bias", "topk",
                                "num_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "top_k"),
                      f"{_HYBRID}: grouped_moe_forward copies its router with the sigmoid from exp"),
        ]
    path = "transformers.models.kimi_linear.modeling_kimi_linear"
    points.append(HookPoint(f"{path}.KimiLinearAttention.forward[attention interface]",
                            refers_to(f"{path}:KimiLinearAttention.forward", "ALL_ATTENTION_FUNCTIONS",
                                      "get_interface", "expand_kv", "scaling"),
                            f"{_HYBRID}: its attention calls (the expanded MLA keys) reach the routed function"))
    path = "transformers.models.bailing_hybrid.modeling_bailing_hybrid"
    points += [
        HookPoint(f"{path}.BailingHybridAttention.forward[gated MLA copy]",
                  refers_to(f"{path}:BailingHybridAttention.forward", "apply_rotary_pos_emb_interleave",
                            "get_interface", "kv_a_proj_with_mqa", "kv_a_layernorm", "expand_kv", "g_proj", "sigmoid",
                            "o_proj", "scaling"),
                  f"{_KDA}: gated_mla_forward copies it with the head gate from exp"),
        HookPoint(f"{path}.apply_rotary_pos_emb_interleave", exists(f"{path}:apply_rotary_pos_emb_interleave"),
                  f"{_KDA}: gated_mla_forward rotates the rope query and key with it (through "
                  "invariant_attention.gated_attention_parts)"),
        HookPoint(f"{path}.BailingHybridExperts._apply_gate[clipped SwiGLU]",
                  refers_to(f"{path}:BailingHybridExperts._apply_gate", "act_fn", "limit", "clamp"),
                  f"{_HYBRID}: _routed_sum clips the experts' SwiGLU by experts.limit", versions=">=5.25.0"),
    ]
    return points
