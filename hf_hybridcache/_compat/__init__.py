"""The integration layer: the only code that knows transformers' and accelerate's internals.

Private APIs touched, and why each is needed (transformers 5.23 - 5.25; :mod:`.hook_points` checks each one):

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
- transformers 5.25's token count of a linear layer (``cumulative_length_linear``, which ``Cache.get_seq_length()``
  reads where layer 0 is a linear layer): a restore and a rollback set it, and a decode step that updates a conv
  window in place counts its token (``increase_count``); the caches the mixers are handed answer
  ``get_recurrent_states_to_keep`` with 0 and ``activate_past_recording(recurrent_states_to_keep=...)`` with the
  package's own per-token states.
- The mixer call convention ``(hidden_states, cache_params | cache, attention_mask)``: the patched mixers read the
  cache they are given; the kwarg was renamed after 5.23. transformers 5.25 moved the Mamba mixers' conv and scan into
  hookable module functions (``causal_conv1d_forward``, ``mamba_scan_forward``, ``mamba2_scan_forward``) that take
  the cache; they would be a smaller seam than a patched mixer forward, but 5.23 - 5.24 have no such functions, so the
  patch stays the one integration while the window holds them (a second, 5.25-only path would double the code that
  must stay exact). A Hub kernel swapped in for one of them (``kernelize``) keeps the state its own way and is
  refused by name (:mod:`.hub_kernels`); a routed module function keeps the ``kernels`` ``Func`` class under its name,
  so pickled models still rebuild their private copies (:mod:`.modeling`).
- The models without attention layers (Mamba, Falcon-Mamba, Mamba-2; :mod:`.cache_kwargs`): on 5.23 their
  ``generate()`` and ``forward()`` take the cache only as ``cache_params`` (another name is dropped unread, and 5.23's
  assisted decoding cannot find it); ``_prefill`` slices the prompt by a cache of linear layers only from 5.25 on
  (``Cache.is_linear``), and before 5.25 ``Cache.get_seq_length()`` cannot answer for one; their mixers get the
  model's whole 2D padding mask.
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
  attention implementation re-registered in ``AttentionInterface`` to apply an engine step's masks; the same router
  answers the attention modules deterministic mode marks with the invariant attention (:mod:`.invariant_attention`,
  in ``generate()`` and the engine alike).
- What ``model.train()`` changes (:mod:`.training`): the attention modules' ``attention_dropout`` and
  ``nn.Dropout`` modules (a forward with dropout on stores nothing), and ``GradientCheckpointingLayer``, which drops
  the cache in training mode on 5.23 even without autograd.
- TRL's ``GRPOTrainer`` / ``RLOOTrainer`` (:mod:`.trl`, TRL 1.16): ``_generate_single_turn`` wrapped per trainer (a
  seed per rollout, its outputs seen), GRPO's ``continuous_batching_config.return_logprobs`` and the ``logprobs``
  its rollout call returns.
- accelerate's ``_hf_hook`` / ``_old_forward`` / ``weights_map`` / ``execution_device`` and transformers'
  ``force_accelerate_hooks``: instance patches must sit under accelerate's hooks, and offloaded weights and layer
  devices are read from them.
- The decoder layers, norms and rotary embeddings of Qwen3.5, Qwen3.5-MoE and Qwen3-Next (:mod:`.mtp`): the MTP head
  a checkpoint ships, which transformers drops at load (``_keys_to_ignore_on_load_unexpected``), is rebuilt from
  them (its routed experts fused as the loader fuses the main model's), and a forward hook on ``get_decoder()``
  hands an MTP drafter the target's final hidden states.
- ``TokenizersBackend._decode`` (:mod:`.tokenizers`): a fast tokenizer's ``decode`` is its ``tokenizers``
  backend's decode and then, when asked, a clean-up of spaces; the server's streamed text decodes only the newest ids
  where the backend's decoder allows it, and only when no subclass overrides ``_decode``.

Everything here is reached through the names this package re-exports; the model is wrapped per instance (other
instances and the classes are untouched). Each of these internals is a named check in :mod:`.hook_points`
(tests/test_hook_points.py runs them all), and :func:`check_version` guards the tested window (:mod:`.versions`)
and the internals every request needs at construction.
"""

from __future__ import annotations

import os
import warnings

import transformers
from packaging.specifiers import SpecifierSet

from .accelerate import (
    execution_device,
    force_accelerate_hooks,
    module_tensors,
    patch_instance_forward,
    weight_tensors,
)
from .attention import in_package_forward, package_forward
from .continuous_batching import install_manager_hook, rollouts
from .cache_kwargs import CACHE_KWARG, cache_kwarg, find_cache, split_mixer_call, with_local_mixer_mask
from .generation import Hooks, allow_speculative_decoding, install_hooks, run_forward
from .hook_checks import broken
from .hook_points import AT_CONSTRUCTION
from .kernel_notices import quiet_kernel_notices
from .layers import (
    LINEAR_LAYERS_COUNT_TOKENS,
    conv_state_before_update,
    count_decode_token,
    append_kv_in_room,
    cache_layer_offset,
    crop_kv,
    dynamic_conv_input,
    inkling2_fused_attention,
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
from .training import dropout_probability, uncached_cause
from .versions import ALLOW_UNTESTED_ENV, IN_WORDS, INSTALL_COMMAND, REQUIREMENT, TESTED_RELEASES

TRANSFORMERS_VERSION = transformers.__version__
#: The transformers versions that run without the opt-in: those pyproject.toml's requirement allows.
SUPPORTED = SpecifierSet(REQUIREMENT.removeprefix("transformers"))

__all__ = [
    "CACHE_KWARG",
    "LINEAR_LAYERS_COUNT_TOKENS",
    "SUPPORTED",
    "TESTED_RELEASES",
    "TRANSFORMERS_VERSION",
    "Hooks",
    "allow_speculative_decoding",
    "cache_kwarg",
    "check_version",
    "conv_state_before_update",
    "count_decode_token",
    "append_kv_in_room",
    "cache_layer_offset",
    "crop_kv",
    "dynamic_conv_input",
    "inkling2_fused_attention",
    "decoder_layers",
    "dropout_probability",
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
    "rollouts",
    "route_module_function",
    "run_forward",
    "set_kv",
    "set_linear_state",
    "sliding_windows",
    "split_mixer_call",
    "uncached_cause",
    "with_local_mixer_mask",
    "module_tensors",
    "weight_tensors",
]

_warned_versions: set[str] = set()


def check_version() -> None:
    """Refuse a transformers outside the tested window (:mod:`.versions`) unless the user opts in with
    ``HF_HYBRIDCACHE_ALLOW_UNTESTED_TRANSFORMERS=1`` (then warn once per process), and refuse any transformers that
    lacks an internal every request needs (the ``at_construction`` hook points of :mod:`.hook_points`), naming it.

    Raises:
        ValueError: the installed transformers is outside the window and the opt-in is not set (the message names
            the version, the window and the command that installs a tested one), or an internal moved (named).
    """
    version = TRANSFORMERS_VERSION
    if not SUPPORTED.contains(version, prereleases=True):
        if os.environ.get(ALLOW_UNTESTED_ENV) != "1":
            raise ValueError(
                f"hf_hybridcache is tested with transformers {IN_WORDS} ({REQUIREMENT}), and transformers {version} "
                "is installed: the internals it hooks into may have moved there, which can make outputs wrong "
                f"without an error. Install a tested version: {INSTALL_COMMAND}. To run this one anyway, set "
                f"{ALLOW_UNTESTED_ENV}=1 (tests/test_hook_points.py checks those internals on it first)."
            )
        if version not in _warned_versions:
            _warned_versions.add(version)
            warnings.warn(
                f"hf_hybridcache runs on transformers {version}, outside its tested window ({REQUIREMENT}), because "
                f"{ALLOW_UNTESTED_ENV}=1: its outputs have not been compared with cold runs on this version; "
                f"{INSTALL_COMMAND} installs a tested one.",
                stacklevel=3,
            )
    moved = broken(AT_CONSTRUCTION)
    if moved:
        raise ValueError(
            f"hf_hybridcache cannot run on transformers {transformers.__version__}: internals it hooks into moved: "
            f"{'; '.join(moved)}. Install a tested version: {INSTALL_COMMAND}."
        )
