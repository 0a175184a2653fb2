"""Shared Mamba-1 pieces (Jamba, Zamba): the patch that makes a mixer continue from the cached state, the causal conv
over a cached conv window, and the conv states at block boundaries.

Upstream code mirrored (transformers 5.23.0; the Jamba and Zamba copies of these helpers are identical):
:func:`causal_conv` is the torch fallback of ``causal_conv1d_fn`` in ``transformers/models/jamba/modeling_jamba.py`` /
``transformers/models/zamba/modeling_zamba.py`` followed by the mixers' ``[:, :, -seq_len:]`` slice;
:func:`apply_padding_mask` is their ``apply_mask_to_padding_states``; :func:`conv_states_at` gives the window that
``LinearAttentionLayer.update_conv_state`` in ``transformers/cache_utils.py`` keeps, at interior positions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from .. import _compat
from ..kernels import get_backend

#: What the Mamba-1 families tell :meth:`~hf_hybridcache.models.base.ModelSupport.explain_kernels`: the patched mixer's
#: own causal conv and scan (:func:`causal_conv`, :func:`~hf_hybridcache.kernels.selective_scan`) replace upstream's.
KERNELS = dict(
    scan="prefills that store checkpoints or continue a restored state (and every float32 prefill on CPU) run "
         "hf_hybridcache's Mamba-1 scan",
    scan_kernels=("selective_scan_fn", "causal_conv1d_fn"),
    kernel_packages=("mamba-ssm", "causal-conv1d"),
)

#: ``(mixer, hidden_states [B, 1, hidden], cache, attention_mask [B, 1] or None) -> mixer output [B, 1, hidden]``, or
#: None when the cache holds no state yet (the original forward runs then): the mixer's single-token step, in place on
#: the cached states.
#: The mixer attribute holding deterministic mode's forward (:mod:`.deterministic`): ``(mixer, hidden_states
#: [B, T, hidden], cache, attention_mask [B, T] or None) -> [B, T, hidden]``, prefill and decode alike.
DETERMINISTIC_FORWARD = "_hf_hybridcache_deterministic_forward"


class _Uncached:
    """What a deterministic mixer forward reads and writes of a cache, for a call that has none (a full-sequence
    forward such as an RL trainer's recompute of a rollout's logprobs): no state to continue, no checkpoint wanted,
    nothing kept."""

    def checkpoint_positions(self, seq_len: int) -> tuple[int, ...]:
        return ()

    def get_conv_state(self, layer_idx: int, **kwargs) -> None:  # Inkling's convs name their state_idx
        return None

    def get_recurrent_state(self, layer_idx: int) -> None:
        return None

    def update_conv_state(self, states: torch.Tensor, layer_idx: int, **kwargs) -> torch.Tensor:
        return states

    def update_recurrent_state(self, state: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return state

    def capture_states(self, *args) -> None:
        return None


UNCACHED = _Uncached()


def deterministic_over(mixer, cache):
    """``(deterministic mode's forward of mixer, the cache it runs over)``, or None where it does not run: the model
    is not in the mode, or the call's cache is not one of this package's. A call without a cache and without autograd
    runs it too, over :data:`UNCACHED`, so a full-sequence ``no_grad`` forward of a model in deterministic mode gives
    each position the bits the engine and ``generate()`` give it (docs/deterministic.md, "Logprobs a trainer
    recomputes"); under autograd the per-token scans, which update their state in place, cannot be differentiated, and
    upstream's forward runs."""
    forward = getattr(mixer, DETERMINISTIC_FORWARD, None)
    if forward is None:
        return None
    if cache is None:
        return None if torch.is_grad_enabled() else (forward, UNCACHED)
    return (forward, cache) if hasattr(cache, "checkpoint_positions") else None

DecodeStep = Callable[..., torch.Tensor | None]

#: ``(mixer, hidden_states [B, T, hidden], cache, attention_mask [B, T] or None, ssm_state or None, positions)
#: -> mixer output [B, T, hidden]``: the mixer's full-sequence path, starting from ``ssm_state`` (the cached SSM state,
#: None for zeros) and handing the states after ``positions`` tokens to ``cache.capture_states``.
ForwardFromState = Callable[..., torch.Tensor]


def patch_mixers(
    model: torch.nn.Module, mixer_class: str, forward_from_state: ForwardFromState, decode_step: DecodeStep | None = None
) -> None:
    """Patch every ``mixer_class`` module of ``model`` (this instance only, idempotent).

    The patched mixer runs ``forward_from_state`` on multi-token forwards over a cached state or with checkpoints
    wanted or in float32 on CPU over one of this package's caches (:func:`_scan_wanted_fresh`), and ``decode_step``
    (when given) on single-token forwards over one of this package's caches holding a state; everything else (no
    cache or another cache, past recording, a fresh prefill with no checkpoint wanted in reduced precision or on
    CUDA, decode steps under the ``"reference"`` kernel backend) goes to the original forward, bit-identical to the
    unpatched model. Without ``decode_step``, decode steps take
    upstream's recurrent branch, which already continues from the cached state.
    """
    for module in model.modules():
        if type(module).__name__ == mixer_class:
            _compat.patch_instance_forward(
                module, functools.partial(_continuing_forward, forward_from_state, decode_step)
            )


def _continuing_forward(
    forward_from_state: ForwardFromState, decode_step: DecodeStep | None, mixer, original: Callable, *args, **kwargs
):
    args, kwargs = _compat.with_local_mixer_mask(args, kwargs)  # Mamba's model hands over its whole mask
    hidden_states, cache, attention_mask = _compat.split_mixer_call(args, kwargs)
    seq_len = hidden_states.shape[1]
    deterministic = deterministic_over(mixer, cache)
    if deterministic is not None and (cache is None or not cache.is_recording_past(mixer.layer_idx)):
        forward, over = deterministic
        return forward(mixer, hidden_states, over, attention_mask)
    if cache is None or cache.is_recording_past(mixer.layer_idx):
        return original(*args, **kwargs)
    if seq_len == 1:
        # Only over this package's caches (they answer checkpoint_positions): another cache runs upstream's decode.
        if decode_step is not None and hasattr(cache, "checkpoint_positions") and get_backend() != "reference":
            out = decode_step(mixer, hidden_states, cache, attention_mask)
            if out is not None:
                return out
        return original(*args, **kwargs)
    ssm_state = cache.get_recurrent_state(mixer.layer_idx)
    positions = checkpoint_positions(cache, seq_len)
    if ssm_state is None and not positions and not _scan_wanted_fresh(mixer, hidden_states, cache):
        return original(*args, **kwargs)
    return forward_from_state(mixer, hidden_states, cache, attention_mask, ssm_state, positions)


def _scan_wanted_fresh(mixer, hidden_states: torch.Tensor, cache) -> bool:
    """Whether a fresh prefill that stores no checkpoint runs the package's scan too: where upstream's would be its
    sequential or associative scan (float32 on CPU: mamba-ssm is CUDA-only) over one of this package's caches,
    outside the ``"reference"`` backend. The engine's first chunk of a long prompt is such a forward: upstream's
    scan (Jamba's default ``use_associative_scan``) took 2.8x the package's there (toy Jamba, 512 tokens: 243 ms
    against 88 ms for its 6 mixers). Equal within fp32 round-off of upstream's (tests/test_kernels.py); in reduced
    precision and elsewhere upstream's forward runs, bit-identical."""
    return (hidden_states.device.type == "cpu" and hidden_states.dtype == torch.float32
            and hasattr(cache, "checkpoint_positions") and get_backend() != "reference")


def checkpoint_positions(cache, seq_len: int) -> tuple[int, ...]:
    """Token counts inside this forward (``1 <= t < seq_len``) after which the cache wants the state; empty for
    caches other than :class:`~hf_hybridcache.HybridPrefixCache`."""
    positions = getattr(cache, "checkpoint_positions", None)
    return positions(seq_len) if positions is not None else ()


#: Tokens up to which a forward over a cached conv window takes the windows' dot products instead of ``conv1d``.
FEW_TOKENS = 8


def causal_conv(
    full_inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, seq_len: int
) -> torch.Tensor:
    """Depthwise causal conv over ``full_inputs`` ``[B, C, W' + T]`` (cached window + new inputs); returns the
    outputs of the last ``seq_len`` positions ``[B, C, T]`` in the inputs' dtype. ``weight`` is ``[C, W]``.

    Mirrors ``causal_conv1d_fn``'s torch fallback (``modeling_jamba.py`` / ``modeling_zamba.py``, transformers 5.23.0)
    on the output of ``update_conv_state``, then the mixers' ``[:, :, -seq_len:]`` slice, taken here before the
    activation. On a fresh prompt both views are the same tensor, so the outputs are bit-identical; over a cached
    window the activation runs on a shorter view than upstream's, which CPU kernels may round differently (see
    :func:`.mamba2.causal_conv`); the continued forward is held to fp32 round-off against one unsplit forward
    (tests/test_continuation.py). In float32, a few tokens over a cached window (at most :data:`FEW_TOKENS`: a
    verified draft) take each window's dot product with the weight, as a decode step's fused update does, without
    ``conv1d``'s per-call cost (reduced precision keeps upstream's rounding)."""
    width = weight.shape[-1]
    few = seq_len <= FEW_TOKENS and full_inputs.dtype == weight.dtype == torch.float32
    if few and full_inputs.shape[-1] >= seq_len + width - 1:
        windows = full_inputs[..., full_inputs.shape[-1] - seq_len - width + 1 :].unfold(-1, width, 1)
        out = (windows.to(weight.dtype) * weight[:, None, :]).sum(-1)
        out = out if bias is None else out + bias[:, None]
    else:
        out = F.conv1d(full_inputs.to(weight.dtype), weight.unsqueeze(1), bias, padding=width - 1,
                       groups=weight.shape[0])
        out = out[:, :, : full_inputs.shape[-1]][:, :, -seq_len:]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(full_inputs.dtype)


def conv_states_at(
    inputs: torch.Tensor, conv_state: torch.Tensor | None, width: int, positions: Sequence[int]
) -> list[torch.Tensor]:
    """Conv state (the last ``width`` raw conv inputs) after ``t`` tokens of ``inputs`` ``[B, C, T]``, for each ``t``
    in ``positions``; a missing ``conv_state`` means zeros (as a fresh prefill pads). Returns copies ``[B, C, W]``.

    The window equals what ``LinearAttentionLayer.update_conv_state`` (``transformers/cache_utils.py``, 5.23.0) would
    keep after a forward ending at ``t``: the last ``width`` inputs, left-padded with zeros on a fresh prefill shorter
    than ``width``. Shared with the Mamba-2 families, whose conv state is the same window."""
    if not positions:
        return []
    if conv_state is None:
        conv_state = inputs.new_zeros(*inputs.shape[:-1], width)
    # Only windows are copied: concatenating the whole (often strided) forward input first cost ~1% of a prefill.
    head = torch.cat([conv_state, inputs[..., :width]], dim=-1)
    windows = [head[..., t : t + width] if t < width else inputs[..., t - width : t] for t in positions]
    return [w.clone(memory_format=torch.contiguous_format) for w in windows]


def apply_padding_mask(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Zero the padded positions (``attention_mask`` is 2D ``[B, T]`` or None): ``apply_mask_to_padding_states`` of
    every supported family's modeling file (transformers 5.23.0), copied."""
    if attention_mask is None:
        return hidden_states
    return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
