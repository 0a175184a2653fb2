"""The hook points of deterministic mode's ZAYA layers (issue 46): what its copy of the CCA projection's forward reads
(``models/zaya_deterministic.py``), the experts and router GELU it patches (``models/moe_deterministic.py``,
``models/hybrid_deterministic.py``) and the attention call it routes; :mod:`.hook_points_models` lists them with the
others.
"""

from __future__ import annotations

from .hook_checks import HookPoint, dotted, parameters, refers_to

_ZAYA = "transformers.models.zaya.modeling_zaya"
_USED_BY = "hf_hybridcache.models.zaya_deterministic (deterministic mode's ZAYA layers)"


def _point(target: str, names: tuple[str, ...], why: str) -> HookPoint:
    return HookPoint(f"{dotted(target)}[deterministic copy]", refers_to(target, *names), why)


def zaya_deterministic() -> list[HookPoint]:
    """ZAYA's CCA projection, experts, router MLP and attention call (transformers 5.23 - 5.25)."""
    return [
        _point(f"{_ZAYA}:ZayaCCAProjection.forward",
               ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "conv_qk_depthwise", "conv_qk_grouped",
                "conv_kernel_size", "num_key_value_groups", "head_dim", "get_conv_state", "get_recurrent_state",
                "update_conv_state", "update_recurrent_state", "mean"),
               f"{_USED_BY}: deterministic_forward copies it with its q|k conv through the invariant CCA conv"),
        _point(f"{_ZAYA}:ZayaExperts.forward", ("gate_up_proj", "down_proj", "act_fn", "num_experts"),
               "hf_hybridcache.models.moe_deterministic: zaya_experts_forward runs its experts through routed_sum"),
        HookPoint(f"{dotted(_ZAYA + ':ZayaExperts.forward')}[positional call]",
                  parameters(f"{_ZAYA}:ZayaExperts.forward", "hidden_states", "top_k_index", "top_k_weights",
                             leading=True),
                  "hf_hybridcache.models.moe_deterministic: zaya_experts_forward takes upstream's call as it is"),
        _point(f"{_ZAYA}:ZayaRouter.forward", ("router_mlp", "balancing_biases", "topk", "masked_fill"),
               "hf_hybridcache.models.moe_deterministic: the router runs as upstream, its skip expert masked to "
               "expert 0 with weight 0"),
        _point(f"{_ZAYA}:ZayaRouterMLP.forward", ("norm", "fc1", "fc2", "act_fn", "out_proj"),
               f"{_USED_BY}: gelu_forward stands in for its act_fn (nn.GELU)"),
        HookPoint(f"{dotted(_ZAYA + ':ZayaAttention.forward')}[attention interface]",
                  refers_to(f"{_ZAYA}:ZayaAttention.forward", "ALL_ATTENTION_FUNCTIONS", "get_interface",
                            "qkv_proj", "sliding_window"),
                  "hf_hybridcache.models.hybrid_deterministic: its attention calls reach the routed function with "
                  "the layer's window"),
    ]
