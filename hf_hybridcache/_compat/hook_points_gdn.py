"""The hook points of deterministic mode's OLMo-Hybrid and Lara Mini layers (issue 46): what its copies of their
forwards read (``models/gated_delta_deterministic.py``'s mixer forward, ``models/hybrid_deterministic.py``'s
``shared_moe_forward``), the classes it tells apart by name, and the attention calls it routes (Lara Mini's with their
sliding window); :mod:`.hook_points_models` lists them with the others.
"""

from __future__ import annotations

from .hook_checks import HookPoint, exists, refers_to

_DETERMINISTIC = "hf_hybridcache.models.hybrid_deterministic (deterministic mode's hybrid layers)"
_MIXER = "hf_hybridcache.models.gated_delta_deterministic: the mixer forward it copies op for op"
_OLMO = "transformers.models.olmo_hybrid.modeling_olmo_hybrid"
_LARA = "transformers.models.lara_mini.modeling_lara_mini"


def gdn_deterministic() -> list[HookPoint]:
    """OLMo-Hybrid's and Lara Mini's mixer, gated norm, attention and (Lara Mini's) experts."""
    return [
        HookPoint(f"{_OLMO}.OlmoHybridGatedDeltaNet.forward[deterministic copy]",
                  refers_to(f"{_OLMO}:OlmoHybridGatedDeltaNet.forward", "q_proj", "k_proj", "v_proj", "g_proj",
                            "b_proj", "a_proj", "allow_neg_eigval", "A_log", "dt_bias", "o_norm", "o_proj", "sigmoid",
                            "softplus"), _MIXER),
        HookPoint(f"{_OLMO}.OlmoHybridAttention.forward[attention interface]",
                  refers_to(f"{_OLMO}:OlmoHybridAttention.forward", "ALL_ATTENTION_FUNCTIONS", "get_interface",
                            "scaling"), f"{_DETERMINISTIC}: its attention calls reach the routed function"),
        HookPoint(f"{_LARA}.LaraMiniGatedDeltaNet.forward[deterministic copy]",
                  refers_to(f"{_LARA}:LaraMiniGatedDeltaNet.forward", "in_proj_qkv", "in_proj_z", "in_proj_b",
                            "in_proj_a", "A_log", "dt_bias", "norm", "out_proj", "sigmoid", "softplus"),
                  _MIXER, versions=">=5.24.0"),
        HookPoint(f"{_LARA}.LaraMiniRMSNormGated[float32 weight]",
                  refers_to(f"{_LARA}:LaraMiniRMSNormGated.forward", "weight", "float32", "rsqrt"),
                  "hf_hybridcache.models.gated_delta_deterministic: FLOAT32_WEIGHT_NORMS names it (its weight "
                  "applied before rounding)", versions=">=5.24.0"),
        HookPoint(f"{_LARA}.LaraMiniAttention.forward[attention interface]",
                  refers_to(f"{_LARA}:LaraMiniAttention.forward", "ALL_ATTENTION_FUNCTIONS", "get_interface",
                            "scaling", "sliding_window"),
                  f"{_DETERMINISTIC}: its attention calls, sliding window included, reach the routed function",
                  versions=">=5.24.0"),
        HookPoint(f"{_LARA}.LaraMiniSparseMoeBlock.forward[routed + ungated shared experts]",
                  refers_to(f"{_LARA}:LaraMiniSparseMoeBlock.forward", "gate", "experts", "shared_expert"),
                  f"{_DETERMINISTIC}: shared_moe_forward copies it (no shared_expert_gate)", versions=">=5.24.0"),
        HookPoint(f"{_LARA}.LaraMiniTopKRouter.forward[float32 router copy]",
                  refers_to(f"{_LARA}:LaraMiniTopKRouter.forward", "float", "softmax", "topk", "norm_topk_prob",
                            "weight"),
                  f"{_DETERMINISTIC}: shared_moe_forward copies it (FLOAT32_ROUTERS names it)", versions=">=5.24.0"),
        HookPoint(f"{_LARA}.LaraMiniSparseMoeBlock", exists(f"{_LARA}:LaraMiniSparseMoeBlock"),
                  f"{_DETERMINISTIC}: FAMILIES names it as Lara Mini's experts block", versions=">=5.24.0"),
    ]
