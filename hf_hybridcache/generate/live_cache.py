"""The face a :class:`~hf_hybridcache.HybridPrefixCache` shows transformers and the patched mixers during a call.

transformers' ``Cache`` API is what the model's own code calls on the cache while a forward runs: ``update`` and
``update_conv_state`` write the live layers, beam search reorders them, speculative decoding rolls them back with
``crop``, and the patched Mamba mixers ask where to hand over their states. :class:`LiveCache` answers these by
delegating to the live request (:class:`~hf_hybridcache.generate.live.LiveRequest`); the user-facing half (options,
stats, views, persistence) is :class:`~hf_hybridcache.HybridPrefixCache`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from .. import _compat
from ..config import state_key
from ..core import CacheCore
from ..hashing import BlockHash
from ..models import emission
from ..multimodal import ImageReport, placeholder_ids
from .live import LiveRequest


@dataclass(eq=False)
class LiveState:
    """The live-request state of one view (a cache or one of its ``with_salt`` views); what the view shares with the
    others is its :class:`~hf_hybridcache.core.sharing.CacheCore`.

    Attributes:
        root: parent hash of block 0 for this view's requests (its salt and the weights state of its last request).
        weights_generation: the weights generation of its last request
            (:meth:`~hf_hybridcache.core.sharing.CacheCore.request_start`).
        request: the live request of this view, or None between requests.
        awaiting_request: a ``generate()`` call is running and its request has not begun yet.
        rollback_next_request: assisted decoding asked for per-token states before its request began.
        call_lock: held for each ``generate()`` call and forward with the view (:mod:`~hf_hybridcache.core.sharing`).
        images: what its latest request with images encoded and skipped (:mod:`~hf_hybridcache.generate.images`).
    """

    root: BlockHash
    weights_generation: int = 0
    request: LiveRequest | None = None
    awaiting_request: bool = False
    rollback_next_request: bool = False
    call_lock: threading.RLock = field(default_factory=threading.RLock)
    images: ImageReport | None = None


class LiveCache(Cache):
    """The transformers ``Cache`` methods of a HybridPrefixCache; its ``layers`` are the live cache layers.

    Attributes:
        core: what this view shares with the cache and its other views.
        live: this view's own live-request state.
    """

    model: torch.nn.Module
    core: CacheCore
    live: LiveState

    # ------------------------------------------------------------------ Cache methods transformers calls

    @property
    def is_compileable(self) -> bool:
        return False

    def __deepcopy__(self, memo):
        raise ValueError(
            "A HybridPrefixCache cannot be deep-copied (it holds the model and the stored prefixes). To reuse a "
            "prompt's cache across calls, pass the same HybridPrefixCache to every generate() call: each call "
            "restores the longest stored prefix by copy, and nothing a call does changes what is stored for others."
        )

    @property
    def last_images(self) -> ImageReport | None:
        """What the view's latest request with images (a vision-language wrapper's) encoded and skipped: how many
        images were run through the vision tower, how many the restored prefix held, and the tower's time."""
        return self.live.images

    @property
    def placeholder_ids(self) -> frozenset[int]:
        """The model's image (video, audio) placeholder token ids; empty for a text model."""
        return placeholder_ids(self.model)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0 while a ``generate()`` call has not begun its request, as for a fresh cache: ``generate()`` computes
        positions before its prefill, and Qwen3.5's 3D positions and ``rope_deltas`` must come from the whole prompt,
        never from the layers of the view's previous request. An ``int`` on every version (transformers 5.25's
        linear layers answer a 0-d tensor). A model without attention layers (Mamba) gets the live request's
        positions before 5.25, whose linear layers do not count their tokens (transformers raises)."""
        if self.live.awaiting_request:
            return 0
        if not self.spec.attention and not _compat.LINEAR_LAYERS_COUNT_TOKENS:
            request = self.live.request
            return 0 if request is None else request.forward_start if request.in_forward else request.forward_end
        return int(super().get_seq_length(layer_idx))

    def _check_owner(self) -> None:
        if self.live.request is None or not self.live.request.in_forward:
            raise ValueError(
                f"This HybridPrefixCache serves generate()/forward() calls of the model it was built for "
                f"({type(self.model).__name__} at {id(self.model):#x}), not of another model or of that model's "
                "backbone; build one HybridPrefixCache per model and pass it to that model."
            )

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._check_owner()
        appended = _compat.append_kv_in_room(self.layers[layer_idx], key_states, value_states)
        keys, values = appended or super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx in self.spec.sliding_layers:
            self.live.request.record_sliding_kv(layer_idx, keys, values)
        return keys, values

    def update_conv_state(self, conv_states, layer_idx, *args, **kwargs):
        self._check_owner()
        emitted = emission.active()
        state_idx = kwargs.get("state_idx", 0)
        if emitted is not None and emitted.key == state_key(layer_idx, state_idx) and emitted.conv is None:
            # The mixer hands over the raw conv inputs [B, C, T] of its new tokens: the windows at the emission's
            # positions are cut from them and the window the layer held before.
            layer = self.layers[layer_idx]
            previous, width = _compat.conv_state_before_update(layer, state_idx, kwargs.get("conv_kernel_size"))
            emitted.capture_conv(conv_states, previous, width)
        return super().update_conv_state(conv_states, layer_idx, *args, **kwargs)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._stop_tracking("beam reordering")
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._stop_tracking("batch expansion")
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._stop_tracking("batch selection")
        super().batch_select_indices(indices)

    def _stop_tracking(self, why: str) -> None:
        if self.live.request is not None:
            self.live.request.stop_tracking(why)

    # ------------------------------------------------------------------ called by the patched mixers

    def checkpoint_positions(self, seq_len: int) -> tuple[int, ...]:
        """Token counts ``1 <= t < seq_len`` of the running forward after which a Mamba mixer must hand its state to
        :meth:`capture_states` (single-row forwards only). The state at the forward's end is read from the live
        layers instead."""
        return () if self.live.request is None else self.live.request.checkpoint_positions(seq_len)

    def capture_states(self, layer_idx, positions, states: list) -> None:
        """Receive one Mamba layer's (conv state ``[1, C, W]``, SSM state) copies after each of ``positions`` tokens
        of the running forward; ``layer_idx`` is a :data:`~hf_hybridcache.config.StateKey` for a layer's later
        states."""
        self.live.request.capture_states(layer_idx, positions, states)

    # ------------------------------------------------------------------ speculative decoding: roll back rejected tokens

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs) -> None:
        """Called by transformers before assisted / prompt-lookup decoding: from now on every forward of the request
        keeps the state after each of its tokens, so :meth:`crop` can roll rejected draft tokens back exactly (the
        per-token states of vLLM's Mamba speculative decoding). ``recurrent_states_to_keep`` (transformers 5.25: how
        many of the last tokens' states its own layers would record) is not needed: the request keeps the state after
        every token past its prompt, whatever the draft length, and its layers record nothing
        (:meth:`get_recurrent_states_to_keep` stays 0, so upstream mixers split no scan for it)."""
        if self.live.awaiting_request:  # assisted decoding asks before its request begins
            self.live.rollback_next_request = True
        elif self.live.request is not None:
            self.live.request.rollback = True

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """0: no layer records states for transformers' own rollback (5.25 mixers split their scan by this count);
        the request keeps its per-token states itself (:meth:`activate_past_recording`)."""
        return 0

    @property
    def is_croppable(self) -> bool:
        """True while the live request keeps the per-token states that :meth:`crop` rolls back to."""
        return self.live.request is not None and self.live.request.is_croppable

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of the last forward: KV is cut, the Mamba state is set back to
        the copy taken after the kept tokens.

        Raises:
            ValueError: ``tokens_to_remove`` is positive; the tokens were not all fed by the last forward, or states
                were not kept
                (:meth:`activate_past_recording` was not called), or the batch has more than one row.
        """
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative count of tokens to remove (e.g. crop(-3)), as "
                "transformers' own cache layers require; cropping to an absolute length is not supported."
            )
        num_tokens = -tokens_to_remove
        if num_tokens == 0:
            return
        if self.live.request is None:
            raise ValueError(
                "HybridPrefixCache can only roll back tokens fed by the last forward of a single-row request after "
                "activate_past_recording(); no request is running."
            )
        self.live.request.crop(num_tokens)
