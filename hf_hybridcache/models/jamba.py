"""Jamba: attention and Mamba-1 layers (``JambaMambaMixer``), one state per Mamba layer.

transformers 5.23's mixer runs a multi-token forward through a selective scan that starts from a zero state, even
when the cache holds one (so chunked prefill and "reuse a prompt cache" are silently wrong for Jamba). The patched
mixer continues from the cached state and emits the states the prefix cache asks for, inside the same forward.

Upstream code mirrored: :func:`forward_from_state` copies the full-sequence path of ``JambaMambaMixer.forward`` in
``transformers/models/jamba/modeling_jamba.py`` (transformers 5.23.0). ``FalconMambaMixer.forward``
(``models/falcon_mamba/modeling_falcon_mamba.py``) is the same code, and ``MambaMixer.forward``
(``models/mamba/modeling_mamba.py``) the same without the dt/B/C RMS norms (:func:`selective_norms`), so
:mod:`.mamba` patches those mixers with these functions too. With no cached state and no checkpoint wanted
(a prompt that reaches no block boundary, a cache other than HybridPrefixCache) the original forward runs, so those
calls are bit-identical. A fresh prompt that reaches a block boundary wants checkpoints, so it runs the copy: its
outputs and states equal upstream's bit for bit under the ``"reference"`` kernel backend, and within fp32 round-off
(about 3e-7 on the tiny test models) under the default CPU scan, which reassociates the recurrence
(tests/test_upstream_mixers.py). Decode steps over a cached state run :func:`decode_step`, upstream's single-token
branch with the fused state updates of :mod:`hf_hybridcache.kernels.state_update` (fp32 round-off from upstream's;
upstream's own branch in reduced precision and under the ``"reference"`` backend).
"""

from __future__ import annotations

import torch

from .. import _compat
from ..config import MambaLayerSpec, ModelStateSpec, TensorSpec
from ..kernels import selective_scan
from ..kernels.state_update import causal_conv1d_update, selective_state_update
from .base import ModelSupport, attention_layer_spec
from .mamba1 import KERNELS, apply_padding_mask, causal_conv, conv_states_at, patch_mixers

MIXER_CLASS = "JambaMambaMixer"


def selective_norms(mixer, time_step: torch.Tensor, B: torch.Tensor, C: torch.Tensor):
    """The RMS norms on ``time_step`` ``[B, T, R]`` and ``B`` / ``C`` ``[B, T, N]`` of Jamba's and Falcon-Mamba's mixers
    (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``); Mamba's mixer has none and keeps them as they are."""
    if not hasattr(mixer, "dt_layernorm"):
        return time_step, B, C
    return mixer.dt_layernorm(time_step), mixer.b_layernorm(B), mixer.c_layernorm(C)


@_compat.force_accelerate_hooks(["conv1d", "dt_proj"])
def forward_from_state(mixer, hidden_states, cache, attention_mask, ssm_state, positions):
    """The full-sequence path of ``JambaMambaMixer.forward`` (``transformers/models/jamba/modeling_jamba.py``,
    transformers 5.23.0), starting from ``ssm_state`` and emitting checkpoints.

    Kept as upstream: the padding masks, ``in_proj``, the causal conv over ``cache.update_conv_state``'s output (the
    cached window + the new inputs), ``x_proj``, the dt/B/C RMS norms, the ``dt_proj`` matmul (and its quantized-model
    variant), ``D`` and the ``silu(gate)`` gate. Changed: ``mamba_selective_scan`` (which always starts from zeros)
    becomes :func:`~hf_hybridcache.kernels.selective_scan` with ``initial_state=ssm_state`` and
    ``emit_positions=positions``; the conv window and SSM state after each of ``positions`` tokens go to
    ``cache.capture_states``. Not copied: upstream's decode branch (``seq_len == 1``, handled by the original forward)
    and its ``use_mambapy`` / ``use_associative_scan`` alternatives to the sequential scan (both start from zeros).
    """
    layer_idx, seq_len, dtype = mixer.layer_idx, hidden_states.shape[1], hidden_states.dtype
    conv_state = cache.get_conv_state(layer_idx)
    hidden_states = apply_padding_mask(hidden_states, attention_mask)
    projected_states = mixer.in_proj(hidden_states).transpose(1, 2)
    A = -torch.exp(mixer.A_log.float())
    x, gate = projected_states.chunk(2, dim=1)

    conv_checkpoints = conv_states_at(x, conv_state, mixer.conv_kernel_size, positions)
    full_inputs = cache.update_conv_state(x, layer_idx, conv_kernel_size=mixer.conv_kernel_size)
    x = causal_conv(full_inputs, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.activation, seq_len)

    x = apply_padding_mask(x.transpose(1, 2), attention_mask)
    time_step, B, C = torch.split(
        mixer.x_proj(x), [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1
    )
    time_step, B, C = selective_norms(mixer, time_step, B, C)
    if hasattr(mixer.config, "_is_quantized"):
        time_step = (mixer.dt_proj(time_step) - mixer.dt_proj.bias).transpose(1, 2)
    else:
        time_step = mixer.dt_proj.weight @ time_step.transpose(1, 2)
    time_proj_bias = mixer.dt_proj.bias.float() if mixer.dt_proj.bias is not None else None

    y, final_state, ssm_checkpoints = selective_scan(
        x.transpose(1, 2),
        time_step,
        A,
        B.transpose(1, 2),
        C.transpose(1, 2),
        D=mixer.D.float(),
        z=gate,
        delta_bias=time_proj_bias,
        delta_softplus=True,
        initial_state=ssm_state,
        emit_positions=positions,
    )
    cache.update_recurrent_state(final_state, layer_idx)
    if positions:
        cache.capture_states(layer_idx, positions, list(zip(conv_checkpoints, ssm_checkpoints)))
    return mixer.out_proj(y.transpose(1, 2).to(dtype))


@_compat.force_accelerate_hooks(["conv1d", "dt_proj"])
def decode_step(mixer, hidden_states, cache, attention_mask):
    """The single-token path of ``JambaMambaMixer.forward`` (``modeling_jamba.py``, transformers 5.23.0) on
    ``hidden_states`` ``[B, 1, hidden]``, in place on the cached conv and SSM states; None (the original forward runs)
    when the cache holds no state yet, for a quantized model (whose ``dt_proj`` upstream calls as a module) and in
    reduced precision, where the reassociated products would round differently from upstream's decode (bf16
    replies must equal transformers' own decode token for token).

    Kept as upstream: the padding masks, the projections, the dt/B/C RMS norms, ``dt_proj``'s weight without its bias
    (which enters the state update as ``dt_bias``), ``D`` and the ``silu(gate)`` gate. Changed: the tokens stay 2D
    ``[B, I]`` (no transposes), upstream's ``causal_conv1d_update`` / ``mamba_selective_state_update`` torch fallbacks
    become :func:`~hf_hybridcache.kernels.state_update.causal_conv1d_update` /
    :func:`~hf_hybridcache.kernels.state_update.selective_state_update`, equal within fp32 round-off.
    """
    conv_state = cache.get_conv_state(mixer.layer_idx)
    ssm_state = cache.get_recurrent_state(mixer.layer_idx)
    if conv_state is None or ssm_state is None or hasattr(mixer.config, "_is_quantized"):
        return None
    if hidden_states.dtype != torch.float32 or mixer.in_proj.weight.dtype != torch.float32:
        return None
    dtype = hidden_states.dtype
    hidden_states = apply_padding_mask(hidden_states, attention_mask)
    x, gate = mixer.in_proj(hidden_states)[:, 0].chunk(2, dim=-1)
    x = causal_conv1d_update(x, conv_state, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.activation)
    _compat.count_decode_token(cache, mixer.layer_idx)
    if attention_mask is not None:
        x = apply_padding_mask(x[:, None], attention_mask)[:, 0]
    time_step, B, C = torch.split(
        mixer.x_proj(x), [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1
    )
    time_step, B, C = selective_norms(mixer, time_step, B, C)
    time_step = torch.nn.functional.linear(time_step, mixer.dt_proj.weight)
    y = selective_state_update(
        ssm_state,
        x,
        time_step,
        -torch.exp(mixer.A_log.float()),
        B,
        C,
        mixer.D,
        z=gate,
        dt_bias=mixer.dt_proj.bias.float() if mixer.dt_proj.bias is not None else None,
        dt_softplus=True,
    )
    return mixer.out_proj(y[:, None].to(dtype))


def install(model: torch.nn.Module) -> None:
    patch_mixers(model, MIXER_CLASS, forward_from_state, decode_step)


def state_spec(model: torch.nn.Module, block_size: int) -> ModelStateSpec:
    attention, mamba = [], []
    for idx, layer in enumerate(model.model.layers):
        if hasattr(layer, "mamba"):
            mixer = layer.mamba
            dtype = mixer.in_proj.weight.dtype
            mamba.append(
                MambaLayerSpec(
                    idx,
                    conv=TensorSpec((mixer.intermediate_size, mixer.conv_kernel_size), dtype),
                    ssm=TensorSpec((mixer.intermediate_size, mixer.ssm_state_size), torch.float32),
                )
            )
        else:
            attention.append(attention_layer_spec(idx, layer.self_attn))
    return ModelStateSpec(tuple(attention), tuple(mamba), block_size)


SUPPORT = ModelSupport(model_types=("jamba",), install=install, state_spec=state_spec, **KERNELS)
