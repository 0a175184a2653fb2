"""The integration layer: the only code that knows transformers' and accelerate's internals.

Private APIs touched, and why each is needed (transformers 5.23 - 5.24):

- ``GenerationMixin._prefill`` (wrapped on the model instance): the one place that runs before ``generate()`` reads
  ``cache.get_seq_length()`` to slice the prompt, for greedy, sampling and beam search. The lookup + restore of a
  request runs there, so ``generate()`` feeds only the uncached tail.
- ``GenerationMixin._get_candidate_generator`` (wrapped): assisted decoding (prompt lookup, assistant models) never
  calls ``_prefill``; its request starts here.
- ``prepare_inputs_for_generation``'s ``next_sequence_length`` (wrapped): assisted decoding's first forward re-feeds
  the whole prompt; after a restore it must feed only the tail, as ``_prefill`` would.
- ``GenerationMixin._maybe_prepare_encoder_kwargs_for_generation`` (wrapped): a vision-language wrapper's images are
  encoded there, before the prefill; with the cache they are encoded after the restore instead, only those the hit
  leaves in the tail, and handed over as ``mm_encoder_outputs`` (:mod:`hf_hybridcache.generate.images`).
- ``Qwen3_5Model.get_rope_index`` (and Qwen3.5-MoE's): the engine gives each request with images the 3D rotary
  positions a cold ``generate()`` computes from its whole prompt (:mod:`.multimodal`).
- ``GenerationMixin._get_stopping_criteria`` (wrapped): which rows generate() finished (it feeds them the pad id
  afterwards) is only known to its stopping criteria; a row whose own tokens equal the pad id is not finished.
- ``PreTrainedModel._is_stateful`` (set per call): ``generate()`` refuses speculative decoding for stateful models;
  a HybridPrefixCache can roll a recurrent state back, so the refusal is lifted during its calls.
- ``DynamicLayer`` / ``DynamicSlidingWindowLayer`` / ``LinearAttentionLayer`` fields (``keys``, ``values``,
  ``cumulative_length``, ``sliding_window``, ``conv_states``, ``recurrent_states``,
  ``has_previous_state``, ``lazy_initialization``): restoring a prefix fills fresh live layers, and rolling back a
  draft token sets their state; there is no public setter.
- The mixer call convention ``(hidden_states, cache_params | cache, attention_mask)``: the patched mixers read the
  cache they are given; the kwarg was renamed after 5.23.
- Inkling 2 Loop's loop fields (``loop_layer_index_start``, ``loop_layer_index_end``, ``loop_num_passes``) and the
  ``cache_offset`` keyword its looped layers' modules take (5.24): its passes after the first keep their states in
  cache layers after the model's own, which its forward appends when the cache holds ``num_hidden_layers`` layers;
  the live layers are built with them (:func:`.layers.loop_cache_layers`).
- The module-level recurrence kernels of the linear-attention modeling files (``torch_chunk_gated_delta_rule`` and
  kin), rebound once in their module to a router that passes every call through unchanged except inside this
  package's own patched mixer calls, where it also returns the recurrent states at block boundaries.
- ``transformers.integrations.sdpa_attention.use_gqa_in_sdpa``, rebound to a router that, inside this package's
  forwards on CPU, lets a masked multi-query call use SDPA's ``enable_gqa`` instead of ``repeat_kv`` copies (same
  output bit for bit; see :mod:`.attention`), and answers as before everywhere else.
- ``transformers.integrations.hub_kernels``' logger: its "falling back ... install ``mamba_ssm``" notices are dropped
  for the kernels the package's own scans stand in for, inside the patched model's forwards with its cache
  (:mod:`.kernel_notices`).
- transformers' continuous batching (:mod:`.continuous_batching`, :mod:`.engine_attention`): an instance-level
  ``init_continuous_batching`` returning the engine's manager, its data classes and logits processors, and the
  attention implementation re-registered in ``AttentionInterface`` to apply an engine step's masks.
- accelerate's ``_hf_hook`` / ``_old_forward`` / ``weights_map`` / ``execution_device`` and transformers'
  ``force_accelerate_hooks``: instance patches must sit under accelerate's hooks, and offloaded weights and layer
  devices are read from them.

Everything here is reached through the names this package re-exports; the model is wrapped per instance (other
instances and the classes are untouched), and :func:`check_version` guards the tested range at construction.
"""

from __future__ import annotations

import warnings

import transformers
from packaging.version import Version

from .accelerate import (
    execution_device,
    force_accelerate_hooks,
    module_tensors,
    patch_instance_forward,
    weight_tensors,
)
from .attention import in_package_forward, package_forward
from .continuous_batching import install_manager_hook
from .generation import (
    CACHE_KWARG,
    Hooks,
    allow_speculative_decoding,
    find_cache,
    install_hooks,
    run_forward,
    split_mixer_call,
)
from .kernel_notices import quiet_kernel_notices
from .layers import (
    DYNAMIC_LAYER_FIELDS,
    conv_state_before_update,
    count_decode_token,
    append_kv_in_room,
    cache_layer_offset,
    crop_kv,
    decoder_layers,
    get_kv,
    get_linear_state,
    loop_cache_layers,
    new_live_layers,
    set_kv,
    set_linear_state,
    sliding_windows,
)
from .modeling import route_module_function

TRANSFORMERS_VERSION = transformers.__version__
#: The transformers releases the suite runs on (CI runs both ends).
TESTED_RANGE = (Version("5.23.0"), Version("5.25.0"))

__all__ = [
    "CACHE_KWARG",
    "TESTED_RANGE",
    "TRANSFORMERS_VERSION",
    "Hooks",
    "allow_speculative_decoding",
    "check_version",
    "conv_state_before_update",
    "count_decode_token",
    "append_kv_in_room",
    "cache_layer_offset",
    "crop_kv",
    "decoder_layers",
    "execution_device",
    "find_cache",
    "force_accelerate_hooks",
    "get_kv",
    "get_linear_state",
    "in_package_forward",
    "install_hooks",
    "loop_cache_layers",
    "install_manager_hook",
    "new_live_layers",
    "package_forward",
    "patch_instance_forward",
    "quiet_kernel_notices",
    "route_module_function",
    "run_forward",
    "set_kv",
    "set_linear_state",
    "sliding_windows",
    "split_mixer_call",
    "module_tensors",
    "weight_tensors",
]

_warned_versions: set[str] = set()
#: Fields of transformers' ``LinearAttentionLayer`` a restore sets (:func:`~hf_hybridcache._compat.layers.set_linear_state`).
_LINEAR_LAYER_FIELDS = ("device", "dtype", "conv_kernel_size", "conv_states", "recurrent_states",
                        "is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state")


def check_version() -> None:
    """Warn once per process when the installed transformers is outside :data:`TESTED_RANGE`, and refuse it when a
    private API this layer needs is missing.

    Raises:
        ValueError: ``GenerationMixin`` lacks ``_prefill`` or ``_get_candidate_generator``, or the cache layers lack
            the fields a restore writes; names the version and what to install.
    """
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer
    from transformers.generation.utils import GenerationMixin

    missing = [name for name in ("_prefill", "_get_candidate_generator") if not hasattr(GenerationMixin, name)]
    missing += [f"{cls.__name__}.lazy_initialization" for cls in (DynamicLayer, LinearAttentionLayer)
                if not hasattr(cls, "lazy_initialization")]
    fresh = LinearAttentionLayer()  # the fields set_linear_state writes in place of its lazy_initialization
    missing += [f"LinearAttentionLayer.{name}" for name in _LINEAR_LAYER_FIELDS if not hasattr(fresh, name)]
    fresh = DynamicLayer()  # the fields set_kv writes in place of its lazy_initialization
    missing += [f"DynamicLayer.{name}" for name in DYNAMIC_LAYER_FIELDS if not hasattr(fresh, name)]
    if missing:
        raise ValueError(
            f"hf_hybridcache needs transformers internals that transformers {TRANSFORMERS_VERSION} does not have "
            f"({', '.join(missing)}); install a tested version: pip install 'transformers>={TESTED_RANGE[0]},"
            f"<{TESTED_RANGE[1]}'."
        )
    version = Version(TRANSFORMERS_VERSION)
    if not TESTED_RANGE[0] <= version < TESTED_RANGE[1] and TRANSFORMERS_VERSION not in _warned_versions:
        _warned_versions.add(TRANSFORMERS_VERSION)
        warnings.warn(
            f"hf_hybridcache is tested with transformers >={TESTED_RANGE[0]},<{TESTED_RANGE[1]} and this is "
            f"{TRANSFORMERS_VERSION}: outputs are still compared with the model's own code by the tests, but hooks "
            "into generate() may break; pin a tested version if anything looks off.",
            stacklevel=3,
        )
