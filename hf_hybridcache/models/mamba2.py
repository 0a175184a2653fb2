"""Shared Mamba-2 pieces: the patched mixer forward that emits checkpoints, and the per-layer state specs.

transformers 5.23's Mamba-2 mixers (Zamba2, Falcon-H1, Bamba, GraniteMoeHybrid, NemotronH) already continue from a
cached state on a multi-token forward: the causal conv runs over the cached conv window + the new inputs, and the
chunked scan takes the cached SSM state as ``initial_states``. What they cannot do is hand out the state at a block
boundary inside the forward. The patched mixer therefore calls the original forward whenever no checkpoint is wanted
(bit-identical), and otherwise runs the same chunk path through :func:`~hf_hybridcache.kernels.mamba2_chunk_scan`,
which emits the states at arbitrary token positions; its outputs equal the original's. A float32 prefill on CPU
always runs the package's path, in chunks of at most :data:`CPU_CHUNK_SIZE` tokens: checkpoints' 256-token chunk
(the CUDA kernels' tile) is the slowest choice for the torch scan (an 8-token prompt paid for 256).

The mixers differ only in how the input projection is scaled and how the gate and norm are applied after the scan,
so a family file is a :class:`Mamba2Variant` handed to :func:`mamba2_support`.

Upstream code mirrored (transformers 5.23.0): :func:`_forward_with_checkpoints` copies the chunk-form path of
``Zamba2MambaMixer.forward`` in ``transformers/models/zamba2/modeling_zamba2.py``. ``BambaMixer.forward``
(``models/bamba/modeling_bamba.py``), ``GraniteMoeHybridMambaLayer.forward``
(``models/granitemoehybrid/modeling_granitemoehybrid.py``) and ``NemotronHMamba2Mixer.forward``
(``models/nemotron_h/modeling_nemotron_h.py``) are line for line the same code in 5.23.0; ``FalconH1Mixer.forward``
(``models/falcon_h1/modeling_falcon_h1.py``) differs only where :mod:`.falcon_h1` supplies its own
``project`` / ``gate_and_norm``. :func:`causal_conv` is the torch fallback of ``causal_conv1d_fn`` (identical in those
five files). On CPU the copy's outputs and final states are bit-identical to upstream's, on a fresh prompt and from a
cached state (tests/test_mamba2.py, tests/test_upstream_mixers.py); the states emitted at interior positions equal
upstream's state after a forward of that prefix within fp32 round-off.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from .. import _compat
from ..config import MambaLayerSpec, ModelStateSpec, TensorSpec
from ..kernels import mamba2_chunk_scan
from . import fused_decode
from .base import ModelSupport, attention_layer_spec
from .mamba1 import apply_padding_mask, checkpoint_positions, conv_states_at, deterministic_over


def causal_conv(full_inputs: torch.Tensor, mixer, seq_len: int) -> torch.Tensor:
    """The mixer's depthwise causal conv + activation over ``full_inputs`` ``[B, C, W' + T]`` (cached window + new
    inputs); returns the last ``seq_len`` outputs ``[B, C, T]`` in the inputs' dtype. The activation runs on the
    same (strided) view as in transformers' ``causal_conv1d_fn``: CPU kernels round differently on contiguous and
    strided inputs, and the outputs must stay bit-identical.

    Mirrors ``causal_conv1d_fn``'s torch fallback (``modeling_zamba2.py`` and its copies, transformers 5.23.0) on the
    output of ``update_conv_state``, then the mixers' ``[:, :, -seq_len:]`` slice."""
    weight = mixer.conv1d.weight.squeeze(1)
    length = full_inputs.shape[-1]
    out = F.conv1d(
        full_inputs.to(weight.dtype),
        weight.unsqueeze(1),
        mixer.conv1d.bias,
        padding=weight.shape[-1] - 1,
        groups=weight.shape[0],
    )[:, :, :length]
    out = ACT2FN[mixer.activation](out).to(full_inputs.dtype)
    return out[:, :, -seq_len:]


def _plain_projection(mixer, hidden_states: torch.Tensor) -> torch.Tensor:
    return mixer.in_proj(hidden_states)


def _gated_norm(mixer, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return mixer.norm(y, gate)


@dataclass(frozen=True)
class Mamba2Variant:
    """One family's Mamba-2 mixer and attention classes, and how its mixer differs from the plain one (the plain one
    is shared by Zamba2, Bamba, GraniteMoeHybrid and NemotronH).

    Attributes:
        mixer_class: class name of the Mamba-2 mixer (matched by name, so no model module is imported).
        attention_class: class name of the attention module whose KV the cache layer of the same index holds; None
            for a model without attention layers (Mamba-2 itself).
        project: ``(mixer, hidden_states [B, T, hidden]) -> [B, T, gate + conv channels + H]``, the input projection
            of the padding-masked hidden states.
        gate_and_norm: ``(mixer, y [B, T, H*D] float32, gate [B, T, H*D]) -> [B, T, H*D]``, applied after the scan.
    """

    mixer_class: str
    attention_class: str | None
    project: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = _plain_projection
    gate_and_norm: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = _gated_norm


@_compat.force_accelerate_hooks(["conv1d"])
def _forward_with_checkpoints(
    mixer,
    variant: Mamba2Variant,
    hidden_states: torch.Tensor,
    cache,
    attention_mask: torch.Tensor | None,
    positions: Sequence[int],
) -> torch.Tensor:
    """The chunk-form path of ``Zamba2MambaMixer.forward`` (``transformers/models/zamba2/modeling_zamba2.py``,
    transformers 5.23.0, shared line for line by Bamba, GraniteMoeHybrid and NemotronH; Falcon-H1 through
    ``variant``), from the cached state, handing the conv and SSM states after each of ``positions`` tokens to
    ``cache.capture_states``.

    Kept as upstream: the padding masks, the projection and its split into gate / conv inputs / dt, the causal conv
    over ``cache.update_conv_state``'s output, the x/B/C split, the chunked scan from ``initial_states`` = the cached
    SSM state with ``D``, ``dt_bias``, softplus and ``time_step_limit``, the gate and norm, ``out_proj``. Changed:
    upstream's ``mamba2_chunk_scan`` becomes :func:`~hf_hybridcache.kernels.mamba2_chunk_scan`, which also returns the
    states after ``positions`` tokens; the conv windows at those positions are cut from the inputs. Not copied: the
    decode branch (``seq_len == 1``) and the training-only fused kernel path, both left to the original forward.
    """
    batch_size, seq_len, _ = hidden_states.shape
    dtype, layer_idx = hidden_states.dtype, mixer.layer_idx
    conv_state = cache.get_conv_state(layer_idx)
    ssm_state = cache.get_recurrent_state(layer_idx)

    projected = variant.project(mixer, apply_padding_mask(hidden_states, attention_mask))
    gate, conv_inputs, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    conv_inputs = conv_inputs.transpose(1, 2)
    conv_checkpoints = conv_states_at(conv_inputs, conv_state, mixer.conv_kernel_size, positions)
    full_inputs = cache.update_conv_state(conv_inputs, layer_idx, conv_kernel_size=mixer.conv_kernel_size)
    conv_out = causal_conv(full_inputs, mixer, seq_len)
    conv_out = apply_padding_mask(conv_out.transpose(1, 2), attention_mask)

    state_channels = mixer.n_groups * mixer.ssm_state_size
    x, B, C = torch.split(conv_out, [mixer.intermediate_size, state_channels, state_channels], dim=-1)
    y, final_state, ssm_checkpoints = mamba2_chunk_scan(
        x.reshape(batch_size, seq_len, mixer.num_heads, mixer.head_dim),
        dt,
        -torch.exp(mixer.A_log.float()),
        B.reshape(batch_size, seq_len, mixer.n_groups, mixer.ssm_state_size),
        C.reshape(batch_size, seq_len, mixer.n_groups, mixer.ssm_state_size),
        chunk_size=scan_chunk_size(mixer.chunk_size, x.device),
        D=mixer.D,
        dt_bias=mixer.dt_bias,
        dt_softplus=True,
        dt_limit=mixer.time_step_limit,
        initial_state=ssm_state,
        emit_positions=positions,
    )
    cache.update_recurrent_state(final_state, layer_idx)
    cache.capture_states(layer_idx, positions, list(zip(conv_checkpoints, ssm_checkpoints)))
    y = variant.gate_and_norm(mixer, y.reshape(batch_size, seq_len, -1), gate)
    return mixer.out_proj(y.to(dtype))


def _checkpointing_forward(variant: Mamba2Variant, mixer, original, *args, **kwargs):
    args, kwargs = _compat.with_local_mixer_mask(args, kwargs)  # Mamba-2's model hands over its whole mask
    hidden_states, cache, attention_mask = _compat.split_mixer_call(args, kwargs)
    seq_len = hidden_states.shape[1]
    # A training forward (training mode with autograd) runs upstream's code. Without autograd the mode changes nothing
    # here (the mixer has no dropout; upstream's fused training kernel runs only without a cache), so a rollout of a
    # model in training mode hands its checkpoints over as in eval mode; whether anything is stored is the caller's
    # decision (_compat.uncached_cause: dropout elsewhere in the model).
    deterministic = deterministic_over(mixer, cache)  # set by deterministic mode's install
    training = mixer.training and torch.is_grad_enabled()
    if deterministic is not None and not training and (cache is None or not cache.is_recording_past(mixer.layer_idx)):
        forward, over = deterministic
        return forward(mixer, hidden_states, over, attention_mask)
    if cache is None or training or cache.is_recording_past(mixer.layer_idx):
        return original(*args, **kwargs)
    if seq_len == 1:
        if not fused_decode.wanted(hidden_states, cache):
            return original(*args, **kwargs)
        with fused_decode.fused():  # upstream's single-token branch over the fused state updates
            return original(*args, **kwargs)
    positions = checkpoint_positions(cache, seq_len)
    if not positions and not _float32_cpu_over_ours(hidden_states, cache):
        return original(*args, **kwargs)
    return _forward_with_checkpoints(mixer, variant, hidden_states, cache, attention_mask, positions)


def _float32_cpu_over_ours(hidden_states: torch.Tensor, cache) -> bool:
    """A float32 CPU prefill over one of this package's caches (they answer ``checkpoint_positions``; another cache
    runs upstream's forward)."""
    return (hidden_states.device.type == "cpu" and hidden_states.dtype == torch.float32
            and hasattr(cache, "checkpoint_positions"))


#: The longest chunk the chunked scan runs on CPU. Upstream's Mamba-2 checkpoints ship ``chunk_size`` 256 (the tile of
#: the CUDA kernels); on CPU the torch scan's intra-chunk ``[L, L]`` terms make that the slowest choice: one layer of
#: ``state-spaces/mamba2-130m``'s shape (24 heads of 64, state 128) took 67.5 ms for an 8-token prompt at 256 and
#: 7.2 ms at 64, 127 / 28 ms for 300 tokens and 284 / 162 ms for 1,024 (2-core CPU). Any chunk size gives the same
#: result up to float32 round-off.
CPU_CHUNK_SIZE = 64


def scan_chunk_size(chunk_size: int, device: torch.device) -> int:
    """The chunk the package's scan runs for a mixer of ``chunk_size`` on ``device``: at most
    :data:`CPU_CHUNK_SIZE` on CPU, ``chunk_size`` elsewhere (the Triton kernel's tile)."""
    return min(chunk_size, CPU_CHUNK_SIZE) if device.type == "cpu" else chunk_size


#: The single-token functions the Mamba-2 mixers call on a decode step (:mod:`hf_hybridcache.models.fused_decode`).
DECODE_FUNCTIONS = ("causal_conv1d_update", "mamba2_selective_state_update")


def install_mixers(model: torch.nn.Module, variant: Mamba2Variant) -> None:
    """Patch every ``variant.mixer_class`` module of ``model`` (this instance only; idempotent)."""
    for module in model.modules():
        if type(module).__name__ == variant.mixer_class:
            _compat.patch_instance_forward(module, functools.partial(_checkpointing_forward, variant))
            fused_decode.route(type(module).__module__, DECODE_FUNCTIONS)


def mamba_layer_spec(layer_idx: int, mixer) -> MambaLayerSpec:
    """State of one Mamba-2 layer: conv state ``[conv channels, W]`` in the model dtype and SSM state
    ``[H, D, N]`` in float32 (the chunked scan and the decode step keep it in float32 in every dtype)."""
    return MambaLayerSpec(
        layer_idx,
        conv=TensorSpec((mixer.conv_dim, mixer.conv_kernel_size), mixer.in_proj.weight.dtype),
        ssm=TensorSpec((mixer.num_heads, mixer.head_dim, mixer.ssm_state_size), torch.float32),
    )


def state_spec(model: torch.nn.Module, block_size: int, variant: Mamba2Variant) -> ModelStateSpec:
    """Decoder layer ``i`` (``model.model.layers[i]``; ``model.backbone.layers[i]`` in Mamba-2) holding a mixer or an
    attention module (or both: Zamba2's hybrid layers, every Falcon-H1 layer) is cache layer ``i``, as transformers'
    ``layer_types`` lay it out."""
    attention, mamba = [], []
    for idx, layer in enumerate(_compat.decoder_layers(model)):
        mixers = [module for module in layer.modules() if type(module).__name__ == variant.mixer_class]
        attentions = [module for module in layer.modules() if type(module).__name__ == variant.attention_class]
        assert len(mixers) <= 1 and len(attentions) <= 1, f"layer {idx} holds several mixers or attention modules"
        if mixers:
            mamba.append(mamba_layer_spec(idx, mixers[0]))
        if attentions:
            attention.append(attention_layer_spec(idx, attentions[0]))
    return ModelStateSpec(tuple(attention), tuple(mamba), block_size)


def mamba2_support(model_types: tuple[str, ...], variant: Mamba2Variant) -> ModelSupport:
    """The :class:`ModelSupport` of a Mamba-2 hybrid family described by ``variant``."""
    return ModelSupport(
        model_types=model_types,
        install=functools.partial(install_mixers, variant=variant),
        state_spec=functools.partial(state_spec, variant=variant),
        scan="prefills that store checkpoints (and every float32 prefill on CPU, in chunks of at most "
             f"{CPU_CHUNK_SIZE} tokens) run hf_hybridcache's Mamba-2 chunked scan",
        scan_kernels=("mamba_chunk_scan_combined", "causal_conv1d_fn"),
        kernel_packages=("mamba-ssm", "causal-conv1d"),
    )
