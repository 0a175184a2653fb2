"""The hook points in each family's modeling module: the mixer and attention classes :mod:`hf_hybridcache.models`
patches or reads by class name, the module-level kernels it rebinds (with the parameters their routers bind by
position or name), the functions and classes it mirrors, the names under which transformers logs the "falling back"
notices of the kernels the package's scans stand in for, and the vision-language wrappers' inputs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from .hook_checks import HookPoint, dotted, exists, fields, named_parameters, parameters, refers_to, resolve
from .hook_points_gdn import gdn_deterministic
from .hook_points_inkling2 import inkling2_deterministic
from .hook_points_kda import kda_deterministic
from .hook_points_moe import moe_and_falcon_h1_deterministic
from .hook_points_short_conv import short_conv_deterministic
from .hook_points_zaya import zaya_deterministic

_CACHE_NAMES = ("past_key_values", "cache", "cache_params")

#: Rebound kernel -> (the parameters its router binds, in order, as the first ones; the package module routing it).
ROUTED: dict[str, tuple[tuple[str, ...], str]] = {
    "causal_conv1d_update": (("hidden_states", "conv_state", "weight", "bias", "activation"),
                             "hf_hybridcache.models.fused_decode (the fused fp32 decode step)"),
    "torch_recurrent_gated_delta_rule": (("query", "key", "value", "g", "beta", "initial_state", "output_final_state",
                                          "use_qk_l2norm_in_kernel"),
                                         "hf_hybridcache.models.fused_decode (the fused fp32 decode step)"),
    "mamba2_selective_state_update": (("state", "hidden_states", "dt", "A", "B", "C", "D", "dt_bias", "dt_softplus",
                                       "z"), "hf_hybridcache.models.fused_decode (the fused fp32 decode step)"),
    "torch_chunk_gated_delta_rule": (("query", "key", "value", "g", "beta"),
                                     "hf_hybridcache.models.linear_attention (route_recurrence: the recurrent states "
                                     "at block boundaries)"),
    "chunk_kimi_delta_attention": (("query", "key", "value", "g", "beta"),
                                   "hf_hybridcache.models.linear_attention (route_recurrence: the recurrent states at "
                                   "block boundaries)"),
}
#: What a routed chunked recurrence must take by keyword (the router passes each piece's state through them).
_CHUNK_KEYWORDS = ("initial_state", "output_final_state")


@dataclass(frozen=True)
class Family:
    """A modeling module (``transformers.models.<name>.modeling_<name>``) and what the package relies on in it.

    Attributes:
        name: the module's folder under ``transformers/models``.
        models: the package module that relies on it.
        mixers: the classes patched by name (their forward takes ``hidden_states`` and a cache).
        attention: the classes read by name (their KV is the cache layer of the same index).
        routed: module-level kernels rebound (keys of :data:`ROUTED`).
        mirrored: module-level functions and classes the package's code copies (``kernels/``, ``models/``).
        notices: the kernel names of transformers' "falling back" notices the package drops for this family.
        versions: the transformers versions that have the module ("" for all).
    """

    name: str
    models: str
    mixers: tuple[str, ...] = ()
    attention: tuple[str, ...] = ()
    routed: tuple[str, ...] = ()
    mirrored: tuple[str, ...] = ()
    notices: tuple[str, ...] = ()
    versions: str = ""

    @property
    def module(self) -> str:
        return f"transformers.models.{self.name}.modeling_{self.name}"

    def hook_points(self) -> list[HookPoint]:
        module, used = self.module, f"hf_hybridcache.models.{self.models}"
        points = [HookPoint(f"{module}.{mixer}", _mixer_call(f"{module}:{mixer}.forward"),
                            f"{used} (patches its instances by class name)", self.versions) for mixer in self.mixers]
        points += [HookPoint(f"{module}.{name}", exists(f"{module}:{name}"),
                             f"{used} (finds the attention layers by class name)", self.versions)
                   for name in self.attention]
        for name in self.routed:
            leading, router = ROUTED[name]
            keywords = _CHUNK_KEYWORDS if name not in ("causal_conv1d_update", "mamba2_selective_state_update") else ()
            points.append(HookPoint(f"{module}.{name}", _routed(f"{module}:{name}", leading, keywords),
                                    f"{router}; rebound in this module", self.versions))
        points += [HookPoint(f"{module}.{name}", exists(f"{module}:{name}"), f"{used} (mirrors it)", self.versions)
                   for name in self.mirrored]
        points += [HookPoint(f"{module}[notice {name}]", _wraps_kernel(module, name),
                             "hf_hybridcache._compat.kernel_notices (drops this notice where the package's scan runs)",
                             self.versions) for name in self.notices]
        return points


def _mixer_call(target: str):
    """The mixer's forward takes ``(hidden_states, <cache>, ...)``, the cache under one of :data:`_CACHE_NAMES`
    (:func:`~hf_hybridcache._compat.cache_kwargs.split_mixer_call`)."""

    def mixer_call():
        found = named_parameters(resolve(target))
        if found[:1] != ["hidden_states"]:
            return f"takes ({', '.join(found)}), not (hidden_states, ...)"
        if not any(name in found for name in _CACHE_NAMES):
            return f"takes no cache under {' / '.join(_CACHE_NAMES)} (it takes {', '.join(found)})"
        return None

    return mixer_call


def _wraps_kernel(module: str, name: str):
    """``module`` wraps a kernel under ``name`` (``@use_kernel_func_from_hub_with_fallback("<name>", ...)``), the name
    its "falling back" notice starts with."""

    def wraps_kernel():
        source = "".join(inspect.getsource(resolve(module)).split())
        return None if f'use_kernel_func_from_hub_with_fallback("{name}"' in source else f"wraps no kernel as {name!r}"

    return wraps_kernel


def _routed(target: str, leading: tuple[str, ...], keywords: tuple[str, ...]):
    first, named = parameters(target, *leading, leading=True), parameters(target, *keywords)

    def routed():
        return first() or named()

    return routed


_MAMBA1 = dict(mirrored=("causal_conv1d_fn", "causal_conv1d_update", "mamba_selective_state_update",
                         "mamba_selective_scan"), notices=("selective_scan_fn", "causal_conv1d_fn"))
_MAMBA2 = dict(routed=("causal_conv1d_update", "mamba2_selective_state_update"),
               mirrored=("causal_conv1d_fn", "mamba2_chunk_scan"),
               notices=("mamba_chunk_scan_combined", "causal_conv1d_fn"))
_GDN = dict(routed=("torch_chunk_gated_delta_rule", "causal_conv1d_update", "torch_recurrent_gated_delta_rule"))
_KDA = dict(routed=("chunk_kimi_delta_attention",), mirrored=("recurrent_kimi_delta_attention",))

FAMILIES = (
    Family("jamba", "jamba", ("JambaMambaMixer",), **_MAMBA1),
    Family("zamba", "zamba", ("ZambaMambaMixer",), **_MAMBA1),
    Family("zamba2", "zamba2", ("Zamba2MambaMixer",), ("Zamba2Attention",), **_MAMBA2),
    Family("falcon_h1", "falcon_h1", ("FalconH1Mixer",), ("FalconH1Attention",), **_MAMBA2),
    Family("bamba", "bamba", ("BambaMixer",), ("BambaAttention",), **_MAMBA2),
    Family("granitemoehybrid", "granitemoehybrid", ("GraniteMoeHybridMambaLayer",), ("GraniteMoeHybridAttention",),
           **_MAMBA2),
    Family("nemotron_h", "nemotron_h", ("NemotronHMamba2Mixer",), ("NemotronHAttention",), **_MAMBA2),
    Family("qwen3_next", "qwen3_next", ("Qwen3NextGatedDeltaNet",), ("Qwen3NextAttention",), **_GDN),
    Family("qwen3_5", "qwen3_5", ("Qwen3_5GatedDeltaNet",), ("Qwen3_5Attention",), **_GDN),
    Family("qwen3_5_moe", "qwen3_5", ("Qwen3_5MoeGatedDeltaNet",), ("Qwen3_5MoeAttention",), **_GDN),
    Family("olmo_hybrid", "olmo_hybrid", ("OlmoHybridGatedDeltaNet",), ("OlmoHybridAttention",), **_GDN),
    Family("kimi_linear", "kimi_delta", ("KimiLinearDeltaAttention",), ("KimiLinearAttention",), **_KDA),
    Family("bailing_hybrid", "kimi_delta", ("BailingHybridDeltaAttention",), ("BailingHybridAttention",), **_KDA),
    Family("lfm2", "short_conv", ("Lfm2ShortConv",), ("Lfm2Attention",), ("causal_conv1d_update",)),
    Family("lfm2_moe", "short_conv", ("Lfm2MoeShortConv",), ("Lfm2MoeAttention",), ("causal_conv1d_update",)),
    Family("lfm3", "short_conv", ("Lfm3ShortConv",), ("Lfm3Attention",), ("causal_conv1d_update",)),
    Family("inkling", "inkling", ("InklingShortConvolution",), ("InklingAttention",)),
    Family("inkling2", "inkling", ("Inkling2ShortConvolution", "Inkling2DynamicShortConvolution"),
           ("Inkling2SlidingAttention", "Inkling2FullAttention")),
    Family("inkling2_loop", "inkling", ("Inkling2LoopShortConvolution", "Inkling2LoopDynamicShortConvolution"),
           ("Inkling2LoopSlidingAttention", "Inkling2LoopFullAttention"), versions=">=5.24.0"),
    Family("zaya", "zaya", ("ZayaCCAProjection",)),
    Family("lara_mini", "lara_mini", ("LaraMiniGatedDeltaNet",), ("LaraMiniAttention",), **_GDN, versions=">=5.24.0"),
    Family("mamba", "mamba", ("MambaMixer",), **_MAMBA1),
    Family("falcon_mamba", "mamba", ("FalconMambaMixer",), **_MAMBA1),
    Family("mamba2", "mamba", ("Mamba2Mixer",), **_MAMBA2),
)

#: Vision-language wrappers served with images: (modeling module folder, the class whose forward takes
#: ``mm_encoder_outputs``, versions).
_WRAPPERS = (("qwen3_5", "Qwen3_5Model", ""), ("qwen3_5_moe", "Qwen3_5MoeModel", ""), ("lfm2_vl", "Lfm2VlModel", ""),
             ("lfm3_vl", "Lfm3VlModel", ""), ("nemotron_h_omni", "NemotronH_Omni_Reasoning_V3", ""),
             ("inkling", "InklingModel", ""), ("inkling2", "Inkling2Model", ""),
             ("inkling2_loop", "Inkling2LoopModel", ">=5.24.0"))


def _wrappers() -> list[HookPoint]:
    points = []
    for name, cls, versions in _WRAPPERS:
        target = f"transformers.models.{name}.modeling_{name}:{cls}"
        points.append(HookPoint(f"{target.replace(':', '.')}.forward[mm_encoder_outputs]",
                                parameters(f"{target}.forward", "mm_encoder_outputs"),
                                "hf_hybridcache.generate.images, hf_hybridcache.engine.images (the image features "
                                "of the uncached tail only)", versions))
    for name, cls in (("qwen3_5", "Qwen3_5Model"), ("qwen3_5_moe", "Qwen3_5MoeModel")):
        target = f"transformers.models.{name}.modeling_{name}:{cls}"
        points.append(HookPoint(f"{target.replace(':', '.')}.get_rope_index",
                                parameters(f"{target}.get_rope_index", "input_ids", "mm_token_type_ids",
                                           "image_grid_thw", "video_grid_thw", leading=True),
                                "hf_hybridcache._compat.multimodal (the engine's 3D rotary positions of a prompt)"))
    for name, cls in (("mamba", "MambaForCausalLM"), ("falcon_mamba", "FalconMambaForCausalLM"),
                      ("mamba2", "Mamba2ForCausalLM")):
        target = f"transformers.models.{name}.modeling_{name}:{cls}.forward"
        points.append(HookPoint(f"{target.replace(':', '.')}[cache_params]", parameters(target, "cache_params"),
                                "hf_hybridcache._compat.cache_kwargs.cache_kwarg (5.23's pure state-space models take "
                                "the cache as cache_params only: generate() and forward() hand it over so)", "<5.24.0"))
    experts = "transformers.models.jamba.modeling_jamba:JambaExperts.forward.__wrapped__"
    points.append(HookPoint(experts.replace(":", "."), parameters(experts, "hidden_states", "top_k_index",
                                                                  "top_k_weights", leading=True),
                            "hf_hybridcache.models.decode_linear (batches the decode step's experts where a model's "
                            "eager experts loop is this one, compared by source)"))
    sliding = "transformers.models.inkling2.modeling_inkling2:Inkling2SlidingAttention.forward"
    points.append(HookPoint(f"{sliding.replace(':', '.')}[relative_distance]", parameters(sliding, "relative_distance"),
                            "hf_hybridcache._compat.continuous_batching.group_argument (a group's own relative "
                            "distances)", ">=5.24.0"))
    loop_config = "transformers.models.inkling2_loop.configuration_inkling2_loop:Inkling2LoopTextConfig"
    points.append(HookPoint(f"{loop_config.replace(':', '.')}[loop fields]",
                            fields(lambda: resolve(loop_config)(),
                                   ("loop_layer_index_start", "loop_layer_index_end", "loop_num_passes")),
                            "hf_hybridcache._compat.layers.loop_cache_layers (the loop passes' cache layers)",
                            ">=5.24.0"))
    short_conv = "transformers.models.inkling2_loop.modeling_inkling2_loop:Inkling2LoopShortConvolution.forward"
    points.append(HookPoint(f"{short_conv.replace(':', '.')}[cache_offset]", parameters(short_conv, "cache_offset"),
                            "hf_hybridcache._compat.layers.cache_layer_offset (a loop pass's own cache layer)",
                            ">=5.24.0"))
    return points


#: The families whose MTP head :mod:`.mtp` builds: (modeling module folder, decoder layer, norm, rotary, causal LM).
_MTP = (("qwen3_5", "Qwen3_5DecoderLayer", "Qwen3_5RMSNorm", "Qwen3_5TextRotaryEmbedding", "Qwen3_5ForCausalLM"),
        ("qwen3_5_moe", "Qwen3_5MoeDecoderLayer", "Qwen3_5MoeRMSNorm", "Qwen3_5MoeTextRotaryEmbedding",
         "Qwen3_5MoeForCausalLM"),
        ("qwen3_next", "Qwen3NextDecoderLayer", "Qwen3NextRMSNorm", "Qwen3NextRotaryEmbedding", "Qwen3NextForCausalLM"))


def _mtp() -> list[HookPoint]:
    """What :mod:`.mtp` builds the MTP heads from, and why it reads ``mtp.*`` itself."""
    used, points = "hf_hybridcache._compat.mtp.MTPHead", []
    for folder, layer_class, norm, rotary, causal_lm in _MTP:
        module = f"transformers.models.{folder}.modeling_{folder}"
        layer = f"{module}:{layer_class}"
        points += [HookPoint(f"{dotted(layer)}.__init__", parameters(f"{layer}.__init__", "config", "layer_idx",
                                                                     leading=True), f"{used} (its decoder layer)"),
                   HookPoint(f"{dotted(layer)}.forward", parameters(f"{layer}.forward", "hidden_states",
                                                                    "position_embeddings", "attention_mask",
                                                                    "position_ids", leading=True),
                             f"{used} (calls it)")]
        points += [HookPoint(f"{module}.{name}", exists(f"{module}:{name}"), f"{used} (its norms and rotary positions)")
                   for name in (norm, rotary)]
        ignored = f"{module}:{causal_lm}"
        points.append(HookPoint(f"{dotted(ignored)}._keys_to_ignore_on_load_unexpected[mtp]", _drops_mtp(ignored),
                                "hf_hybridcache.engine.mtp (reads mtp.* itself)"))
    points.append(HookPoint("transformers.modeling_utils.PreTrainedModel.get_decoder",
                            exists("transformers.modeling_utils:PreTrainedModel.get_decoder"),
                            "hf_hybridcache._compat.mtp.final_hidden_states (hooks the decoder's output)"))
    return points


def _drops_mtp(target: str):
    def check():
        ignored = resolve(target)._keys_to_ignore_on_load_unexpected or []
        return None if any(pattern.lstrip("^").startswith("mtp") for pattern in ignored) else "keeps mtp.* at load"

    return check


_JAMBA = "transformers.models.jamba.modeling_jamba"
_DETERMINISTIC = "hf_hybridcache.models.hybrid_deterministic (deterministic mode's hybrid layers)"


def _deterministic() -> list[HookPoint]:
    return [
        HookPoint(f"{_JAMBA}.JambaAttention.forward[attention interface]",
                  refers_to(f"{_JAMBA}:JambaAttention.forward", "ALL_ATTENTION_FUNCTIONS", "get_interface", "scaling"),
                  f"{_DETERMINISTIC}: its attention calls reach the routed function, which answers them with the "
                  "invariant attention"),
        HookPoint(f"{_JAMBA}.JambaSparseMoeBlock[router, experts]", _expert_block_fields,
                  f"{_DETERMINISTIC}: sparse_moe_forward reads the router's weight and top_k and the experts' "
                  "[E, 2I, H] gate-up and [E, H, I] down weights and act_fn"),
        HookPoint("transformers.models.zamba.modeling_zamba.ZambaAttention.forward[attention interface]",
                  refers_to("transformers.models.zamba.modeling_zamba:ZambaAttention.forward",
                            "ALL_ATTENTION_FUNCTIONS", "get_interface", "scaling"),
                  f"{_DETERMINISTIC}: Zamba's shared attention calls reach the routed function"),
        HookPoint("transformers.activations.SiLUActivation", exists("transformers.activations:SiLUActivation"),
                  f"{_DETERMINISTIC}: the MLPs' activation modules replaced by the invariant SiLU, found by name"),
        HookPoint("transformers.activations.GELUActivation", exists("transformers.activations:GELUActivation"),
                  f"{_DETERMINISTIC}: Zamba's MLP activation (ACT2FN['gelu']) computed in float32, found by name"),
        *_gated_delta_deterministic(),
        *_mamba2_hybrids_deterministic(), *short_conv_deterministic(), *gdn_deterministic(), *kda_deterministic(),
        *moe_and_falcon_h1_deterministic(), *zaya_deterministic(),
        *inkling2_deterministic(),
    ]


def _mamba2_hybrids_deterministic() -> list[HookPoint]:
    """Bamba's, Granite-4.0-H's, Nemotron-H's and Zamba2's attention calls reach the routed function."""
    points = []
    for family, attention in (("bamba", "BambaAttention"), ("granitemoehybrid", "GraniteMoeHybridAttention"),
                              ("nemotron_h", "NemotronHAttention"), ("zamba2", "Zamba2Attention")):
        target = f"transformers.models.{family}.modeling_{family}:{attention}.forward"
        points.append(HookPoint(f"{dotted(target)}[attention interface]",
                                refers_to(target, "ALL_ATTENTION_FUNCTIONS", "get_interface", "scaling"),
                                f"{_DETERMINISTIC}: its attention calls reach the routed function"))
    return points


_GDN_MODULES = {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe", "qwen3_next": "Qwen3Next"}


def _gated_delta_deterministic() -> list[HookPoint]:
    """What deterministic mode's copies of the Qwen3.5 / Qwen3-Next forwards read
    (``models/gated_delta_deterministic.py``, ``hybrid_deterministic.gated_attention_forward`` /
    ``shared_moe_forward``)."""
    points = []
    for module, prefix in _GDN_MODULES.items():
        path = f"transformers.models.{module}.modeling_{module}"
        projections = ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering") if module == "qwen3_next" \
            else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        points += [
            HookPoint(f"{path}.{prefix}GatedDeltaNet.forward[deterministic copy]",
                      refers_to(f"{path}:{prefix}GatedDeltaNet.forward", *projections, "A_log", "dt_bias", "norm",
                                "out_proj", "sigmoid", "softplus"),
                      "hf_hybridcache.models.gated_delta_deterministic: the mixer forward it copies op for op"),
            HookPoint(f"{path}.{prefix}Attention.forward[gated attention copy]",
                      refers_to(f"{path}:{prefix}Attention.forward", "apply_rotary_pos_emb", "get_interface",
                                "q_norm", "k_norm", "o_proj", "sigmoid", "scaling"),
                      f"{_DETERMINISTIC}: gated_attention_forward copies it with the output gate from exp"),
        ]
        if module != "qwen3_5":
            points.append(HookPoint(
                f"{path}.{prefix}SparseMoeBlock.forward[routed + shared experts]",
                refers_to(f"{path}:{prefix}SparseMoeBlock.forward", "gate", "experts", "shared_expert",
                          "shared_expert_gate", "sigmoid"),
                f"{_DETERMINISTIC}: shared_moe_forward copies it with the shared gate from exp"))
    return points


def _expert_block_fields() -> str | None:
    config = resolve(f"{_JAMBA}:JambaConfig")(hidden_size=8, intermediate_size=4, num_experts=3,
                                               num_experts_per_tok=2)
    block = resolve(f"{_JAMBA}:JambaSparseMoeBlock")(config)
    router, experts = getattr(block, "router", None), getattr(block, "experts", None)

    def shape(owner, name: str) -> tuple:
        return tuple(getattr(getattr(owner, name, None), "shape", ()))

    found = {
        "router.weight [3, 8]": shape(router, "weight") == (3, 8),
        "router.top_k 2": getattr(router, "top_k", None) == 2,
        "experts.gate_up_proj [3, 8, 8]": shape(experts, "gate_up_proj") == (3, 8, 8),
        "experts.down_proj [3, 8, 4]": shape(experts, "down_proj") == (3, 8, 4),
        "experts.act_fn": callable(getattr(experts, "act_fn", None)),
    }
    missing = [name for name, ok in found.items() if not ok]
    return f"no {', '.join(missing)}" if missing else None


MODEL_HOOK_POINTS: tuple[HookPoint, ...] = (*(p for family in FAMILIES for p in family.hook_points()), *_wrappers(),
                                            *_mtp(), *_deterministic())
