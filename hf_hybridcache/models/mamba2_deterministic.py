"""The Mamba-2 mixer forward of deterministic mode (issue 46): one function for a prefill, a chunk of one and a decode
step, whose every op gives a token's row the same bits whatever shares its call and however the token arrived.

It is the chunk-form path of ``Mamba2Mixer.forward`` (``transformers/models/mamba2/modeling_mamba2.py``, 5.23.0 -
5.25.0; the package's copy is :func:`~hf_hybridcache.models.mamba2._forward_with_checkpoints`) with each op replaced by
its row-invariant ingredient:

- ``in_proj`` and ``out_proj`` (and the LM head, :func:`lm_head_forward`) through
  :func:`~hf_hybridcache.kernels.batch_invariant.invariant_linear`;
- the causal conv over the x/B/C channels through :func:`~hf_hybridcache.kernels.conv_invariant.causal_conv_invariant`,
  for a prefill over the cached window and for a decode step alike;
- the scan through :func:`~hf_hybridcache.kernels.mamba2_invariant.mamba2_scan_invariant`, whose prefill is the decode
  step's own call (:func:`~hf_hybridcache.kernels.mamba2_invariant.mamba2_step_invariant`) per token, with the heads
  of a group sharing its ``B`` / ``C``, ``dt_bias``, softplus, the ``time_step_limit`` clamp and the ``D`` skip;
  ``chunk_size`` plays no part (a token's arithmetic has no chunk grid);
- the gated RMSNorm through :func:`~hf_hybridcache.kernels.mamba2_invariant.gated_rms_norm_invariant` (upstream's
  gates with ``F.silu``, which is not row-invariant in float32 at every width);
- the block RMSNorms, the embeddings and the residual adds as upstream (measured row-invariant on this CPU).

The scan's output stays float32 into the norm, as the chunked scan's does on the package's default path. The padding
masks, the states' dtypes and what reaches the cache (the conv window of the x/B/C inputs, the float32 SSM state
``[B, H, P, N]``, the checkpoints after ``positions`` tokens) are those of :mod:`.mamba2`. Engine decode steps run the
products as :mod:`.mamba1_deterministic` does (small ones on one thread, wide ones on all).

:data:`_OFF` is the private switch of the power tests: an ingredient named there runs the package's default op
instead (``"linear"``: ``F.linear``; ``"conv"``: :func:`~hf_hybridcache.models.mamba2.causal_conv` / the fused conv
update; ``"scan"``: the chunked scan / the fused state update; ``"norm"``: the mixer's own ``Mamba2RMSNormGated``).
"""

from __future__ import annotations

import torch

from .. import _compat
from ..kernels import mamba2_chunk_scan
from ..kernels.mamba2_invariant import gated_rms_norm_invariant, mamba2_scan_invariant, mamba2_step_invariant
from ..kernels.state_update import causal_conv1d_update, mamba2_state_update
from .deterministic_linear import cached_states, conv_over_cache, routed_linear
from .mamba1 import apply_padding_mask, conv_states_at
from .mamba2 import causal_conv

#: Ingredients switched off (private: the power tests name them here; empty in use).
_OFF: set[str] = set()


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return routed_linear(x, weight, bias, off=_OFF)


def lm_head_forward(module: torch.nn.Linear, original, hidden_states: torch.Tensor) -> torch.Tensor:
    """The LM head (a ``torch.nn.Linear``) of a deterministic Mamba-2 model: ``[B, T, hidden] -> [B, T, V]`` through
    :func:`~hf_hybridcache.kernels.batch_invariant.invariant_linear`."""
    return _linear(hidden_states, module.weight, module.bias)


@_compat.force_accelerate_hooks(["conv1d"])
def deterministic_forward(mixer, hidden_states: torch.Tensor, cache, attention_mask: torch.Tensor | None, *,
                          project=None, gate_and_norm=None):
    """The mixer's output ``[B, T, hidden]`` (the dtype of ``hidden_states`` ``[B, T, hidden]``) for ``T >= 1`` tokens
    over ``cache`` (one of this package's caches: it answers ``checkpoint_positions``), continuing from its conv and
    SSM states (zeros where it holds none) and leaving the states after the last token there: a decode step
    (``T == 1`` over a held state) updates them in place, as the package's decode step does. ``attention_mask``:
    ``[B, T]`` (1 keeps a token) or None. A variant's hooks (Falcon-H1's, :mod:`.falcon_h1_deterministic`), each
    row-invariant: ``project(mixer, hidden_states) -> [B, T, gate + conv channels + H]`` in place of ``in_proj``
    through the row-invariant linear, ``gate_and_norm(mixer, y [B, T, I] float32, gate [B, T, I]) -> [B, T, I]`` in
    place of the gated RMSNorm.

    Raises:
        ValueError: the cached SSM state is not float32 (from the invariant step).
    """
    batch, seq_len, _ = hidden_states.shape
    layer_idx, dtype = mixer.layer_idx, hidden_states.dtype
    conv_state, ssm_state, decode, positions = cached_states(cache, layer_idx, seq_len)
    hidden_states = apply_padding_mask(hidden_states, attention_mask)
    projected = (project or _project)(mixer, hidden_states)
    gate, conv_inputs, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    conv_inputs = conv_inputs.transpose(1, 2)
    conv_checkpoints = conv_states_at(conv_inputs, conv_state, mixer.conv_kernel_size, positions)
    conv_out = _conv(mixer, conv_inputs, conv_state, cache, decode)
    conv_out = apply_padding_mask(conv_out.transpose(1, 2), attention_mask)  # [B, T, conv channels]
    state_channels = mixer.n_groups * mixer.ssm_state_size
    x, B, C = torch.split(conv_out, [mixer.intermediate_size, state_channels, state_channels], dim=-1)
    x = x.reshape(batch, seq_len, mixer.num_heads, mixer.head_dim)
    B = B.reshape(batch, seq_len, mixer.n_groups, mixer.ssm_state_size)
    C = C.reshape(batch, seq_len, mixer.n_groups, mixer.ssm_state_size)
    if decode:
        y = _step(mixer, ssm_state, x[:, 0], dt[:, 0], B[:, 0], C[:, 0])[:, None]
    else:
        y, final_state, ssm_checkpoints = _scan(mixer, x, dt, B, C, ssm_state, positions)
        cache.update_recurrent_state(final_state, layer_idx)
        if positions:
            cache.capture_states(layer_idx, positions, list(zip(conv_checkpoints, ssm_checkpoints)))
    y = (gate_and_norm or _gated_norm)(mixer, y.reshape(batch, seq_len, -1), gate)
    return _linear(y.to(dtype), mixer.out_proj.weight, mixer.out_proj.bias)


def _project(mixer, hidden_states: torch.Tensor) -> torch.Tensor:
    return _linear(hidden_states, mixer.in_proj.weight, mixer.in_proj.bias)


def _conv(mixer, x: torch.Tensor, conv_state: torch.Tensor | None, cache, decode: bool) -> torch.Tensor:
    """The conv output ``[B, C, T]`` of the raw conv inputs ``x`` ``[B, C, T]``; the window goes to the cache (in
    place for a decode step, which counts its token as the package's decode step does)."""
    weight, bias, layer_idx = mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.layer_idx
    if "conv" in _OFF:
        if decode:
            out = causal_conv1d_update(x[..., 0], conv_state, weight, bias, mixer.activation)[..., None]
            _compat.count_decode_token(cache, layer_idx)
            return out
        full = cache.update_conv_state(x, layer_idx, conv_kernel_size=mixer.conv_kernel_size)
        return causal_conv(full, mixer, x.shape[-1])
    return conv_over_cache(x, weight, bias, mixer.activation, conv_state, cache, layer_idx, mixer.conv_kernel_size,
                           decode)


def _step(mixer, state, x, dt, B, C) -> torch.Tensor:
    """One token in place on the cached SSM state ``[B, H, P, N]`` float32: ``x`` ``[B, H, P]``, ``dt``
    ``[B, H]``, ``B`` / ``C`` ``[B, G, N]``; returns ``y`` ``[B, H, P]`` (float32 but with ``"scan"`` off)."""
    A = -torch.exp(mixer.A_log.float())
    if "scan" in _OFF:
        P, N = mixer.head_dim, mixer.ssm_state_size
        return mamba2_state_update(state, x, dt[..., None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N), B,
                                   C, mixer.D[:, None].expand(-1, P), mixer.dt_bias[:, None].expand(-1, P), True)
    # x in float32, so y stays float32 into the norm, as the chunked scan's does
    return mamba2_step_invariant(state, x.float(), dt, A, B, C, mixer.D, mixer.dt_bias, True, mixer.time_step_limit)


def _scan(mixer, x, dt, B, C, ssm_state, positions):
    """``x`` ``[B, T, H, P]``, ``dt`` ``[B, T, H]``, ``B`` / ``C`` ``[B, T, G, N]``: the scan from
    ``ssm_state`` (None: zeros) -> ``(y [B, T, H, P] float32, final state, [state per position])``."""
    A = -torch.exp(mixer.A_log.float())
    kwargs = dict(D=mixer.D, dt_bias=mixer.dt_bias, dt_softplus=True, dt_limit=mixer.time_step_limit,
                  initial_state=ssm_state, emit_positions=positions)
    if "scan" in _OFF:
        return mamba2_chunk_scan(x, dt, A, B, C, chunk_size=mixer.chunk_size, **kwargs)
    return mamba2_scan_invariant(x.float(), dt, A, B, C, **kwargs)


def _gated_norm(mixer, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``y`` ``[B, T, I]`` float32 gated by ``gate`` ``[B, T, I]`` and normed per group -> ``[B, T, I]``."""
    if "norm" in _OFF:
        return mixer.norm(y, gate)
    norm = mixer.norm
    return gated_rms_norm_invariant(y, gate, norm.weight, norm.group_size, norm.variance_epsilon)
