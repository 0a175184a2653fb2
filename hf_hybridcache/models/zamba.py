"""Zamba: Mamba-1 layers (``ZambaMambaMixer``, split into ``n_mamba_heads`` independent heads) and a transformer block
shared by the "hybrid" layers (Glorioso et al. 2024, "Zamba: A Compact 7B SSM Hybrid Model").

Every layer has a Mamba mixer, so every layer index holds a conv state ``[B, I, W]`` and an SSM state ``[B, H, I/H, N]``
(heads stacked on dim 1). A hybrid layer first runs the shared transformer block, whose attention writes its KV to that
same layer index: transformers builds a combined cache layer there (attention KV + Mamba state), so a hybrid layer
index appears both among the attention layers and among the Mamba layers of the state spec.

transformers 5.23's mixer starts every multi-token forward from a zero SSM state, even over a cache that holds one
(the same root cause as Jamba's); the patched mixer continues from the cached state, one scan per head.

Upstream code mirrored: :func:`_forward_from_state` copies the full-sequence path of ``ZambaMambaMixer.forward`` in
``transformers/models/zamba/modeling_zamba.py`` (transformers 5.23.0). As for Jamba, calls with no cached state and no
checkpoint wanted run the original forward (bit-identical); a fresh prompt that reaches a block boundary runs the
copy, bit-identical to upstream under the ``"reference"`` kernel backend and within fp32 round-off under the default
CPU scan (tests/test_upstream_mixers.py).
"""

from __future__ import annotations

import torch

from .. import _compat
from ..config import MambaLayerSpec, ModelStateSpec, TensorSpec
from ..kernels import selective_scan
from .base import ModelSupport, attention_layer_spec
from .mamba1 import KERNELS, apply_padding_mask, causal_conv, conv_states_at, patch_mixers

MIXER_CLASS = "ZambaMambaMixer"


@_compat.force_accelerate_hooks(["conv1d"])
def _forward_from_state(mixer, hidden_states, cache, attention_mask, ssm_state, positions):
    """The full-sequence path of ``ZambaMambaMixer.forward`` (``transformers/models/zamba/modeling_zamba.py``,
    transformers 5.23.0), starting from ``ssm_state`` ``[B, H, I/H, N]`` and emitting checkpoints.

    Kept as upstream: the padding masks, the interleaved ``in_proj`` split into conv inputs and gate, the causal conv
    over ``cache.update_conv_state``'s output, the per-head ``x_proj_weight`` / ``dt_proj_weight`` matmuls, ``D`` and
    the ``silu(gate)`` gate, one scan per head. Changed: each head's ``mamba_selective_scan`` (zero start) becomes
    :func:`~hf_hybridcache.kernels.selective_scan` from that head's slice of ``ssm_state``, emitting the states after
    ``positions`` tokens, which are stacked per head (dim 1, as upstream stacks the final states) and handed to
    ``cache.capture_states`` with the conv windows. Not copied: the decode branch (``seq_len == 1``, handled by the
    original forward), the ``use_associative_scan`` alternative, and the ``seq_idx`` kwarg upstream forwards to
    ``causal_conv1d_fn`` (read only by the ``causal-conv1d`` kernel, never by its torch fallback).
    """
    batch_size, seq_len, _ = hidden_states.shape
    layer_idx, dtype = mixer.layer_idx, hidden_states.dtype
    heads, head_dim = mixer.n_mamba_heads, mixer.mamba_head_dim
    conv_state = cache.get_conv_state(layer_idx)
    hidden_states = apply_padding_mask(hidden_states, attention_mask)
    projected_states = mixer.in_proj(hidden_states).transpose(1, 2)
    # Zamba's in_proj interleaves the channels: even ones feed the conv, odd ones are the gate.
    x, gate = projected_states.view(batch_size, -1, 2, seq_len).chunk(2, dim=2)
    x = x.squeeze(2).contiguous()
    gate = gate.reshape(batch_size, heads, head_dim, seq_len).transpose(0, 1)

    conv_checkpoints = conv_states_at(x, conv_state, mixer.conv_kernel_size, positions)
    full_inputs = cache.update_conv_state(x, layer_idx, conv_kernel_size=mixer.conv_kernel_size)
    x = causal_conv(full_inputs, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.activation, seq_len)
    x = apply_padding_mask(x.transpose(1, 2), attention_mask).transpose(1, 2)
    x = x.reshape(batch_size, heads, head_dim, seq_len).transpose(0, 1)

    time_step, B, C = torch.split(
        (mixer.x_proj_weight[:, None] @ x).transpose(-1, -2),
        [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size],
        dim=-1,
    )
    time_step = mixer.dt_proj_weight[:, None] @ time_step.transpose(-1, -2)
    time_proj_bias = mixer.dt_proj_bias.float() if mixer.dt_proj_bias is not None else None
    A = -torch.exp(mixer.A_log.float())

    outputs, final_states, emitted = [], [], []
    for head in range(heads):
        y, final_state, states = selective_scan(
            x[head],
            time_step[head],
            A[head],
            B[head].transpose(1, 2),
            C[head].transpose(1, 2),
            D=mixer.D[head].float(),
            z=gate[head],
            delta_bias=time_proj_bias[head] if time_proj_bias is not None else None,
            delta_softplus=True,
            initial_state=ssm_state[:, head] if ssm_state is not None else None,
            emit_positions=positions,
        )
        outputs.append(y)
        final_states.append(final_state)
        emitted.append(states)
    cache.update_recurrent_state(torch.stack(final_states, dim=1), layer_idx)
    if positions:
        ssm_checkpoints = [torch.stack(per_head, dim=1) for per_head in zip(*emitted)]
        cache.capture_states(layer_idx, positions, list(zip(conv_checkpoints, ssm_checkpoints)))
    return mixer.out_proj(torch.cat(outputs, dim=1).transpose(1, 2).to(dtype))


def install(model: torch.nn.Module) -> None:
    patch_mixers(model, MIXER_CLASS, _forward_from_state)


def state_spec(model: torch.nn.Module, block_size: int) -> ModelStateSpec:
    attention, mamba = [], []
    for idx, layer in enumerate(model.model.layers):
        if hasattr(layer, "shared_transf"):
            attention.append(attention_layer_spec(idx, layer.shared_transf.self_attn))
            layer = layer.mamba_decoder
        mixer = layer.mamba
        mamba.append(
            MambaLayerSpec(
                idx,
                conv=TensorSpec((mixer.intermediate_size, mixer.conv_kernel_size), mixer.in_proj.weight.dtype),
                ssm=TensorSpec((mixer.n_mamba_heads, mixer.mamba_head_dim, mixer.ssm_state_size), torch.float32),
            )
        )
    return ModelStateSpec(tuple(attention), tuple(mamba), block_size)


SUPPORT = ModelSupport(model_types=("zamba",), install=install, state_spec=state_spec, **KERNELS)
