"""Shared pieces of the linear-attention and short-conv hybrids (gated delta net, KDA, short convolutions).

transformers 5.23 keeps these mixers' state in the same ``LinearAttentionLayer`` cache layers as the Mamba
families, and their multi-token forward already continues exactly from a cached (conv, recurrent) state: the causal
conv runs over ``cache.update_conv_state``'s output (cached window + new inputs) and the recurrence kernel takes the
cached state as ``initial_state``. So no mixer is copied here. The patched forward runs the upstream forward
unchanged and, when the cache wants states inside the call, makes an :class:`~hf_hybridcache.models.emission.Emission`
active around it:

- the conv windows at the positions are cut from the raw conv inputs the mixer hands to
  ``cache.update_conv_state`` (:class:`~hf_hybridcache.generate.live_cache.LiveCache` forwards them to the emission);
- the recurrence kernel the mixer calls by its module-level name (``torch_chunk_gated_delta_rule`` and kin) is
  routed through :func:`route_recurrence`, which returns the states after the positions with the output. With no
  emitting implementation for the kernel it calls the kernel piecewise, from each piece's final state as the next
  piece's ``initial_state`` (as vLLM's prefix caching for Mamba layers does with ``initial_states`` /
  ``return_final_states``); its output equals one call's within round-off of the chunk boundaries it moves.

Short convolutions (LFM2 and kin) have no recurrent state: the checkpoint is the conv window alone, stored with an
empty recurrent state ``[B, 0]``.

A family file is a :class:`LinearVariant` handed to :func:`linear_attention_support`.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import _compat
from ..config import AttentionLayerSpec, MambaLayerSpec, ModelStateSpec, TensorSpec, state_key
from ..kernels import get_backend
from . import emission, fused_decode
from .base import ModelSupport, attention_layer_spec
from .mamba1 import checkpoint_positions, deterministic_over

#: The recurrent state of a short-conv layer: nothing (a ``[B, 0]`` tensor stands in for it).
NO_RECURRENT_STATE = TensorSpec((0,), torch.float32)


#: The most tokens a call runs through :attr:`RecurrenceKernel.stepping` (measured on this project's 2-core CPU, gated
#: delta net of 8 heads of 96 from a state, one thread: 5 tokens 0.22 ms stepped vs 1.4 ms chunked, 16 tokens 0.6 vs
#: 6.8 ms; at 32 the chunked form is as fast). In reduced precision the chunked form keeps rounding as a prefill does.
STEP_TOKENS = 16


@functools.cache
def _parameters(function: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


@dataclass(frozen=True)
class RecurrenceKernel:
    """A module-level recurrence function a mixer calls for multi-token forwards.

    Attributes:
        function: its name in the mixer's modeling module (e.g. ``"torch_chunk_gated_delta_rule"``).
        time_kwargs: keyword arguments holding ``[B, T, ...]`` tensors (positional tensor arguments are always
            time-major).
        emitting: ``(*args, emit_positions, **kwargs) -> (out, final_state, states)``, our copy of the kernel's
            torch path that also returns the states after ``emit_positions`` tokens (bit-identical output); None to
            call the kernel piecewise instead.
        fast_package: the package transformers dispatches the kernel to when it is installed (``fla``); then the
            kernel is called piecewise, so the fast kernel keeps running.
        stepping: the same contract as ``emitting``, token by token: run in its place for calls of at most
            :data:`STEP_TOKENS` tokens in float32 (a verify step's last token and drafts, a short prefill tail),
            where the chunked form pads the call to a whole chunk; None to use ``emitting`` at every length.
    """

    function: str
    time_kwargs: tuple[str, ...] = ("g", "beta")
    emitting: Callable | None = None
    fast_package: str = "fla"
    stepping: Callable | None = None

    def emitting_for(self, query: torch.Tensor) -> tuple[Callable, frozenset[str]]:
        """The emitting implementation for a call on ``query`` ``[B, T, ...]`` (``stepping`` for a few float32
        tokens outside the ``"reference"`` kernel backend, else ``emitting``) and the names of its parameters."""
        stepped = (self.stepping is not None and query.shape[1] <= STEP_TOKENS and query.dtype == torch.float32
                   and get_backend() != "reference")
        function = self.stepping if stepped else self.emitting
        return function, _parameters(function)

    @functools.cached_property
    def uses_fast_package(self) -> bool:
        return importlib.util.find_spec(self.fast_package) is not None


@dataclass(frozen=True)
class LinearVariant:
    """One family's linear-attention (or short-conv) mixer and attention classes.

    Attributes:
        mixer_class: class name of the mixer (matched by name, so no model module is imported), or several names.
        attention_class: class name of the attention module whose KV the cache layer of the same index holds, or
            several names (one module per layer).
        conv_shape: ``mixer -> (C, W)``, the conv state of one row (model dtype).
        recurrent_shape: ``mixer -> shape`` of one row's recurrent state (float32), or None for a short conv.
        kernels: the recurrence functions the mixer calls (empty for a short conv).
        attention_spec: ``(layer_idx, attention module) -> AttentionLayerSpec``, what the attention module caches
            (:func:`~.base.attention_layer_spec` for ``k_proj`` / ``head_dim`` attention,
            :func:`~.base.mla_attention_layer_spec` for MLA).
        state_idx_attr: the mixer attribute holding its ``state_idx`` in the cache layer, for layers that keep
            several states (Inkling's ``conv_idx``); None for one state per layer.
        conv_dtype: ``mixer -> dtype`` of the conv state, where the mixer keeps it in another dtype than its conv
            weight (a conv run in float32 in a bf16 model: Inkling, Ling); None: the conv weight's dtype.
        decode_functions: module-level single-token functions the mixer calls on a decode step
            (``causal_conv1d_update``, ``torch_recurrent_gated_delta_rule``), routed to the fused state updates of
            :mod:`hf_hybridcache.kernels.state_update` inside this package's fp32 decode steps (:mod:`hf_hybridcache.models.fused_decode`).
    """

    mixer_class: str | tuple[str, ...]
    attention_class: str | tuple[str, ...]
    conv_shape: Callable[[torch.nn.Module], tuple[int, int]]
    recurrent_shape: Callable[[torch.nn.Module], tuple[int, ...]] | None = None
    kernels: tuple[RecurrenceKernel, ...] = ()
    attention_spec: Callable[[int, torch.nn.Module], AttentionLayerSpec] = attention_layer_spec
    state_idx_attr: str | None = None
    conv_dtype: Callable[[torch.nn.Module], torch.dtype] | None = None
    decode_functions: tuple[str, ...] = ()

    def is_mixer(self, module) -> bool:
        return type(module).__name__ in _names(self.mixer_class)

    def is_attention(self, module) -> bool:
        return type(module).__name__ in _names(self.attention_class)

    def state_idx(self, mixer) -> int:
        return getattr(mixer, self.state_idx_attr) if self.state_idx_attr else 0


def _names(class_names: str | tuple[str, ...]) -> tuple[str, ...]:
    return (class_names,) if isinstance(class_names, str) else class_names


def route_recurrence(kernel: RecurrenceKernel, original: Callable, *args, **kwargs):
    """The routed recurrence function: ``original`` unless a mixer call of this package wants states inside it.

    Returns ``original``'s ``(out [B, T, ...], final_state or None)``; the states after the emission's positions go to
    the active :class:`~hf_hybridcache.models.emission.Emission`.
    """
    active = emission.active()
    if active is None or active.recurrent is not None:
        return original(*args, **kwargs)
    if kernel.emitting is not None and not kernel.uses_fast_package:
        # transformers' wrapper drops the kwargs its torch path does not take (cu_seqlens=None, ...); so does this.
        emitting, parameters = kernel.emitting_for(args[0])
        kwargs = {name: value for name, value in kwargs.items() if name in parameters}
        out, final_state, states = emitting(*args, emit_positions=active.positions, **kwargs)
    else:
        out, final_state, states = _piecewise(kernel, original, active.positions, args, kwargs)
    active.recurrent = states
    return out, final_state


def _piecewise(kernel: RecurrenceKernel, original: Callable, positions, args: tuple, kwargs: dict):
    """``original`` over the pieces between ``positions``, each from the previous piece's final state."""
    seq_len = args[0].shape[1]
    state, outputs, states = kwargs.get("initial_state"), [], []
    bounds = (0, *positions, seq_len)
    for start, end in itertools.pairwise(bounds):
        piece_kwargs = {**kwargs, "initial_state": state, "output_final_state": True}
        for name in kernel.time_kwargs:
            if kwargs.get(name) is not None:
                piece_kwargs[name] = kwargs[name][:, start:end]
        out, state = original(*(x[:, start:end] for x in args), **piece_kwargs)
        outputs.append(out)
        if end < seq_len:
            states.append(state.clone())
    return torch.cat(outputs, dim=1), state if kwargs.get("output_final_state") else None, states


def _emitting_forward(variant: LinearVariant, mixer, original, *args, **kwargs):
    hidden_states, cache, _ = _compat.split_mixer_call(args, kwargs)
    seq_len = hidden_states.shape[1]
    layer_idx = mixer.layer_idx + _compat.cache_layer_offset(kwargs)  # a loop pass's own cache layer (Inkling 2 Loop)
    deterministic = deterministic_over(mixer, cache)  # set by deterministic mode's install
    if deterministic is not None and (cache is None or not cache.is_recording_past(layer_idx)):
        if "conv_mask" in kwargs:  # Inkling's short convolutions take their padding mask under this name
            kwargs = {**{k: v for k, v in kwargs.items() if k != "conv_mask"}, "attention_mask": kwargs["conv_mask"]}
        _, _, attention_mask = _compat.split_mixer_call(*_compat.with_local_mixer_mask(args, kwargs))
        forward, over = deterministic
        if getattr(forward, "takes_call_inputs", False):  # Inkling 2's: its tap input, a loop pass's cache layer
            return forward(mixer, hidden_states, over, attention_mask,
                           dynamic_input=_compat.dynamic_conv_input(args, kwargs), layer_idx=layer_idx)
        return forward(mixer, hidden_states, over, attention_mask)
    if cache is None or cache.is_recording_past(layer_idx):
        return original(*args, **kwargs)
    if seq_len == 1:
        if not variant.decode_functions or not fused_decode.wanted(hidden_states, cache):
            return original(*args, **kwargs)
        with fused_decode.fused():
            return original(*args, **kwargs)
    positions = checkpoint_positions(cache, seq_len)
    if not positions:
        return original(*args, **kwargs)
    key = state_key(layer_idx, variant.state_idx(mixer))
    with emission.emitting(key, positions) as emitted:
        out = original(*args, **kwargs)
    assert emitted.conv is not None, f"{variant.mixer_class} did not hand its conv inputs to update_conv_state"
    if variant.kernels:
        assert emitted.recurrent is not None, f"{variant.mixer_class} did not call a routed recurrence kernel"
        recurrent = emitted.recurrent
    else:
        recurrent = [emitted.conv[0].new_zeros((emitted.conv[0].shape[0], 0), dtype=torch.float32)] * len(positions)
    cache.capture_states(key, positions, list(zip(emitted.conv, recurrent)))
    return out


def install_mixers(model: torch.nn.Module, variant: LinearVariant) -> None:
    """Patch every ``variant.mixer_class`` module of ``model`` (this instance only; idempotent) and route the
    recurrence functions of its modeling module (a pass-through outside this package's mixer calls)."""
    for module in model.modules():
        if variant.is_mixer(module):
            _compat.patch_instance_forward(module, functools.partial(_emitting_forward, variant))
            for kernel in variant.kernels:
                _compat.route_module_function(
                    type(module).__module__, kernel.function, functools.partial(route_recurrence, kernel)
                )
            fused_decode.route(type(module).__module__, variant.decode_functions)


def linear_layer_spec(layer_idx: int, mixer, variant: LinearVariant) -> MambaLayerSpec:
    """State of one mixer layer: conv state ``[C, W]`` in the dtype of the conv inputs and the recurrent state in
    float32 (the chunked and the per-token kernels keep it in float32 in every dtype), or none for a short conv."""
    if variant.conv_dtype is not None:
        conv_dtype = variant.conv_dtype(mixer)
    else:
        conv_dtype = next(p for name, p in mixer.named_parameters() if "conv" in name and name.endswith("weight")).dtype
    ssm = (
        NO_RECURRENT_STATE
        if variant.recurrent_shape is None
        else TensorSpec(variant.recurrent_shape(mixer), torch.float32)
    )
    conv = TensorSpec(variant.conv_shape(mixer), conv_dtype)
    return MambaLayerSpec(layer_idx, conv=conv, ssm=ssm, state_idx=variant.state_idx(mixer))


def state_spec(model: torch.nn.Module, block_size: int, variant: LinearVariant) -> ModelStateSpec:
    """Decoder layer ``i`` holding mixers or an attention module (or both) is cache layer ``i``; several mixers of one
    layer keep the states ``state_idx`` of that cache layer."""
    attention, linear = [], []
    for idx, layer in enumerate(_compat.decoder_layers(model)):
        mixers = [module for module in layer.modules() if variant.is_mixer(module)]
        attentions = [module for module in layer.modules() if variant.is_attention(module)]
        assert len(attentions) <= 1, f"layer {idx} holds several attention modules"
        assert len(mixers) <= 1 or variant.state_idx_attr, f"layer {idx} holds several mixers of one state"
        states = sorted((linear_layer_spec(idx, mixer, variant) for mixer in mixers), key=lambda m: m.state_idx)
        assert len({m.state_idx for m in states}) == len(states), f"layer {idx}: two mixers share a state_idx"
        linear.extend(states)
        if attentions:
            attention.append(variant.attention_spec(idx, attentions[0]))
    return ModelStateSpec(tuple(attention), tuple(linear), block_size)


def linear_attention_support(model_types: tuple[str, ...], variant: LinearVariant) -> ModelSupport:
    """The :class:`ModelSupport` of a linear-attention or short-conv hybrid family described by ``variant``."""
    return ModelSupport(
        model_types=model_types,
        install=functools.partial(install_mixers, variant=variant),
        state_spec=functools.partial(state_spec, variant=variant),
    )
