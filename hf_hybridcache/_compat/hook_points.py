"""Every transformers and accelerate internal this package relies on, each a named check
(:class:`~.hook_checks.HookPoint`).

transformers moves some of them in most minor releases. tests/test_hook_points.py runs every check on the installed
version, one test id per hook point, and a failure names the internal, the version and the package module that
relies on it: the first thing to run when raising the supported window's ceiling (:mod:`.versions`). The checks
marked ``at_construction`` (cheap, and needed by every request) also run whenever a cache is built
(:func:`~hf_hybridcache._compat.check_version`), so an untested version that lacks one is refused by name even when
the user opts in. The families' mixer classes and modeling-module functions are :mod:`.hook_points_models`, TRL's
trainers and what training mode changes :mod:`.hook_points_trl`.

A new internal the package starts to rely on gets its hook point here (or there) in the same commit;
tests/test_hook_points.py checks that every class and routed function name the model modules hold is listed.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import torch
from accelerate.hooks import AlignDevicesHook, SequentialHook, add_hook_to_module
from packaging.version import Version

from .hook_checks import (
    INSTALLED,
    HookPoint,
    dotted,
    exists,
    fields,
    methods,
    parameters,
    refers_to,
    resolve,
    source_mentions,
)
from .hook_points_models import MODEL_HOOK_POINTS
from .hook_points_trl import TRAINING_HOOK_POINTS
from .layers import DYNAMIC_LAYER_FIELDS

_GEN = "transformers.generation.utils:GenerationMixin"
_CACHE = "transformers.cache_utils"
_CB = "transformers.generation.continuous_batching"
_GENERATION = "hf_hybridcache._compat.generation"
_LAYERS = "hf_hybridcache._compat.layers"
_CONTINUOUS = "hf_hybridcache._compat.continuous_batching"
_ENGINE = "hf_hybridcache.engine"


def _for_installed(table: dict[str, frozenset[str]]) -> frozenset[str]:
    """The entry of ``table`` (``{first version: value}``) for the installed transformers."""
    return table[max((v for v in table if Version(v) <= Version(INSTALLED)), key=Version, default=min(table))]


_LINEAR_LAYER_FIELDS = frozenset({"device", "dtype", "conv_kernel_size", "conv_states", "recurrent_states",
                                  "is_conv_states_initialized", "is_recurrent_states_initialized",
                                  "has_previous_state"})
#: What a fresh ``LinearAttentionLayer`` holds: the fields :func:`~hf_hybridcache._compat.layers.set_linear_state`
#: writes, and those it leaves as built (``number_of_states``, ``record_past``).
_LINEAR_LAYER_ALL = {"5.23.0": _LINEAR_LAYER_FIELDS | {"number_of_states", "record_past"},
                     "5.25.0": _LINEAR_LAYER_FIELDS | {"number_of_states", "record_past", "cumulative_length_linear"}}
#: What a fresh ``DynamicSlidingWindowLayer`` holds: what :func:`~hf_hybridcache._compat.layers.set_kv` writes
#: (``keys``, ``values``, ``is_initialized``, ``cumulative_length``) and what it leaves as built.
_SLIDING_LAYER_ALL = frozenset({"keys", "values", "is_initialized", "cumulative_length", "sliding_window",
                                "_sliding_window_tensor", "record_past"})
#: The public methods and properties of transformers' ``Cache``: what modeling code may call on a cache, which the
#: package's own caches (``generate/live_cache.py``, ``engine/views.py``) answer or inherit.
_CACHE_METHODS_523 = frozenset({
    "activate_past_recording", "batch_repeat_interleave", "batch_select_indices", "batch_size", "crop",
    "early_initialization", "get_conv_state", "get_mask_sizes", "get_max_length", "get_query_offset",
    "get_recurrent_state", "get_seq_length", "has_previous_state", "is_compileable", "is_croppable", "is_dummy",
    "is_initialized", "is_linear", "is_recording_past", "is_sliding", "offload", "prefetch", "reorder_cache", "reset",
    "update", "update_conv_state", "update_indexer", "update_recurrent_state"})
_CACHE_METHODS = {"5.23.0": _CACHE_METHODS_523,
                  "5.25.0": _CACHE_METHODS_523 | {"get_recurrent_states_to_keep", "increase_count"}}
_LINEAR_METHODS_523 = frozenset({"activate_past_recording", "crop", "get_max_length", "is_compileable", "is_croppable",
                                 "lazy_initialization", "offload", "prefetch", "reorder_cache", "reset",
                                 "supports_early_init", "update_conv_state", "update_recurrent_state"})
_LINEAR_METHODS = {"5.23.0": _LINEAR_METHODS_523, "5.25.0": _LINEAR_METHODS_523 | {"get_seq_length", "increase_count"}}
#: What transformers' ``generate_batch`` and ``continuous_batching_context_manager`` call on the manager that
#: ``init_continuous_batching`` returns: the engine's manager implements each (tests/test_hook_points.py checks it).
MANAGER_CALLS = frozenset({"add_requests", "destroy", "get_result", "is_running", "start", "stop", "warmed_up",
                           "warmup"})
#: The fields of transformers' ``GenerationOutput`` the engine fills (``engine/requests.py``).
_OUTPUT_FIELDS = frozenset({"request_id", "prompt_ids", "generated_tokens", "logprobs", "error", "status",
                            "created_time", "lifespan", "timestamps"})


def _linear_layer():
    return resolve(f"{_CACHE}:LinearAttentionLayer")()


def _sliding_layer():
    return resolve(f"{_CACHE}:DynamicSlidingWindowLayer")(sliding_window=4)


def _manager_calls():
    mixin = resolve(f"{_CB}.continuous_api:ContinuousMixin")
    called = set()
    for name in ("generate_batch", "continuous_batching_context_manager"):
        called |= set(re.findall(r"\bmanager\.(\w+)", inspect.getsource(getattr(mixin, name))))
    unknown = sorted(called - MANAGER_CALLS)
    return f"calls manager.{', manager.'.join(unknown)}, which the engine's manager may lack" if unknown else None


def _output_fields():
    found = {f.name for f in dataclasses.fields(resolve(f"{_CB}.requests:GenerationOutput"))}
    new, gone = sorted(found - _OUTPUT_FIELDS), sorted(_OUTPUT_FIELDS - found)
    problems = []
    if new:
        problems.append(f"has new fields {', '.join(new)}, which the engine leaves unset")
    if gone:
        problems.append(f"has no {', '.join(gone)}")
    return "; ".join(problems) or None


def _request_status():
    status = resolve(f"{_CB}.requests:RequestStatus")
    order = ["PENDING", "PREFILLING", "DECODING", "FINISHED", "FAILED"]
    found = sorted(status.__members__, key=lambda name: status[name])
    return None if found == order else f"members {found} in that order, not {order} (the engine compares them)"


def _accelerate_hook_fields():
    module = torch.nn.Linear(1, 1)
    add_hook_to_module(module, SequentialHook(AlignDevicesHook(execution_device="cpu")))
    missing = [name for name in ("_hf_hook", "_old_forward") if not hasattr(module, name)]
    missing += [f"hook.{name}" for name in ("hooks",) if not hasattr(module._hf_hook, name)]
    missing += [f"AlignDevicesHook.{name}" for name in ("execution_device", "weights_map")
                if not hasattr(module._hf_hook.hooks[0], name)]
    return f"a hooked module has no {', '.join(missing)}" if missing else None


def _generation() -> list[HookPoint]:
    used = f"{_GENERATION} (wraps it per instance"
    return [
        HookPoint(f"{dotted(_GEN)}._prefill", parameters(f"{_GEN}._prefill", "input_ids", "generation_config",
                                                         "model_kwargs", leading=True),
                  f"{used}: a request's lookup and restore run before generate() slices the prompt)",
                  at_construction=True),
        HookPoint(f"{dotted(_GEN)}._get_candidate_generator",
                  parameters(f"{_GEN}._get_candidate_generator", "input_ids", "generation_config", "model_kwargs"),
                  f"{used}: assisted decoding's request starts there)", at_construction=True),
        HookPoint(f"{dotted(_GEN)}.prepare_inputs_for_generation",
                  parameters(f"{_GEN}.prepare_inputs_for_generation", "input_ids", "next_sequence_length",
                             leading=True),
                  f"{used}: assisted decoding's first forward feeds only the uncached tail)", at_construction=True),
        HookPoint(f"{dotted(_GEN)}._maybe_prepare_encoder_kwargs_for_generation",
                  parameters(f"{_GEN}._maybe_prepare_encoder_kwargs_for_generation", "inputs_tensor",
                             "model_kwargs", "model_input_name", "generation_config", leading=True),
                  f"{used}: images are encoded after the restore, only those the hit leaves)", at_construction=True),
        HookPoint(f"{dotted(_GEN)}._maybe_prepare_encoder_kwargs_for_generation[mm_encoder_outputs]",
                  source_mentions(f"{_GEN}._maybe_prepare_encoder_kwargs_for_generation", "mm_encoder_outputs"),
                  "hf_hybridcache.generate.images (hands the tail's image features to the forward as "
                  "mm_encoder_outputs, where generate() puts the ones it encodes)"),
        HookPoint(f"{dotted(_GEN)}._get_stopping_criteria", exists(f"{_GEN}._get_stopping_criteria"),
                  f"{used}: the rows generate() finishes stop storing)", at_construction=True),
        HookPoint(f"{dotted(_GEN)}.generate", parameters(f"{_GEN}.generate", "inputs", "generation_config"),
                  f"{used}: the cache's lock is held for the call)"),
        HookPoint(f"{dotted(_GEN)}._validate_generation_mode[_is_stateful]",
                  refers_to(f"{_GEN}._validate_generation_mode", "_is_stateful"),
                  f"{_GENERATION}.allow_speculative_decoding (lifts generate()'s refusal of speculative decoding "
                  "for a stateful model during its calls)", versions="<5.25.0"),
        HookPoint(f"{dotted(_GEN)}._get_logits_processor",
                  parameters(f"{_GEN}._get_logits_processor", "generation_config", leading=True),
                  f"{_CONTINUOUS}.logits_processors (the engine's processors are generate()'s)"),
    ]


def _cache_layers() -> list[HookPoint]:
    layers = f"{_LAYERS} (new_live_layers, set_kv, set_linear_state: a restore fills fresh live layers)"
    return [
        HookPoint("transformers.cache_utils.DynamicCache.__init__[config]",
                  parameters(f"{_CACHE}:DynamicCache.__init__", "config"), layers, at_construction=True),
        HookPoint("transformers.cache_utils.DynamicLayer[fields a restore writes]",
                  fields(lambda: resolve(f"{_CACHE}:DynamicLayer")(), DYNAMIC_LAYER_FIELDS, exact=True), layers,
                  at_construction=True),
        HookPoint("transformers.cache_utils.DynamicLayer.lazy_initialization",
                  parameters(f"{_CACHE}:DynamicLayer.lazy_initialization", "key_states", "value_states",
                             leading=True), layers, at_construction=True),
        HookPoint("transformers.cache_utils.DynamicLayer.update", exists(f"{_CACHE}:DynamicLayer.update"),
                  f"{_LAYERS}.append_kv_in_room (writes into a restored buffer's room where the layer's update is "
                  "DynamicLayer's)"),
        HookPoint("transformers.cache_utils.DynamicSlidingWindowLayer[fields a restore writes]",
                  fields(_sliding_layer, _SLIDING_LAYER_ALL, exact=True),
                  f"{_LAYERS}.set_kv (a sliding layer keeps sliding_window - 1 tokens and counts all of them)",
                  at_construction=True),
        HookPoint("transformers.cache_utils.LinearAttentionLayer[fields a restore writes]",
                  fields(_linear_layer, _LINEAR_LAYER_FIELDS), layers, at_construction=True),
        HookPoint("transformers.cache_utils.LinearAttentionLayer[every field]",
                  fields(_linear_layer, _for_installed(_LINEAR_LAYER_ALL), exact=True), layers),
        HookPoint("transformers.cache_utils.LinearAttentionLayer.lazy_initialization",
                  parameters(f"{_CACHE}:LinearAttentionLayer.lazy_initialization", "conv_states", "recurrent_states",
                             "state_idx", "conv_kernel_size"), layers, at_construction=True),
        HookPoint("transformers.cache_utils.LinearAttentionLayer.cumulative_length_linear",
                  fields(_linear_layer, ("cumulative_length_linear",)),
                  f"{_LAYERS}.set_linear_state (the token count a restore sets; get_seq_length() reads layer 0)",
                  versions=">=5.25.0", at_construction=True),
        HookPoint("transformers.cache_utils.LinearAttentionCacheLayerMixin.increase_count",
                  parameters(f"{_CACHE}:LinearAttentionCacheLayerMixin.increase_count", "state_idx"),
                  f"{_LAYERS} (a decode step that updates a conv state in place counts its token)",
                  versions=">=5.25.0", at_construction=True),
        HookPoint("transformers.cache_utils.LinearAttentionCacheLayerMixin.activate_past_recording",
                  parameters(f"{_CACHE}:LinearAttentionCacheLayerMixin.activate_past_recording",
                             "recurrent_states_to_keep"),
                  "hf_hybridcache.generate.live_cache (generate() passes recurrent_states_to_keep to the cache it "
                  "is given, to roll draft tokens back)",
                  versions=">=5.25.0", at_construction=True),
        HookPoint("transformers.cache_utils.LinearAttentionCacheLayerMixin[methods]",
                  methods(f"{_CACHE}:LinearAttentionCacheLayerMixin", _for_installed(_LINEAR_METHODS)), layers),
        HookPoint("transformers.cache_utils.Cache.increase_count",
                  parameters(f"{_CACHE}:Cache.increase_count", "layer_idx", "state_idx", leading=True),
                  "hf_hybridcache.generate.live_cache, hf_hybridcache.engine.views (every 5.25 mixer calls it on "
                  "the cache it is given)", versions=">=5.25.0", at_construction=True),
        HookPoint("transformers.cache_utils.Cache.get_recurrent_states_to_keep",
                  parameters(f"{_CACHE}:Cache.get_recurrent_states_to_keep", "layer_idx"),
                  "hf_hybridcache.generate.live_cache, hf_hybridcache.engine.views (every 5.25 mixer calls it on "
                  "the cache it is given)", versions=">=5.25.0", at_construction=True),
        HookPoint("transformers.cache_utils.Cache.is_recording_past",
                  parameters(f"{_CACHE}:Cache.is_recording_past", "layer_idx"),
                  "hf_hybridcache.models (the patched mixers leave recording calls to upstream)"),
        HookPoint("transformers.cache_utils.Cache.update_conv_state",
                  parameters(f"{_CACHE}:Cache.update_conv_state", "conv_states", "layer_idx", leading=True),
                  "hf_hybridcache.generate.live_cache, hf_hybridcache.engine.views (the conv inputs a checkpoint "
                  "stores pass through it)"),
        HookPoint("transformers.cache_utils.Cache.get_mask_sizes",
                  parameters(f"{_CACHE}:Cache.get_mask_sizes", "query_length", "layer_idx", leading=True),
                  f"{_ENGINE}.views, {_CONTINUOUS}.group_argument (a group's masks and relative distances)"),
        HookPoint("transformers.cache_utils.Cache[methods]",
                  methods(f"{_CACHE}:Cache", _for_installed(_CACHE_METHODS)),
                  "hf_hybridcache.generate.live_cache, hf_hybridcache.engine.views (what modeling code calls on "
                  "the package's caches)"),
    ]


def _continuous_batching() -> list[HookPoint]:
    api = f"{_CB}.continuous_api:ContinuousMixin"
    hook = f"{_CONTINUOUS}.install_manager_hook (the instance's init_continuous_batching returns the engine)"
    logits = f"{_CB}.cb_logits_processors:ContinuousBatchingLogitsProcessorList"
    return [
        HookPoint(f"{dotted(api)}.init_continuous_batching",
                  parameters(f"{api}.init_continuous_batching", "generation_config", "continuous_batching_config",
                             "workload_hints", leading=True), hook),
        HookPoint(f"{dotted(api)}.continuous_batching_context_manager",
                  refers_to(f"{api}.continuous_batching_context_manager", "init_continuous_batching"), hook),
        HookPoint(f"{dotted(api)}.generate_batch",
                  parameters(f"{api}.generate_batch", "inputs", "generation_config", leading=True),
                  f"{_CONTINUOUS} (its instance hook sets GenerationConfig fields and carries images)"),
        HookPoint(f"{dotted(api)}[manager calls]", _manager_calls,
                  f"{_ENGINE}.manager (answers what generate_batch calls on its manager)"),
        HookPoint(f"{_CB}.requests.GenerationOutput", _output_fields,
                  f"{_CONTINUOUS}.EngineOutput, {_ENGINE}.requests (fills every field)"),
        HookPoint(f"{_CB}.requests.RequestStatus", _request_status, f"{_ENGINE} (request states, compared in order)"),
        HookPoint("transformers.generation.configuration_utils.ContinuousBatchingConfig",
                  fields(lambda: resolve("transformers.generation.configuration_utils:ContinuousBatchingConfig")(),
                         ("per_request_processors", "drop_unsupported_processors")),
                  f"{_CONTINUOUS}.logits_processors"),
        HookPoint(dotted(logits), parameters(f"{logits}.__init__", "logits_processor", "per_request_processors",
                                             "drop_unsupported_processors", leading=True),
                  f"{_CONTINUOUS}.logits_processors"),
        HookPoint(f"{dotted(logits)}.prepare_tensor_args",
                  parameters(f"{logits}.prepare_tensor_args", "requests_in_batch", "arg_storage", leading=True),
                  f"{_CONTINUOUS}.processor_args (per-request temperature / top-k / top-p)"),
        HookPoint(f"{_CB}.cb_logits_processors[logit_processor_kwargs]",
                  source_mentions(f"{_CB}.cb_logits_processors", "logit_processor_kwargs", "tensors_required",
                                  "ContinuousBatchingTemperatureLogitsWarper", "ContinuousBatchingTopKLogitsWarper",
                                  "ContinuousBatchingTopPLogitsWarper"),
                  f"{_CONTINUOUS}.processor_args, warpers_only"),
        HookPoint("transformers.modeling_utils.AttentionInterface.register",
                  exists("transformers.modeling_utils:AttentionInterface.register"),
                  "hf_hybridcache._compat.engine_attention (an engine step's masks reach transformers' attention)"),
        HookPoint("transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS",
                  exists("transformers.modeling_utils:ALL_ATTENTION_FUNCTIONS.get"),
                  "hf_hybridcache._compat.engine_attention"),
        HookPoint("transformers.modeling_utils.PreTrainedModel.set_attn_implementation",
                  exists("transformers.modeling_utils:PreTrainedModel.set_attn_implementation"),
                  "hf_hybridcache._compat.engine_attention (undoes the paged eager switch of transformers' manager)"),
    ]


def _integrations() -> list[HookPoint]:
    sdpa = "transformers.integrations.sdpa_attention"
    hub = "transformers.integrations.hub_kernels"
    return [
        HookPoint(f"{sdpa}.use_gqa_in_sdpa",
                  parameters(f"{sdpa}:use_gqa_in_sdpa", "attention_mask", "key", "value", leading=True),
                  "hf_hybridcache._compat.attention (rebound: SDPA's enable_gqa for a masked replay on CPU)"),
        HookPoint(f"{sdpa}.sdpa_attention_forward[use_gqa_in_sdpa]",
                  refers_to(f"{sdpa}:sdpa_attention_forward", "use_gqa_in_sdpa"),
                  "hf_hybridcache._compat.attention (the rebound name is the one it calls)"),
        HookPoint(f"{hub}.logger", lambda: None if resolve(f"{hub}:logger").name == hub else "another logger name",
                  "hf_hybridcache._compat.kernel_notices (a filter on it drops the notices of kernels the package's "
                  "scans stand in for)"),
        HookPoint(f"{hub}.use_kernel_func_from_hub_with_fallback[notice]",
                  source_mentions(f"{hub}:use_kernel_func_from_hub_with_fallback", "is falling back"),
                  "hf_hybridcache._compat.kernel_notices (matches the notice by its start)"),
        HookPoint("transformers.integrations.accelerate.force_accelerate_hooks",
                  parameters("transformers.integrations.accelerate:force_accelerate_hooks", "child_module_names"),
                  "hf_hybridcache.models.jamba, zamba, mamba2 (the mirrored mixer forwards call conv1d / dt_proj "
                  "directly, and accelerate's hooks on them must still fire)"),
        HookPoint("accelerate.hooks.add_hook_to_module[_hf_hook, _old_forward, execution_device, weights_map]",
                  _accelerate_hook_fields,
                  "hf_hybridcache._compat.accelerate (instance patches sit under accelerate's hooks; offloaded "
                  "weights and layer devices are read from them)"),
        *_hub_kernels(),
        HookPoint("transformers.tokenization_utils_tokenizers.TokenizersBackend._decode",
                  source_mentions("transformers.tokenization_utils_tokenizers:TokenizersBackend._decode",
                                  "self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)",
                                  "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"),
                  "hf_hybridcache._compat.tokenizers (a fast tokenizer's decode is its backend's, then a clean-up)"),
        HookPoint("transformers.modeling_outputs.BaseModelOutputWithPooling",
                  parameters("transformers.modeling_outputs:BaseModelOutputWithPooling.__init__", "pooler_output"),
                  "hf_hybridcache.multimodal.prompt, hf_hybridcache.engine.images (mm_encoder_outputs)"),
    ]


def _hub_kernels() -> list[HookPoint]:
    """What :mod:`.hub_kernels` reads of the ``kernels`` library (a dependency of transformers from 5.25) and of the
    5.25 modeling files: where a swap is recorded, and which module functions are handed the cache."""
    layer = "kernels._internals.layer.layer"
    used_by = "hf_hybridcache._compat.hub_kernels (refuses Hub kernels handed the cache)"
    points = [
        HookPoint(f"{layer}._replace_forward[_kernel_repo]", source_mentions(f"{layer}:_replace_forward", '"_kernel_repo"'),
                  used_by, versions=">=5.25.0"),
        HookPoint(f"{layer}.use_kernelized_func[_kernel_funcs]",
                  source_mentions(f"{layer}:use_kernelized_func", '"_kernel_funcs"'), used_by, versions=">=5.25.0"),
        HookPoint(f"{layer}._rebuild_kernel_func", source_mentions(f"{layer}:_rebuild_kernel_func",
                                                                   "type(getattr(module, func_name))()"),
                  "hf_hybridcache._compat.modeling (a routed name keeps an instance of the Func class, which a pickled "
                  "mixer's private copies are rebuilt from)", versions=">=5.25.0"),
    ]
    for module, function in (("jamba", "causal_conv1d_forward"), ("jamba", "mamba_scan_forward"),
                             ("zamba2", "mamba2_scan_forward")):
        target = f"transformers.models.{module}.modeling_{module}:{function}"
        points.append(HookPoint(f"{dotted(target)}[cache]", parameters(target, "cache"), used_by, versions=">=5.25.0"))
    return points


#: Every hook point, in the order tests/test_hook_points.py lists them.
HOOK_POINTS: tuple[HookPoint, ...] = (*_generation(), *_cache_layers(), *_continuous_batching(), *_integrations(),
                                      *MODEL_HOOK_POINTS, *TRAINING_HOOK_POINTS)
#: The ones :func:`~hf_hybridcache._compat.check_version` runs when a cache is built.
AT_CONSTRUCTION: tuple[HookPoint, ...] = tuple(p for p in HOOK_POINTS if p.at_construction)
