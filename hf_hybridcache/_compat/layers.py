"""The live cache layers transformers builds (``DynamicLayer``, ``DynamicSlidingWindowLayer``, ``LinearAttentionLayer``
and their hybrids): reading and writing their private fields, because restoring a prefix and rolling back a draft
token have no public setter.

A sliding-window layer (``is_sliding``; transformers 5.23 ``cache_utils.py``) keeps the KV of the last
``sliding_window - 1`` tokens only and counts every token in ``cumulative_length``, which its masks and
``get_seq_length`` read; its ``update`` returns the KV it held before the call plus the call's new tokens.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer

from ..kernels.paged_copy import kv_room

#: Attribute of a live layer naming the (keys, values) data pointers of KV restored into buffers with room to spare.
_ROOM_ATTR = "_hf_hybridcache_kv_room"

#: Fields of a fresh ``DynamicLayer`` that its ``lazy_initialization`` sets (with ``device``, and ``dtype`` on 5.23),
#: which :func:`set_kv` sets itself on a layer that does not override it (``check_version`` refuses a transformers
#: whose fresh layer lacks one).
DYNAMIC_LAYER_FIELDS = ("keys", "values", "is_initialized")


def new_live_layers(config) -> list:
    """Fresh per-layer cache objects, exactly as ``DynamicCache(config=...)`` builds them for this model, followed by
    the cache layers of the loop passes after the first (:func:`loop_cache_layers`), which upstream's forward would
    append itself when it finds ``num_hidden_layers`` layers."""
    layers = DynamicCache(config=config.get_text_config(decoder=True)).layers
    return layers + [copy.deepcopy(layers[decoder_idx]) for decoder_idx in loop_cache_layers(config).values()]


def loop_cache_layers(config) -> dict[int, int]:
    """``{cache layer idx: decoder layer idx}`` of the cache layers that looped decoder layers use in their passes
    after the first (empty for a model without loops).

    Inkling 2 Loop (``inkling2_loop_text``, transformers 5.24 ``modeling_inkling2_loop.py``) runs decoder layers
    ``[loop_layer_index_start, loop_layer_index_end)`` ``loop_num_passes`` times; pass ``p >= 1`` calls them with
    ``cache_offset = num_hidden_layers + (p - 1) * num_loop_layers - loop_layer_index_start``, so decoder layer ``i``
    keeps that pass's KV and conv windows in cache layer ``i + cache_offset``, after the model's own layers. Its
    forward appends deep copies of the loop layers' cache layers when the cache holds ``num_hidden_layers`` of them.
    """
    text = config.get_text_config(decoder=True)
    passes = getattr(text, "loop_num_passes", 1)
    if passes <= 1:
        return {}
    start, end = text.loop_layer_index_start, text.loop_layer_index_end
    first = text.num_hidden_layers
    return {first + (p - 1) * (end - start) + i - start: i for p in range(1, passes) for i in range(start, end)}


def cache_layer_offset(kwargs: dict) -> int:
    """What a looped layer's module adds to its ``layer_idx`` to find the cache layer of this call (its
    ``cache_offset`` keyword, 0 in a first pass and in every model without loops)."""
    return kwargs.get("cache_offset") or 0


def dynamic_conv_input(args: tuple, kwargs: dict):
    """The tap input of an Inkling 2 short conv call (``Inkling2DynamicShortConvolution.forward(hidden_states,
    dynamic_input, cache=..., conv_mask=...)``, transformers 5.23 - 5.25, its static sibling taking and ignoring the
    same argument from 5.24 on): the second positional argument, or the ``dynamic_input`` keyword; None where the call
    has none."""
    return args[1] if len(args) > 1 else kwargs.get("dynamic_input")


def inkling2_fused_attention(module) -> bool:
    """Whether an Inkling 2 attention module is transformers 5.23's, which holds its projections, clips and output
    gate itself and gates its output inline (``gate_proj``); from 5.24 on they sit in projection modules."""
    return hasattr(module, "gate_proj")


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers; layer ``i`` owns cache layer ``i`` in every supported family. A vision-language wrapper's
    are its language model's (``model.language_model``, or ``language_model.model`` where that is a whole
    ``*ForCausalLM``: Nemotron-H Omni); the pure state-space models keep theirs in ``model.backbone``."""
    language = getattr(getattr(model, "model", None), "language_model", None) or getattr(model, "language_model", None)
    if language is not None:
        return getattr(language, "model", language).layers
    if hasattr(model, "backbone"):  # Mamba, Falcon-Mamba, Mamba-2
        return model.backbone.layers
    return model.model.layers


def sliding_windows(config) -> dict[int, int]:
    """``{layer idx: sliding_window}`` of the layers transformers builds as sliding-window (or chunked) attention
    cache layers for ``config``."""
    return {
        idx: layer.sliding_window
        for idx, layer in enumerate(new_live_layers(config))
        if getattr(layer, "is_sliding", False)
    }


def get_kv(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Live keys and values ``[B, Hkv, T, D]`` of an attention layer (a sliding layer's: of its last
    ``min(seen, sliding_window - 1)`` tokens), or None before its first update."""
    if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
        return None
    return layer.keys, layer.values


def set_kv(
    layer, keys: torch.Tensor, values: torch.Tensor, num_tokens: int | None = None, owns_room: bool = False
) -> None:
    """Make an attention layer hold the state it has after ``num_tokens`` tokens (default ``T``), given the KV
    ``[B, Hkv, T, D]`` of the last ``T`` of them (taken over, not copied): a full layer needs all of them; a sliding
    layer keeps the last ``sliding_window - 1`` and counts ``num_tokens``, as its own ``update`` would have.

    ``owns_room``: ``keys`` and ``values`` are the leading views of buffers that nothing else reads, with room after
    them (:func:`~hf_hybridcache.kernels.paged_copy.kv_room`); :func:`append_kv_in_room` may then write the next
    tokens there."""
    setattr(layer, _ROOM_ATTR, (keys.data_ptr(), values.data_ptr()) if owns_room else None)
    num_tokens = keys.shape[-2] if num_tokens is None else num_tokens
    if type(layer).lazy_initialization is DynamicLayer.lazy_initialization:
        # What it sets (DYNAMIC_LAYER_FIELDS, device, dtype) without the two empty tensors replaced just below.
        layer.dtype, layer.device, layer.is_initialized = keys.dtype, keys.device, True
    else:
        layer.lazy_initialization(keys[..., :0, :], values[..., :0, :])
    if getattr(layer, "is_sliding", False):
        keep = min(layer.sliding_window - 1, num_tokens)
        assert keys.shape[-2] >= keep, f"a sliding layer at {num_tokens} tokens needs the last {keep} tokens' KV"
        keys, values = keys[..., keys.shape[-2] - keep :, :], values[..., values.shape[-2] - keep :, :]
        layer.cumulative_length = num_tokens
    else:
        assert keys.shape[-2] == num_tokens, f"a full attention layer needs the KV of all {num_tokens} tokens"
    layer.keys, layer.values = keys, values


def append_kv_in_room(
    layer, key_states: torch.Tensor, value_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What a full attention layer's ``update`` does (append ``key_states`` / ``value_states`` ``[B, Hkv, n, D]``
    and return all its keys and values), done by writing into the room after a restored prefix
    (:func:`set_kv` with ``owns_room``) instead of concatenating: one copy of the prefix per restore, not two. None
    when that does not apply (no room owned, not enough of it, a layer with its own ``update``, a batch reordered
    since, or a forward with grad), and the layer's own ``update`` runs.

    A crop keeps the buffer: the next tokens overwrite the dropped ones, as they replace them in the layer."""
    owned = getattr(layer, _ROOM_ATTR, None)
    if owned is None or type(layer).update is not DynamicLayer.update or getattr(layer, "is_sliding", False):
        return None
    keys, values, num_new = layer.keys, layer.values, key_states.shape[-2]
    if (keys.data_ptr(), values.data_ptr()) != owned:
        setattr(layer, _ROOM_ATTR, None)  # the layer left its buffer (concatenated, reordered): never again
        return None
    if min(kv_room(keys), kv_room(values)) < num_new:
        return None
    if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
        return None
    grown = []
    for live, new in ((keys, key_states), (values, value_states)):
        if new.shape[:2] != live.shape[:2] or new.shape[-1] != live.shape[-1] or new.dtype != live.dtype:
            return None
        shape = (*live.shape[:-2], live.shape[-2] + num_new, live.shape[-1])
        grown.append(live.as_strided(shape, live.stride(), live.storage_offset()))
    for whole, new in zip(grown, (key_states, value_states)):
        whole[..., whole.shape[-2] - num_new :, :].copy_(new)
    layer.keys, layer.values = grown
    return layer.keys, layer.values


def crop_kv(layer, num_tokens: int) -> None:
    """Drop the last ``num_tokens`` positions of an attention layer's live KV."""
    layer.keys = layer.keys[..., :-num_tokens, :]
    layer.values = layer.values[..., :-num_tokens, :]


#: The token count a transformers 5.25 ``LinearAttentionLayer`` keeps (a 0-d long tensor): ``update_conv_state`` adds a
#: forward's tokens, ``increase_count`` one decode token, ``crop`` subtracts; absent before 5.25.
LINEAR_TOKEN_COUNT = "cumulative_length_linear"
#: Whether the installed transformers' linear layers count their tokens (5.25 on): before, ``Cache.get_seq_length()``
#: raises for a cache without an attention layer (Mamba's), and the live request's count stands in for it.
LINEAR_LAYERS_COUNT_TOKENS = hasattr(LinearAttentionLayer(), LINEAR_TOKEN_COUNT)


def count_decode_token(cache, layer_idx: int, state_idx: int = 0) -> None:
    """Count one token on a linear layer whose conv state a decode step updated in place without
    ``update_conv_state`` (what upstream's ``causal_conv1d_forward`` does through ``cache.increase_count`` on 5.25;
    nothing before 5.25, whose layers do not count)."""
    increase = getattr(cache, "increase_count", None)
    if increase is not None:
        increase(layer_idx, state_idx)


def get_linear_state(layer, state_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Live (conv state ``[B, C, W]``, recurrent state) of a Mamba / linear-attention / short-conv layer, or None
    before its first update. A short conv has no recurrent state: an empty float32 ``[B, 0]`` stands in for it."""
    if not layer.has_previous_state[state_idx]:
        return None
    conv, recurrent = layer.conv_states[state_idx], layer.recurrent_states[state_idx]
    if recurrent is None:
        recurrent = conv.new_zeros((conv.shape[0], 0), dtype=torch.float32)
    return conv, recurrent


def conv_state_before_update(
    layer, state_idx: int = 0, conv_kernel_size: int | None = None
) -> tuple[torch.Tensor | None, int]:
    """The conv window ``[B, C, W]`` an ``update_conv_state(..., conv_kernel_size=...)`` call will continue from
    (None on a fresh prompt), and the width ``W`` the layer keeps."""
    previous = layer.conv_states[state_idx] if layer.has_previous_state[state_idx] else None
    return previous, conv_kernel_size or layer.conv_kernel_size[state_idx]


def set_linear_state(layer, conv: torch.Tensor, ssm: torch.Tensor, state_idx: int, num_tokens: int) -> None:
    """Make a fresh Mamba layer hold ``conv``/``ssm`` (taken over, not copied), the state after ``num_tokens``
    tokens, and say that a state exists, so the mixer continues from it instead of treating the next tokens as a
    fresh prefill.

    Sets the fields ``LinearAttentionLayer.lazy_initialization`` sets (5.23 - 5.25: ``dtype``, ``device``,
    ``conv_kernel_size``, the states and their ``is_*_initialized`` flags) without the zero states it allocates,
    which a restore would overwrite at once: on a GDN model they are as many bytes as the checkpoint itself. On
    transformers 5.25 a linear layer also counts its own tokens (``cumulative_length_linear``, which
    ``Cache.get_seq_length()`` reads where layer 0 is a linear layer): the count becomes ``num_tokens``."""
    if layer.device is None:
        layer.dtype, layer.device = conv.dtype, conv.device
    if state_idx == 0 and hasattr(layer, LINEAR_TOKEN_COUNT):  # 5.25: the count update_conv_state keeps
        setattr(layer, LINEAR_TOKEN_COUNT, torch.tensor(num_tokens, dtype=torch.long, device=conv.device))
    layer.conv_kernel_size[state_idx] = conv.shape[-1]
    layer.conv_states[state_idx] = conv
    layer.is_conv_states_initialized[state_idx] = True
    if ssm.numel():  # a short conv's empty stand-in leaves the layer without a recurrent state, as upstream does
        layer.recurrent_states[state_idx] = ssm
        layer.is_recurrent_states_initialized[state_idx] = True
    layer.has_previous_state[state_idx] = True
