"""The hook points of deterministic mode's Granite-4.0-H / Nemotron-H / Inkling experts blocks and Falcon-H1 layers (issue 46):
what its copies of their forwards read (``models/moe_deterministic.py``, ``models/falcon_h1_deterministic.py``) and
the attention calls it routes; :mod:`.hook_points_models` lists them with the others.
"""

from __future__ import annotations

from .hook_checks import HookPoint, dotted, refers_to

_MOE = "hf_hybridcache.models.moe_deterministic (deterministic mode's routed experts)"
_FALCON = "hf_hybridcache.models.falcon_h1_deterministic (deterministic mode's Falcon-H1 mixer)"
_GRANITE = "transformers.models.granitemoehybrid.modeling_granitemoehybrid"
_NEMOTRON = "transformers.models.nemotron_h.modeling_nemotron_h"
_FALCON_H1 = "transformers.models.falcon_h1.modeling_falcon_h1"
_INKLING = "transformers.models.inkling.modeling_inkling"


def _point(target: str, names: tuple[str, ...], why: str) -> HookPoint:
    return HookPoint(f"{dotted(target)}[deterministic copy]", refers_to(target, *names), why)


def moe_and_falcon_h1_deterministic() -> list[HookPoint]:
    """Granite's, Nemotron-H's and Inkling's routers, experts and blocks; Falcon-H1's mixer, gated norm and attention."""
    return [
        _point(f"{_GRANITE}:GraniteMoeHybridTopKRouter.forward", ("weight", "topk", "top_k", "softmax"),
               f"{_MOE}: granite_moe_forward copies its router (top-k logits, softmax over the k chosen)"),
        _point(f"{_GRANITE}:GraniteMoeHybridExperts.forward", ("gate_up_proj", "down_proj", "act_fn", "chunk"),
               f"{_MOE}: its experts' gate-up and down products run through the row-invariant linear"),
        _point(f"{_GRANITE}:GraniteMoeHybridMoE.forward", ("router", "experts"),
               f"{_MOE}: granite_moe_forward stands in for it"),
        _point(f"{_NEMOTRON}:NemotronHTopkRouter.forward",
               ("weight", "sigmoid", "e_score_correction_bias", "num_group", "topk_group", "num_experts", "top_k",
                "norm_topk_prob", "routed_scaling_factor"),
               f"{_MOE}: nemotron_route copies its grouped sigmoid router"),
        _point(f"{_NEMOTRON}:NemotronHExperts.forward", ("up_proj", "down_proj", "act_fn"),
               f"{_MOE}: its experts' up and down products run through the row-invariant linear"),
        _point(f"{_NEMOTRON}:NemotronHMoE.forward", ("gate", "fc1_latent_proj", "experts", "fc2_latent_proj",
                                                      "shared_experts"),
               f"{_MOE}: nemotron_moe_forward stands in for it"),
        _point(f"{_INKLING}:InklingTopkRouter.forward",
               ("weight", "sigmoid", "e_score_correction_bias", "n_shared_experts", "top_k", "logsigmoid",
                "logsumexp", "route_scale", "global_scale"),
               f"{_MOE}: inkling_moe_forward copies its sigmoid router over routed and shared experts"),
        _point(f"{_INKLING}:InklingExperts.forward", ("gate_up_proj", "down_proj", "act_fn", "chunk"),
               f"{_MOE}: its experts' gate-up and down products run through the row-invariant linear"),
        _point(f"{_INKLING}:InklingSharedExperts.forward", ("gate_proj", "up_proj", "down_proj", "act_fn"),
               f"{_MOE}: inkling_moe_forward runs its shared experts one by one, weighted by their gammas"),
        _point(f"{_INKLING}:InklingMoE.forward", ("gate", "experts", "shared_experts"),
               f"{_MOE}: inkling_moe_forward stands in for it"),
        _point(f"{_FALCON_H1}:FalconH1Mixer.forward",
               ("ssm_in_multiplier", "in_proj", "mup_vector", "mamba_rms_norm", "norm", "out_proj"),
               f"{_FALCON}: the projection and gate hooks copy its multipliers and gate"),
        _point(f"{_FALCON_H1}:FalconH1RMSNormGated.forward",
               ("norm_before_gate", "n_groups", "variance_epsilon", "weight", "silu"),
               f"{_FALCON}: its gated norm runs through the invariant forms"),
        HookPoint(f"{dotted(_FALCON_H1 + ':FalconH1Attention.forward')}[attention interface]",
                  refers_to(f"{_FALCON_H1}:FalconH1Attention.forward", "ALL_ATTENTION_FUNCTIONS", "get_interface",
                            "scaling"),
                  "hf_hybridcache.models.hybrid_deterministic: its attention calls reach the routed function"),
    ]
