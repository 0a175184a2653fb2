"""ZAYA's layers in deterministic mode (issue 46): its CCA projection and its router MLP's GELU.

- ``ZayaCCAProjection`` (``transformers/models/zaya/modeling_zaya.py``, 5.23.0 - 5.25.0) runs
  :func:`deterministic_forward`: upstream's forward with the q|k conv (a depthwise then a grouped conv over the
  cached window of raw q|k inputs) through
  :func:`~hf_hybridcache.kernels.zaya_invariant.cca_conv_invariant`, for a prefill, a chunk and a decode step alike
  (upstream runs ``F.conv1d`` twice, whose grouped sum takes another order with the call's length), and the key
  residual's mean over each key head's query group summed in group order in float32 and rounded once. Its q, k and
  the two value projections are ``nn.Linear`` modules (the row-invariant linear in the mode); the delayed value mixing
  (each value head's second half from the previous token's ``v_proj_delayed``, the cached one for a call's first
  token, ``v_proj_delayed`` of a zero row on a fresh prompt) is a concatenation, as upstream. q, k and v leave
  contiguous: the q/k L2 norm (``ZayaQKNorm``, upstream's) then reduces a token's head vector over a contiguous last
  dim whatever the call's length. What reaches the cache is what :mod:`.zaya` stores: the window of raw q|k inputs (in
  place on a decode step, counted as the package's decode steps count theirs) and the last token's delayed value,
  and at the checkpoint positions those after ``t`` tokens.
- ``ZayaRouterMLP``'s ``nn.GELU`` runs :func:`gelu_forward`: the erf form from ``torch.erf`` in float32
  (:func:`~hf_hybridcache.kernels.zaya_invariant.gelu_invariant`), rounded once to the input's dtype.

The attention (``ZayaAttention``: full and sliding-window layers) calls the attention function the mode routes to the
invariant attention (:mod:`.hybrid_deterministic`, the window handed over by upstream), its o_proj and the router's
linears are ``nn.Linear`` modules, its experts (``ZayaExperts``) run
:func:`~hf_hybridcache.models.moe_deterministic.zaya_experts_forward`; the router's softmax over its ``E + 1``
classes (a per-row reduction), top-k and skip-expert masking, the RMSNorms, the rotary embedding and the float32
residual stream with its scales run as upstream.

:data:`_OFF` is the private switch of the power tests: ``"conv"`` runs upstream's two ``F.conv1d`` over the cached
window (the module's ``conv_qk_depthwise`` and ``conv_qk_grouped``), ``"gelu"`` the router's ``nn.GELU``.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..kernels.zaya_invariant import cca_conv_invariant, gelu_invariance_failures, gelu_invariant
from .mamba1 import apply_padding_mask, checkpoint_positions, conv_states_at
from .mamba1_deterministic import lm_head_forward  # noqa: F401 (deterministic.install reads it from here)

#: Ingredients switched off (private: the power tests name them here; empty in use).
_OFF: set[str] = set()
#: The GELU probe's failures, measured once per process (:func:`refusal`).
_GELU_FAILURES: list[int] = []


@_compat.force_accelerate_hooks(["conv_qk_depthwise", "conv_qk_grouped"])  # their weights are read directly
def deterministic_forward(cca, hidden_states: torch.Tensor, cache, attention_mask: torch.Tensor | None):
    """The CCA projection's ``(query [B, T, H, D], key [B, T, Hkv, D], value [B, T, Hkv, D])`` (the dtype of
    ``hidden_states`` ``[B, T, hidden]``) for ``T >= 1`` tokens over ``cache`` (one of this package's caches, or the
    uncached stand-in), continuing from its q|k window and delayed value (zeros / a zero row's where it holds none)
    and leaving those after the last token there. ``attention_mask``: upstream's ``conv_mask`` ``[B, T]`` or None."""
    layer_idx, seq_len = cca.layer_idx, hidden_states.shape[1]
    conv_state = cache.get_conv_state(layer_idx)
    recurrent = cache.get_recurrent_state(layer_idx)
    decode = seq_len == 1 and conv_state is not None
    positions = () if decode else checkpoint_positions(cache, seq_len)
    hidden_states = apply_padding_mask(hidden_states, attention_mask)
    batch = hidden_states.shape[0]
    shape = (batch, seq_len, -1, cca.head_dim)
    queries, keys = cca.q_proj(hidden_states), cca.k_proj(hidden_states)
    qk = torch.cat([queries, keys], dim=-1).transpose(1, 2)  # [B, C, T]
    windows = conv_states_at(qk, conv_state, cca.conv_kernel_size, positions)
    mixed = _conv(cca, qk, conv_state, cache, decode).transpose(1, 2).contiguous()  # [B, T, C]
    query_residual, key_residual = _residuals(cca, queries.view(shape), keys.view(shape))
    query_size = query_residual.shape[-2] * query_residual.shape[-1]
    query = (mixed[..., :query_size].view(shape) + query_residual).contiguous()
    key = (mixed[..., query_size:].view(shape) + key_residual).contiguous()
    current, delayed = cca.v_proj_current(hidden_states), cca.v_proj_delayed(hidden_states)
    if recurrent is None:
        previous = cca.v_proj_delayed(hidden_states.new_zeros(batch, 1, hidden_states.shape[-1]))
    else:
        previous = recurrent.unsqueeze(1).to(delayed.dtype)
    value = torch.cat([current, torch.cat([previous, delayed[:, :-1]], dim=1)], dim=-1).view(shape).contiguous()
    cache.update_recurrent_state(delayed[:, -1, :], layer_idx)
    if positions:
        cache.capture_states(layer_idx, positions, list(zip(windows, [delayed[:, t - 1].clone() for t in positions])))
    return query, key, value


def _residuals(cca, queries: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's q/k residual paths for ``queries`` ``[B, T, H, D]`` / ``keys`` ``[B, T, Hkv, D]``: the query
    residual ``(q + k of the head's key head) * 0.5`` ``[B, T, H, D]`` and the key residual, its mean over each key
    head's ``H / Hkv`` query heads ``[B, T, Hkv, D]``, summed in group order in float32 and rounded once."""
    batch, seq_len, num_kv, head_dim = keys.shape
    groups = cca.num_key_value_groups
    repeated = keys[:, :, :, None].expand(batch, seq_len, num_kv, groups, head_dim)
    query_residual = (queries + repeated.reshape(queries.shape)) * 0.5
    grouped = query_residual.view(batch, seq_len, num_kv, groups, head_dim).float()
    total = grouped[:, :, :, 0]
    for group in range(1, groups):
        total = total + grouped[:, :, :, group]
    return query_residual, (total / groups).to(queries.dtype)


def _conv(cca, qk: torch.Tensor, conv_state: torch.Tensor | None, cache, decode: bool) -> torch.Tensor:
    """The mixed q|k ``[B, C, T]`` of the raw inputs ``qk`` ``[B, C, T]``; the window goes to the cache (in place for
    a decode step, which counts its token as the package's decode steps do)."""
    depthwise, grouped = cca.conv_qk_depthwise, cca.conv_qk_grouped
    if "conv" in _OFF:  # upstream's two conv1d over the window and the new inputs
        width = cca.conv_kernel_size
        before = qk.new_zeros(*qk.shape[:-1], width) if conv_state is None else conv_state.to(qk.dtype)
        inputs = torch.cat([before, qk], dim=-1)
        out, window = grouped(depthwise(inputs)), inputs[..., inputs.shape[-1] - width:]
    else:
        out, window = cca_conv_invariant(qk, conv_state, depthwise.weight, depthwise.bias, grouped.weight,
                                         grouped.bias, grouped.groups)
    if decode:
        conv_state.copy_(window)
        _compat.count_decode_token(cache, cca.layer_idx)
    else:
        cache.update_conv_state(qk, cca.layer_idx, conv_kernel_size=cca.conv_kernel_size)
    return out


def gelu_forward(module: torch.nn.Module, original, x: torch.Tensor) -> torch.Tensor:
    """``ZayaRouterMLP``'s ``nn.GELU()`` (erf form) of ``x`` (any shape, float dtype) through
    :func:`~hf_hybridcache.kernels.zaya_invariant.gelu_invariant` in float32, rounded once to ``x``'s dtype."""
    if "gelu" in _OFF:
        return original(x)
    return gelu_invariant(x.float()).to(x.dtype)


def refusal() -> str | None:
    """Why deterministic mode cannot hold for ZAYA here (``torch.erf`` gives a float32 element other bits alone than
    inside a tensor, so the router's GELU would move with a token's place), or None; probed once per process."""
    if not _GELU_FAILURES:
        _GELU_FAILURES.append(gelu_invariance_failures())
    failures = _GELU_FAILURES[0]
    if not failures:
        return None
    return (f"torch.erf gives {failures} of 64 float32 elements other bits alone than inside a tensor on this "
            "machine, so ZAYA's router GELU (kernels/zaya_invariant.gelu_invariant) has no invariant form here")
