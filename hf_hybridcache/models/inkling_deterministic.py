"""Inkling's layers in deterministic mode (issue 46): its short convolutions and its attention with relative logits.

- ``InklingShortConvolution`` (four per decoder layer: on the key and value projections before the KV cache, after
  the attention, after the MLP; ``transformers/models/inkling/modeling_inkling.py``, 5.23.0 - 5.25.0) runs
  :func:`deterministic_forward`: upstream's forward (in float32, the padding zeroed, a depthwise causal conv with no
  bias or activation, plus the float32 residual, rounded once to the input's dtype, made contiguous) with the conv
  through :func:`~hf_hybridcache.kernels.conv_invariant.causal_conv_invariant` over the window its ``conv_idx`` keeps, for a
  prefill and a decode step alike (upstream runs ``F.conv1d`` in one and a product with the window in the other).
  What reaches the cache is that window of raw float32 inputs, and at the checkpoint positions the window with an
  empty recurrent state, as :mod:`.linear_attention` stores Inkling's.
- ``InklingAttention`` runs :func:`attention_forward`: upstream's forward with its relative bias handed to the
  invariant attention with the layer's sliding window
  (:func:`~hf_hybridcache._compat.invariant_attention.invariant_attention_forward`, which adds it to the scores in
  float32). The q/k RMSNorms, the relative logits (``InklingRelativeLogits``: ``relative_states @ proj``, then a
  gather by distance), the logarithmic query scaling of the full-attention layers (``log_scaling_n_floor``) and the
  rest run as upstream, measured to give a query its bits in any call here: ``proj`` is a parameter that requires
  grad, so torch's ``matmul`` runs the batched product unfolded (a detached ``proj`` is folded into one
  ``[T * H, d_rel] @ [d_rel, rel_extent]`` product, which gave a float32 row other bits alone than among 93
  queries' rows); float32 ``torch.log`` gave 300 positions the same bits alone and together.

:data:`_OFF` is the private switch of the power tests: ``"conv"`` runs the package's default conv (``conv1d`` over the
cached window, the decode update), ``"contiguous"`` leaves a short convolution's output in the strides of its sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .. import _compat
from .._compat.invariant_attention import gated_attention_parts
from ..config import state_key
from .deterministic_linear import conv_over_cache
from .mamba1 import apply_padding_mask, checkpoint_positions, conv_states_at
from .mamba1_deterministic import lm_head_forward  # noqa: F401 (deterministic.install reads it from here)

#: The attention classes :func:`attention_forward` copies.
ATTENTION = ("InklingAttention",)
#: Ingredients switched off (private: the power tests name them here; empty in use).
_OFF: set[str] = set()


class ShortConvCall(NamedTuple):
    """A short conv's call over a cache, as its deterministic forwards (Inkling's, Inkling 2's) read it before the conv:
    the cache layer and conv state index, the kernel width, the held window ``[B, C, W]`` (None on a fresh prompt),
    whether the call is a decode step (one token over a held window), the checkpoint positions inside the call, the
    float32 input ``residual`` ``[B, T, C]``, its masked ``x`` ``[B, C, T]`` and the windows at those positions."""

    layer_idx: int
    state_idx: int
    width: int
    conv_state: torch.Tensor | None
    decode: bool
    positions: Sequence[int]
    residual: torch.Tensor
    x: torch.Tensor
    checkpoints: list

    def capture(self, cache) -> None:
        """Hand ``cache`` the windows at the checkpoint positions (a short conv keeps no SSM state)."""
        if self.positions:
            empty = self.x.new_zeros((self.x.shape[0], 0), dtype=torch.float32)
            cache.capture_states(state_key(self.layer_idx, self.state_idx), self.positions,
                                 [(conv, empty) for conv in self.checkpoints])


def short_conv_call(mixer, hidden_states: torch.Tensor, cache, attention_mask: torch.Tensor | None,
                    layer_idx: int | None = None) -> ShortConvCall:
    """:class:`ShortConvCall` of ``mixer`` (``conv_idx``, ``conv_kernel_size``) on ``hidden_states`` ``[B, T, C]`` in
    cache layer ``layer_idx`` (the mixer's own by default); ``attention_mask``: the padding mask ``[B, T]`` or None."""
    seq_len = hidden_states.shape[1]
    layer_idx = mixer.layer_idx if layer_idx is None else layer_idx
    state_idx, width = mixer.conv_idx, mixer.conv_kernel_size
    conv_state = cache.get_conv_state(layer_idx, state_idx=state_idx)
    decode = seq_len == 1 and conv_state is not None
    positions = () if decode else checkpoint_positions(cache, seq_len)
    residual = hidden_states.float()
    x = apply_padding_mask(residual, attention_mask).transpose(1, 2)  # [B, C, T] float32
    checkpoints = conv_states_at(x, conv_state, width, positions)
    return ShortConvCall(layer_idx, state_idx, width, conv_state, decode, positions, residual, x, checkpoints)


@_compat.force_accelerate_hooks(["conv1d"])
def deterministic_forward(mixer, hidden_states: torch.Tensor, cache, attention_mask: torch.Tensor | None):
    """A short convolution's output ``[B, T, C]`` (the dtype of ``hidden_states`` ``[B, T, C]``) for ``T >= 1``
    tokens over ``cache`` (one of this package's caches), continuing from the window its ``conv_idx`` keeps there
    (zeros where none) and leaving the window after the last token: in place on a decode step (``T == 1`` over a held
    window). ``attention_mask``: the padding mask ``[B, T]`` (Inkling's ``conv_mask``) or None."""
    call = short_conv_call(mixer, hidden_states, cache, attention_mask)
    weight, bias = mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias
    out = conv_over_cache(call.x, weight, bias, None, call.conv_state, cache, call.layer_idx, call.width, call.decode,
                          call.state_idx, off=_OFF)
    call.capture(cache)
    # Contiguous: the sum takes the transposed conv output's strides in a prefill, and the RMSNorm over the keys'
    # head dim (and the layer's norms) then reduced a prefill row in another order than a decode step's.
    out = (out.transpose(1, 2) + call.residual).to(hidden_states.dtype)
    return out if "contiguous" in _OFF else out.contiguous()


def attention_forward(module: torch.nn.Module, original, hidden_states: torch.Tensor, attention_mask=None,
                      conv_mask=None, **kwargs):
    """Inkling's attention ``(output [B, T, hidden], None)`` for ``hidden_states`` ``[B, T, hidden]``:
    ``InklingAttention.forward`` (transformers 5.23 - 5.25) with the ingredients of the module docstring; its key and
    value short convolutions are called as upstream calls them (and so run :func:`deterministic_forward`)."""
    cache, kwargs, _, attention, update = gated_attention_parts(module, kwargs)
    convs = {"conv_mask": conv_mask, _compat.CACHE_KWARG: cache}
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    query = module.q_norm(module.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key = module.k_norm(module.k_sconv(module.k_proj(hidden_states), **convs).view(hidden_shape)).transpose(1, 2)
    value = module.v_sconv(module.v_proj(hidden_states), **convs).view(hidden_shape).transpose(1, 2)
    relative = module.r_proj(hidden_states).view(*input_shape, module.num_heads, -1)
    q_length = query.shape[2]
    if cache is not None:
        kv_length, kv_offset = cache.get_mask_sizes(q_length, module.layer_idx)
        q_offset = cache.get_query_offset(module.layer_idx)
        key, value = update(key, value)
    else:
        kv_length, q_offset, kv_offset = key.shape[2], 0, 0
    q_positions = torch.arange(q_length, device=hidden_states.device) + q_offset
    kv_positions = torch.arange(kv_length, device=hidden_states.device) + kv_offset
    bias = module.rel_logits_proj(relative, q_positions, kv_positions)
    if not module.is_sliding and module.config.log_scaling_n_floor is not None:
        effective_n = (q_positions + 1).float()
        tau = 1.0 + module.config.log_scaling_alpha * torch.log(
            (effective_n / module.config.log_scaling_n_floor).clamp(min=1.0))
        tau = tau.view(1, 1, -1, 1)
        query = (query.float() * tau).to(query.dtype)
        bias = (bias.float() * tau).to(bias.dtype)
    dropout = module.attention_dropout if module.training else 0.0
    out, _ = attention(module, query, key, value, attention_mask, dropout=dropout, scaling=module.scaling,
                       sliding_window=module.sliding_window, position_bias=bias, **kwargs)
    return module.o_proj(out.reshape(*input_shape, -1).contiguous()), None
