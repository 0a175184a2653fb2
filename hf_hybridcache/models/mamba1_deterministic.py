"""The Mamba-1 mixer forward of deterministic mode (issue 46): one function for a prefill, a chunk of one and a decode
step, whose every op gives a token's row the same bits whatever shares its call and however the token arrived.

It is the full-sequence path of ``MambaMixer.forward`` / ``FalconMambaMixer.forward``
(``transformers/models/mamba/modeling_mamba.py``, ``models/falcon_mamba/modeling_falcon_mamba.py``, 5.23.0 - 5.25.0;
the package's copy is :func:`~hf_hybridcache.models.jamba.forward_from_state`) with each op replaced by its
row-invariant ingredient:

- ``in_proj``, ``x_proj``, ``dt_proj`` (its weight; the bias enters the step as ``dt_bias``, as upstream's decode
  passes it) and ``out_proj`` through :func:`~hf_hybridcache.kernels.batch_invariant.invariant_linear`;
- the causal conv through :func:`~hf_hybridcache.kernels.conv_invariant.causal_conv_invariant`, for a prefill over the
  cached window and for a decode step alike;
- the scan through :func:`~hf_hybridcache.kernels.mamba1_invariant.selective_scan_invariant`, whose prefill is the
  decode step's own call (:func:`~hf_hybridcache.kernels.mamba1_invariant.selective_step_invariant`) per token;
- Falcon-Mamba's weightless dt/B/C RMS norms as upstream runs them (measured row-invariant on this CPU: a row is
  reduced alone whatever the row count, ``benchmarks/batch_invariance.py``).

In an engine decode step the elementwise ops run on one intra-op thread
(:func:`~hf_hybridcache.models.decode_linear.decode_threads`; an element's IEEE result does not depend on the thread
that computes it, and each reduction here is over one row's last dim), and so do the products of the weights the
package's decode route leaves alone (small or wide ones, probed equal on one thread and on all at construction); the
others run on all threads, as in a prefill.

The padding masks, the states' dtypes and what reaches the cache (the conv window, the float32 SSM state, the
checkpoints after ``positions`` tokens) are those of the package's other paths. :data:`_OFF` is the private switch of
the power tests: an ingredient named there runs the package's default op instead (``"linear"``: ``F.linear``;
``"conv"``: :func:`~hf_hybridcache.models.mamba1.causal_conv` / the fused conv update; ``"scan"``: the chunked scan /
the fused state update), so a test can show which case each ingredient holds.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..kernels import selective_scan
from ..kernels.mamba1_invariant import selective_scan_invariant, selective_step_invariant
from ..kernels.state_update import selective_state_update
from .deterministic_linear import cached_states, conv_over_cache, routed_linear
from .jamba import selective_norms
from .mamba1 import apply_padding_mask, conv_states_at

#: Ingredients switched off (private: the power tests name them here; empty in use).
_OFF: set[str] = set()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``x`` ``[..., in]``, ``weight`` ``[out, in]``, ``bias`` ``[out]`` or None) ->
    ``[..., out]``, row-invariant (:func:`~hf_hybridcache.models.deterministic_linear.routed_linear`) unless this
    module's ``_OFF`` names ``"linear"``, which so also switches the products of :mod:`.hybrid_deterministic`,
    :mod:`.zamba_deterministic`, :mod:`.gated_delta_deterministic` and :mod:`.short_conv_deterministic`."""
    return routed_linear(x, weight, bias, off=_OFF)


def lm_head_forward(module: torch.nn.Linear, original, hidden_states: torch.Tensor) -> torch.Tensor:
    """The LM head (a ``torch.nn.Linear``) of a deterministic model: ``[B, T, hidden] -> [B, T, V]`` through
    :func:`~hf_hybridcache.kernels.batch_invariant.invariant_linear`, so a row's logits do not depend on the rows
    beside it (``logits_to_keep`` positions of a packed engine step, a padded ``generate()`` batch)."""
    return linear(hidden_states, module.weight, module.bias)


@_compat.force_accelerate_hooks(["conv1d", "dt_proj"])
def deterministic_forward(mixer, hidden_states: torch.Tensor, cache, attention_mask: torch.Tensor | None):
    """The mixer's output ``[B, T, hidden]`` (the dtype of ``hidden_states`` ``[B, T, hidden]``) for ``T >= 1`` tokens
    over ``cache`` (one of this package's caches: it answers ``checkpoint_positions``), continuing from its conv and
    SSM states (zeros where it holds none) and leaving the states after the last token there: a decode step
    (``T == 1`` over a held state) updates them in place, as the package's decode step does. ``attention_mask``:
    ``[B, T]`` (1 keeps a token) or None.

    Raises:
        ValueError: the cached SSM state is not float32 (from the invariant step).
    """
    layer_idx, seq_len, dtype = mixer.layer_idx, hidden_states.shape[1], hidden_states.dtype
    conv_state, ssm_state, decode, positions = cached_states(cache, layer_idx, seq_len)
    hidden_states = apply_padding_mask(hidden_states, attention_mask)
    x, gate = linear(hidden_states, mixer.in_proj.weight, mixer.in_proj.bias).transpose(1, 2).chunk(2, dim=1)
    conv_checkpoints = conv_states_at(x, conv_state, mixer.conv_kernel_size, positions)
    x = conv(mixer, x, conv_state, cache, decode)
    x = apply_padding_mask(x.transpose(1, 2), attention_mask)  # [B, T, I]
    time_step, B, C = torch.split(linear(x, mixer.x_proj.weight, mixer.x_proj.bias),
                                  [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1)
    time_step, B, C = selective_norms(mixer, time_step, B, C)
    time_step = linear(time_step, mixer.dt_proj.weight)
    scan = dict(A=-torch.exp(mixer.A_log.float()), D=mixer.D.float(),
                dt_bias=None if mixer.dt_proj.bias is None else mixer.dt_proj.bias.float())
    if decode:
        y = ssm_step(ssm_state, x[:, 0], time_step[:, 0], B[:, 0], C[:, 0], gate[..., 0], scan)[:, :, None]
    else:
        y, final_state, ssm_checkpoints = ssm_scan(x, time_step, B, C, gate, ssm_state, positions, scan)
        cache.update_recurrent_state(final_state, layer_idx)
        if positions:
            cache.capture_states(layer_idx, positions, list(zip(conv_checkpoints, ssm_checkpoints)))
    return linear(y.transpose(1, 2).to(dtype), mixer.out_proj.weight, mixer.out_proj.bias)


def conv(mixer, x: torch.Tensor, conv_state: torch.Tensor | None, cache, decode: bool) -> torch.Tensor:
    """The conv output ``[B, I, T]`` of the raw conv inputs ``x`` ``[B, I, T]`` of a Mamba-1 ``mixer`` (its
    ``conv1d``, ``activation``, ``conv_kernel_size``, ``layer_idx``) through the invariant conv, from ``conv_state``
    ``[B, I, W]`` (None: zeros); the window goes to ``cache`` (in place for a ``decode`` step, which counts its token
    as the package's decode step does)."""
    return conv_over_cache(x, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.activation, conv_state, cache,
                           mixer.layer_idx, mixer.conv_kernel_size, decode, off=_OFF)


def ssm_step(state, x, time_step, B, C, gate, scan: dict) -> torch.Tensor:
    """One token of the invariant selective scan in place on the cached SSM state ``[B, I, N]`` float32: ``x`` /
    ``time_step`` / ``gate`` ``[B, I]``, ``B`` / ``C`` ``[B, N]``, ``scan`` the mixer's ``A`` ``[I, N]``, ``D``
    ``[I]`` and ``dt_bias`` ``[I]`` (or None) in float32; returns ``y`` ``[B, I]``.

    Raises:
        ValueError: ``state`` is not float32 (from the invariant step).
    """
    step = selective_state_update if "scan" in _OFF else selective_step_invariant
    return step(state, x, time_step, scan["A"], B, C, scan["D"], z=gate, dt_bias=scan["dt_bias"], dt_softplus=True)


def ssm_scan(x, time_step, B, C, gate, ssm_state, positions, scan: dict):
    """The invariant selective scan (each token the call of :func:`ssm_step`) of ``x`` / ``time_step`` ``[B, T, I]``,
    ``B`` / ``C`` ``[B, T, N]``, ``gate`` ``[B, I, T]`` from ``ssm_state`` ``[B, I, N]`` float32 (None: zeros), with
    ``scan`` as for :func:`ssm_step` -> ``(y [B, I, T], final state, [state after each of positions' token
    counts])``."""
    run = selective_scan if "scan" in _OFF else selective_scan_invariant
    return run(x.transpose(1, 2), time_step.transpose(1, 2), scan["A"], B.transpose(1, 2), C.transpose(1, 2),
               D=scan["D"], z=gate, delta_bias=scan["dt_bias"], delta_softplus=True, initial_state=ssm_state,
               emit_positions=positions)

