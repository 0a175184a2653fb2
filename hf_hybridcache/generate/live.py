"""The live request: what one ``generate()`` call (or a run of direct forwards) is doing to a cache's live layers.

A :class:`LiveRequest` is made when a request begins (:mod:`hf_hybridcache.generate.lifecycle`), after the longest
stored prefix of each row was restored into the live layers (:func:`restore_row`). Around every forward it is told
:meth:`~LiveRequest.before_forward` (which block boundaries the patched mixers must hand their states over at) and
:meth:`~LiveRequest.after_forward` (store the new full blocks and the captured checkpoints); :meth:`~LiveRequest.crop`
rolls rejected draft tokens back, and :meth:`~LiveRequest.end` unpins its chains. It never decides what a store
keeps beyond what the retention plan says, and never touches transformers' internals except through ``_compat``.
"""

from __future__ import annotations

import logging

import torch

from .. import _compat
from ..config import StateKey, split_state_key
from ..core import Row
from ..kernels.paged_copy import KVBlock
from ..multimodal import key_placeholders
from ..store import LayerState
from ..store.retention import plan_checkpoints

logger = logging.getLogger("hf_hybridcache")


def restore_row(cache, token_ids: list[int], tail_tokens: int | None = None, decode_tokens: int = 0) -> Row:
    """Copy the longest stored prefix of ``token_ids`` (:meth:`~hf_hybridcache.core.sharing.CacheCore.lookup`, the
    remote tier included) into ``cache``'s (fresh, single-row) live layers and pin its chain; at least ``tail_tokens``
    tokens are left to run (None: the options' ``min_tail_tokens``). Full attention layers get buffers with room for the
    prompt's tail and ``decode_tokens`` more tokens (the decode steps ``generate()`` will feed), which their updates
    write in place (:func:`~hf_hybridcache._compat.append_kv_in_room`) instead of concatenating. Returns the row,
    whose ``hit_tokens`` is the restored length P (0 on a miss)."""
    core, root = cache.core, cache.live.root
    store = core.store
    with core.store_lock:  # nothing is evicted between the lookup and the pin
        hit = core.lookup(token_ids, root, tail_tokens)
        row = Row(len(token_ids), token_ids=token_ids[: hit.hit_tokens], hit_tokens=hit.hit_tokens, root=root,
                  divergence_tokens=hit.divergence_tokens, report=core.report(token_ids, root, hit),
                  weights_generation=cache.live.weights_generation)
        if not hit.hit_tokens:
            return row
        room = len(token_ids) - hit.hit_tokens + max(decode_tokens, 0)  # written after the prefix, not concatenated
        pages = store.page_table(hit.block_ids) if cache.spec.attention else None  # one block table for all layers
        for attn in cache.spec.attention:
            first = attn.restore_from_block(hit.hit_tokens, store.block_size)
            full = attn.sliding_window is None
            keys, values = store.gather_kv(attn.layer_idx, pages[first:], room if full else 0)
            _compat.set_kv(cache.layers[attn.layer_idx], keys, values, hit.hit_tokens, owns_room=full)
        for key, (conv, ssm) in store.checkpoint_copy(hit.block_ids[-1]).items():
            layer_idx, state_idx = split_state_key(key)
            _compat.set_linear_state(cache.layers[layer_idx], conv, ssm, state_idx, hit.hit_tokens)
        core.pin(hit.block_ids)
    row.block_ids, row.block_hashes = list(hit.block_ids), list(hit.block_hashes)
    return row


class LiveRequest:
    """The live request of one cache view: its rows, the live-layout span of the running forward and the states the
    mixers captured in it.

    Args:
        cache: the :class:`~hf_hybridcache.HybridPrefixCache` (or view) whose live layers the request runs in.
        rows: one per batch row; empty when nothing is tracked.
        tracking: False when nothing of the request is stored (unsupported inputs, beam reordering, ...).
        forward_end: live positions already held (the restored prefix, or the rows assembled for a batch).

    Attributes:
        emit_positions: token counts inside the running forward after which the mixers hand over their states.
        wanted: boundaries of the running forward whose checkpoints are stored (single-row forwards).
        rollback: keep every state of the last forward so that rejected draft tokens can be cropped.
        captured: ``{live position: {state key (mamba layer idx): (conv, ssm)}}`` handed over by the mixers.
        forward_kv: ``{sliding layer idx: (keys, values)}``, the KV ``[B, Hkv, T, D]`` its ``update`` returned in the
            running forward, which ends at ``forward_end``: the layer itself keeps only its window, so the blocks
            completed in the forward, and a rollback (kept after the forward only then), are read from here.
        in_forward: a forward of this request is running.
        input_device: the device of the token ids its forwards were given (None before the first).
    """

    def __init__(self, cache, rows: list[Row], tracking: bool, forward_end: int = 0) -> None:
        self.cache = cache
        self.rows = rows
        self.tracking = tracking
        self.forward_start = self.forward_end = forward_end
        self.emit_positions: tuple[int, ...] = ()
        self.wanted: frozenset[int] = frozenset()
        self.rollback = False
        self.captured: dict[int, dict[StateKey, LayerState]] = {}
        self.forward_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.in_forward = False
        self.input_device: torch.device | None = None
        self.number = cache.core.num_requests  # generate() requests so far (a direct forward's takes the last one)
        store = cache.core.store
        self.evicted_at_start = (store.evicted_kv_blocks, store.evicted_checkpoints)

    # ------------------------------------------------------------------ around every forward

    def before_forward(self, input_ids: torch.Tensor | None, num_rows: int, num_tokens: int) -> None:
        """Record the forward's tokens per row and plan the boundaries the mixers emit states at."""
        self.in_forward = True
        self.captured.clear()
        self.forward_kv.clear()
        self.forward_start = self.forward_end
        self.forward_end += num_tokens
        self.emit_positions = ()
        if not self.tracking:
            return
        if input_ids is not None:
            self.input_device = input_ids.device
        if input_ids is None or num_rows != len(self.rows):
            self.stop_tracking("a forward without input_ids or with another batch size")
            return
        # A one-token forward over a cached state runs the mixers' decode step; what it computes is not stored when
        # replies are replayed (reply_replay.py stores it from one prefill when generate() ends).
        decode_step = num_tokens == 1 and self.forward_start > 0 and self.cache.options.replay_replies
        for row, ids in zip(self.rows, input_ids.tolist()):
            if row.stop_at is not None and len(row.token_ids) >= row.stop_at:
                # generate() feeds the pad id to rows that already ended: stop the row where it really ended, so its
                # decode-end checkpoint and blocks are not replaced by padding.
                row.finished = True
            if not row.finished:
                if decode_step and row.prefill_tokens is None:
                    row.prefill_tokens = len(row.token_ids)
                start = len(row.token_ids)
                row.token_ids.extend(ids)
                if not key_placeholders(row.token_ids, start, row.keys, self.cache.placeholder_ids):
                    self.stop_tracking("image placeholder tokens fed without their images")
                    return
        if num_rows == 1:  # the mixers emit interior states for single-row forwards
            self._plan_emits(self.rows[0])

    def _plan_emits(self, row: Row) -> None:
        start, end = self.forward_start, self.forward_end
        # The retained boundaries and the last one reached (the decode-end checkpoint if the request stops before the
        # next one), chosen as the serving engine chooses them.
        self.wanted = plan_checkpoints(start, end, row.prompt_tokens, self.cache.options, row.divergence_tokens).wanted
        positions = {b - start for b in self.wanted if b < end}
        if self.rollback:  # draft tokens past the prompt may be rejected: keep every state after them
            positions.update(range(max(1, row.prompt_tokens - start), end - start))
        self.emit_positions = tuple(sorted(positions))

    def rows_done(self, is_done: list[bool]) -> None:
        """generate() finished the rows where ``is_done`` is True after its last step: the next forward still feeds
        each its last sampled token, the ones after that feed the pad id."""
        if len(is_done) != len(self.rows):
            return
        for row, done in zip(self.rows, is_done):
            if done and row.stop_at is None:
                row.stop_at = len(row.token_ids) + 1

    def checkpoint_positions(self, seq_len: int) -> tuple[int, ...]:
        """Token counts ``1 <= t < seq_len`` of the running forward after which a mixer hands over its state."""
        if not self.tracking or self.forward_end - self.forward_start != seq_len:
            return ()
        return self.emit_positions

    def capture_states(self, key: StateKey, positions, states: list[LayerState]) -> None:
        # Detached: a forward run with grad enabled must not make stored entries pin its autograd graph.
        for t, (conv, ssm) in zip(positions, states):
            self.captured.setdefault(self.forward_start + t, {})[key] = (conv.detach(), ssm.detach())

    def after_forward(self) -> None:
        """Store each row's new full blocks and the checkpoints at its retained and last-reached boundaries."""
        self.in_forward = False
        if not self.tracking:
            self.forward_kv.clear()
            return
        options, core = self.cache.options, self.cache.core
        num_tokens = self.forward_end - self.forward_start
        bs = options.block_size
        core.check_weights(row for row in self.rows if not row.finished and (
            self.captured or len(row.block_ids) < row.storable_tokens // bs or len(row.token_ids) % bs == 0))
        for index, row in enumerate(self.rows):
            if row.finished:
                continue
            core.store_blocks(row, lambda block: self._live_block_kv(index, row.pad, block))
            end = len(row.token_ids)
            single = len(self.rows) == 1
            captured = {b: self.captured[b] for b in self.wanted if b in self.captured} if single else {}
            if end % options.block_size == 0 and end <= row.storable_tokens:
                captured[end] = self._live_row_states(index)
            if not captured:  # most decode steps
                continue
            plan = plan_checkpoints(end - num_tokens, end, row.prompt_tokens, options, row.divergence_tokens)
            for boundary in sorted(captured):
                stored = core.store_checkpoint(row, boundary, captured[boundary], boundary not in plan.kept)
                if stored and boundary == plan.admitted_divergence:
                    core.count_divergence_checkpoint()
        if not self.rollback:  # kept for crop() otherwise
            self.captured.clear()
            self.forward_kv.clear()

    def _live_block_kv(self, row: int, pad: int, block: int) -> dict[int, KVBlock]:
        """Views of a row's block ``block`` of live KV: ``{attention layer idx: (keys [Hkv, block_size, Dk],
        values [Hkv, block_size, Dv])}``. The store copies them into a page at once, so the block is copied once."""
        cache, block_size = self.cache, self.cache.options.block_size
        start = pad + block * block_size
        kv = {}
        for attn in cache.spec.attention:
            keys, values = self.forward_kv.get(attn.layer_idx) or _compat.get_kv(cache.layers[attn.layer_idx])
            first = self.forward_end - keys.shape[-2]  # live position of keys[..., 0, :] (> 0 for a sliding layer)
            # A block is stored once the forward that fills it ends; it started at most block_size - 1 tokens before
            # that forward, which a sliding layer still holds when block_size <= sliding_window (checked at build).
            assert start >= first, f"block at live position {start} left sliding layer {attn.layer_idx}'s window"
            offset = start - first
            assert offset + block_size <= keys.shape[-2], f"block at live position {start} is not full"
            kv[attn.layer_idx] = (keys.detach()[row, :, offset : offset + block_size],
                                  values.detach()[row, :, offset : offset + block_size])
        return kv

    def record_sliding_kv(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep what a sliding layer's ``update`` returned in this forward (see ``forward_kv``)."""
        self.forward_kv[layer_idx] = (keys, values)

    def _live_row_states(self, row: int) -> dict[StateKey, LayerState]:
        """Copies of one row's live Mamba states: ``{state key: (conv [1, C, W], ssm)}``."""
        states = {}
        for m in self.cache.spec.mamba:
            conv, ssm = _compat.get_linear_state(self.cache.layers[m.layer_idx], m.state_idx)
            states[m.key] = (conv[row : row + 1].detach().clone(), ssm[row : row + 1].detach().clone())
        return states

    # ------------------------------------------------------------------ rollback and the end

    @property
    def is_croppable(self) -> bool:
        return self.rollback and len(self.rows) == 1

    def crop(self, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens of the last forward: KV is cut, the Mamba state is set back to the copy
        taken after the kept tokens, and stored blocks past the kept tokens are unpinned.

        Raises:
            ValueError: the tokens were not all fed by the last forward, or states were not kept, or the batch has
                more than one row.
        """
        keep = self.forward_end - num_tokens
        states = self.captured.get(keep) if len(self.rows) == 1 else None
        if states is None or not self.rollback:
            raise ValueError(
                "HybridPrefixCache can only roll back tokens fed by the last forward of a single-row request after "
                "activate_past_recording(); a Mamba state cannot be cut at an earlier token otherwise."
            )
        cache = self.cache
        for attn in cache.spec.attention:
            layer = cache.layers[attn.layer_idx]
            if attn.layer_idx in self.forward_kv:  # a sliding layer: its window at `keep` reaches before its tail
                keys, values = self.forward_kv[attn.layer_idx]
                _compat.set_kv(layer, keys[..., :-num_tokens, :], values[..., :-num_tokens, :], keep)
            else:
                _compat.crop_kv(layer, num_tokens)
        for key, (conv, ssm) in states.items():
            layer_idx, state_idx = split_state_key(key)
            _compat.set_linear_state(cache.layers[layer_idx], conv.clone(), ssm.clone(), state_idx, keep)
        row = self.rows[0]
        del row.token_ids[keep:]
        full_blocks = keep // cache.options.block_size
        cache.core.release(row.block_ids[full_blocks:])
        del row.block_ids[full_blocks:], row.block_hashes[full_blocks:]
        self.forward_end = keep
        self.captured.clear()
        self.forward_kv.clear()

    def stop_tracking(self, why: str) -> None:
        """Store nothing more of this request (its live state no longer maps to its rows' tokens)."""
        if self.tracking:
            logger.debug("%s: the rest of this request is not stored", why)
            self.tracking = False

    def end(self) -> None:
        """Unpin the rows' chains; the last checkpoint each row reached stays as its decode-end one."""
        self.in_forward = False
        core = self.cache.core
        store = core.store
        for row in self.rows:
            core.release(row.block_ids)
        kv_blocks, checkpoints = self.evicted_at_start
        logger.debug(
            "request %d released its chains (requests stay live until the next begins or reset()); it evicted %d KV "
            "blocks and %d checkpoints; stored %d bytes of KV and %d of checkpoints",
            self.number,
            store.evicted_kv_blocks - kv_blocks,
            store.evicted_checkpoints - checkpoints,
            store.kv_bytes,
            store.checkpoint_bytes,
        )
