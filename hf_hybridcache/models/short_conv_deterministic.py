"""The short-conv mixer forward of deterministic mode (issue 46): one function for a prefill, a chunk of one, a decode
step and a speculative verify group, whose every op gives a token's row the same bits whatever shares its call and
however the token arrived.

It is ``Lfm2ShortConv.forward`` (``transformers/models/lfm2/modeling_lfm2.py``, 5.23.0 - 5.25.0) with each op
replaced by its row-invariant ingredient:

- ``in_proj`` and ``out_proj`` (with their bias where ``conv_bias``) through
  :func:`~hf_hybridcache.kernels.batch_invariant.invariant_linear` (as :mod:`.mamba1_deterministic` runs them);
- the depthwise causal conv over ``B * x`` (no activation, the conv's bias where ``conv_bias``) through
  :func:`~hf_hybridcache.kernels.conv_invariant.causal_conv_invariant`, for a prefill over the cached window and for a
  decode step alike (upstream runs ``F.conv1d`` in one and a product with the window in the other);
- the gates ``B * x`` and ``C * conv`` elementwise in the model's dtype, as upstream (one rounded product per element:
  the same bits at any offset).

There is no recurrence: what reaches the cache is the conv window of the ``B * x`` inputs (in place on a decode step,
counted as upstream's decode step counts it) and, at the checkpoint ``positions``, that window with an empty recurrent
state ``[B, 0]`` float32, as :mod:`.linear_attention` stores a short conv's checkpoints.

:data:`_OFF` is the private switch of the power tests: an ingredient named there runs the package's default op instead
(``"linear"``: ``F.linear``; ``"conv"``: :func:`~hf_hybridcache.models.mamba1.causal_conv` over the cached window /
the conv update :func:`~hf_hybridcache.kernels.state_update.causal_conv1d_update`; ``"gate"``: LFM3's head gate as
``torch.sigmoid``).

LFM3 (``Lfm3ShortConv`` is the same mixer) gates its attention per head after the attention:
:func:`head_gated_forward` is ``Lfm3Attention.forward`` with that gate from ``exp`` and its sliding window handed to
the attention function.
"""

from __future__ import annotations

import torch

from .. import _compat
from .._compat.invariant_attention import gated_attention_parts
from ..kernels.gated_delta_invariant import sigmoid_invariant
from . import mamba1_deterministic
from .deterministic_linear import conv_over_cache, routed_linear
from .mamba1 import apply_padding_mask, checkpoint_positions, conv_states_at
from .mamba1_deterministic import lm_head_forward  # noqa: F401 (deterministic.install reads it from here)

#: Ingredients switched off (private: the power tests name them here; empty in use).
_OFF: set[str] = set()


def _linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    # mamba1_deterministic's switch also holds these products (its "linear" switches every mixer built on it)
    return routed_linear(x, layer.weight, layer.bias, off=_OFF | mamba1_deterministic._OFF)


@_compat.force_accelerate_hooks(["conv"])
def deterministic_forward(mixer, hidden_states: torch.Tensor, cache, attention_mask: torch.Tensor | None):
    """The mixer's output ``[B, T, hidden]`` (the dtype of ``hidden_states`` ``[B, T, hidden]``) for ``T >= 1`` tokens
    over ``cache`` (one of this package's caches: it answers ``checkpoint_positions``), continuing from its conv window
    (zeros where it holds none) and leaving the window after the last token there: a decode step (``T == 1`` over a
    held window) updates it in place. ``attention_mask``: ``[B, T]`` (1 keeps a token) or None."""
    seq_len = hidden_states.shape[1]
    layer_idx = mixer.layer_idx
    conv_state = cache.get_conv_state(layer_idx)
    decode = seq_len == 1 and conv_state is not None
    positions = () if decode else checkpoint_positions(cache, seq_len)
    hidden_states = apply_padding_mask(hidden_states, attention_mask)
    b, c, x = _linear(hidden_states, mixer.in_proj).transpose(-1, -2).chunk(3, dim=-2)
    bx = b * x  # [B, C, T]
    conv_checkpoints = conv_states_at(bx, conv_state, mixer.conv_kernel_size, positions)
    y = c * _conv(mixer, bx, conv_state, cache, decode)
    if positions:
        empty = bx.new_zeros((bx.shape[0], 0), dtype=torch.float32)
        cache.capture_states(layer_idx, positions, [(conv, empty) for conv in conv_checkpoints])
    return _linear(y.transpose(-1, -2).contiguous(), mixer.out_proj)


def _conv(mixer, x: torch.Tensor, conv_state: torch.Tensor | None, cache, decode: bool) -> torch.Tensor:
    """The conv output ``[B, C, T]`` of the raw conv inputs ``x`` ``[B, C, T]``; the window goes to the cache (in
    place for a decode step, which counts its token as upstream's decode step does)."""
    return conv_over_cache(x, mixer.conv.weight.squeeze(1), mixer.conv.bias, None, conv_state, cache, mixer.layer_idx,
                           mixer.conv_kernel_size, decode, off=_OFF)


def head_gated_forward(module: torch.nn.Module, original, hidden_states: torch.Tensor,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask=None, **kwargs):
    """LFM3's attention ``(output [B, T, hidden], None)`` for ``hidden_states`` ``[B, T, hidden]`` and the rotary
    ``(cos, sin)`` (float32): ``Lfm3Attention.forward`` (transformers 5.23 - 5.25), its sliding window handed to the
    attention function and its per-head gate ``sigmoid(g_proj(x))`` through
    :func:`~hf_hybridcache.kernels.gated_delta_invariant.sigmoid_invariant` in float32, rounded once to the gate's
    dtype."""
    cache, kwargs, apply_rotary, attention, update = gated_attention_parts(module, kwargs)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    query = module.q_norm(module.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key = module.k_norm(module.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    query, key = apply_rotary(query, key, *position_embeddings)
    if cache is not None:
        key, value = update(key, value)
    dropout = module.attention_dropout if module.training else 0.0
    out, _ = attention(module, query, key, value, attention_mask, dropout=dropout, scaling=module.scaling,
                       sliding_window=module.sliding_window, **kwargs)
    if module.g_proj is not None:
        gate = module.g_proj(hidden_states)
        gated = torch.sigmoid(gate) if "gate" in _OFF else sigmoid_invariant(gate.float()).to(gate.dtype)
        out = out * gated.unsqueeze(-1)
    return module.o_proj(out.reshape(*input_shape, -1).contiguous()), None
