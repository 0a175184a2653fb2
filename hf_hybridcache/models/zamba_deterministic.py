"""Deterministic mode's forward for Zamba's per-head Mamba-1 mixer (issue 46): :mod:`.mamba1_deterministic`'s
ingredients (the row-invariant linear, the invariant conv, the per-token scan and step, the same ``_OFF`` switch)
applied per head, as ``ZambaMambaMixer.forward`` (``transformers/models/zamba/modeling_zamba.py``, 5.23.0 - 5.25.0)
runs its heads. :data:`deterministic_forward` and :data:`lm_head_forward` are what
:data:`~hf_hybridcache.models.deterministic.SUPPORTED` reads.
"""

from __future__ import annotations

import torch

from .. import _compat
from .deterministic_linear import cached_states
from .mamba1 import apply_padding_mask, conv_states_at
from .mamba1_deterministic import conv, linear, lm_head_forward, ssm_scan, ssm_step

__all__ = ["deterministic_forward", "lm_head_forward"]


@_compat.force_accelerate_hooks(["conv1d"])
def deterministic_forward(mixer, hidden_states: torch.Tensor, cache, attention_mask: torch.Tensor | None):
    """:func:`~hf_hybridcache.models.mamba1_deterministic.deterministic_forward` for Zamba's per-head mixer
    (``ZambaMambaMixer``; the package's copy of its full-sequence path is
    :func:`~hf_hybridcache.models.zamba._forward_from_state`): the interleaved ``in_proj`` (even channels feed the
    conv, odd ones are the gate), one conv over all channels, then per head its own
    ``x_proj_weight`` / ``dt_proj_weight`` products through the row-invariant linear and its own invariant scan or step
    on its slice of the SSM state ``[B, H, I/H, N]`` float32. Same arguments, returns and raises."""
    layer_idx, (batch, seq_len, _), dtype = mixer.layer_idx, hidden_states.shape, hidden_states.dtype
    head_dim, sizes = mixer.mamba_head_dim, [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size]
    conv_state, ssm_state, decode, positions = cached_states(cache, layer_idx, seq_len)
    hidden_states = apply_padding_mask(hidden_states, attention_mask)
    projected = linear(hidden_states, mixer.in_proj.weight, mixer.in_proj.bias).transpose(1, 2)  # [B, 2I, T]
    x, gate = projected.reshape(batch, -1, 2, seq_len).unbind(2)
    conv_checkpoints = conv_states_at(x.contiguous(), conv_state, mixer.conv_kernel_size, positions)
    x = conv(mixer, x.contiguous(), conv_state, cache, decode)
    x = apply_padding_mask(x.transpose(1, 2), attention_mask)  # [B, T, I]
    A = -torch.exp(mixer.A_log.float())  # [H, I/H, N]
    outputs, finals, emitted = [], [], []
    for head in range(mixer.n_mamba_heads):
        part = slice(head * head_dim, (head + 1) * head_dim)
        time_step, B, C = torch.split(linear(x[..., part], mixer.x_proj_weight[head]), sizes, dim=-1)
        time_step = linear(time_step, mixer.dt_proj_weight[head])
        scan = dict(A=A[head], D=mixer.D[head].float(),
                    dt_bias=None if mixer.dt_proj_bias is None else mixer.dt_proj_bias[head].float())
        if decode:
            state = ssm_state[:, head]  # a view: the step updates the cached state in place
            outputs.append(ssm_step(state, x[:, 0, part], time_step[:, 0], B[:, 0], C[:, 0], gate[:, part, 0], scan))
            continue
        y, final_state, states = ssm_scan(x[..., part], time_step, B, C, gate[:, part],
                                          None if ssm_state is None else ssm_state[:, head], positions, scan)
        outputs.append(y)
        finals.append(final_state)
        emitted.append(states)
    if decode:
        y = torch.cat(outputs, dim=1)[:, :, None]
    else:
        y = torch.cat(outputs, dim=1)
        cache.update_recurrent_state(torch.stack(finals, dim=1), layer_idx)
        if positions:
            ssm_checkpoints = [torch.stack(per_head, dim=1) for per_head in zip(*emitted)]
            cache.capture_states(layer_idx, positions, list(zip(conv_checkpoints, ssm_checkpoints)))
    return linear(y.transpose(1, 2).to(dtype), mixer.out_proj.weight, mixer.out_proj.bias)
