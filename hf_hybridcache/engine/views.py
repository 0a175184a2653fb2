"""The caches the model sees during an engine step.

- :class:`StepCache` is what the model's forward gets as its cache: the decoder layers only pass it on, and every
  stateful module is called per group (:mod:`~hf_hybridcache.engine.grouping`) with
- a :class:`GroupView`, the cache of one group's rows: transformers' ``Cache`` methods the mixers and attention
  modules call (``update``, ``get_conv_state`` / ``update_conv_state``, ``get_recurrent_state`` /
  ``update_recurrent_state``, ``has_previous_state``, ``get_mask_sizes``, ``get_query_offset``), answered from the
  rows' state slots and the page pool with the semantics of transformers' ``LinearAttentionLayer`` and
  ``DynamicLayer`` (``cache_utils.py``, 5.23 - 5.25), plus the package's checkpoint protocol
  (``checkpoint_positions`` / ``capture_states``, the conv capture of :mod:`~hf_hybridcache.models.emission`), as
  :class:`~hf_hybridcache.generate.live_cache.LiveCache` answers them for ``generate()``.

A view gathers its rows' states from the slots on first use (views of the slots when the rows' slots are consecutive,
so a decode step's in-place update lands there) and writes them back once the module returns; an
attention ``update`` writes the new keys and values into the rows' own pages and returns every key the rows' queries
read, gathered from the pool in the group's layout (:class:`~hf_hybridcache.engine.plan.Layout`), whose masks the
routed attention function applies (:mod:`hf_hybridcache._compat.engine_attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from ..config import ModelStateSpec, StateKey, state_key
from ..models import emission
from ..store.pages import PagePool
from .plan import Group, StepPlan
from .slots import StateSlots


class StepCache(Cache):
    """The cache handed to the model's forward in one step: stateful modules get a :class:`GroupView` per group
    instead, so the model-level methods below are all it answers.

    Args:
        plan: the step's plan.
        spec, slots, pages: the model's state spec, the engine's state slots and the page pool.
    """

    def __init__(self, plan: StepPlan, spec: ModelStateSpec, slots: StateSlots, pages: PagePool) -> None:
        super().__init__(layers=[])
        self.plan, self.spec, self.slots, self.pages = plan, spec, slots, pages
        self.windows = {a.layer_idx: a.sliding_window for a in spec.attention}

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        # Model-level callers (the Mamba padding masks) ask whether a decode step runs: the groups handle it.
        return True

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def update(self, *args, **kwargs):
        raise AssertionError("a stateful module ran on the packed step without its group view (not wrapped)")

    def view(self, group: Group) -> GroupView:
        return GroupView(self, group)


class GroupView:
    """The cache of one group of rows (see the module docstring).

    Attributes:
        last_layer: the attention layer whose keys the last ``update`` returned (its attention call comes next).
    """

    def __init__(self, step: StepCache, group: Group) -> None:
        self.step, self.group = step, group
        self._states: dict[StateKey, list] = {}  # key -> [conv [G, C, W], ssm [G, ...], has_state, conv0, ssm0]
        self._run: slice | None | bool = False  # not computed yet
        self.last_layer: int | None = None

    # ------------------------------------------------------------------ recurrent and conv states

    def _state(self, layer_idx: int, state_idx: int) -> list:
        key = state_key(layer_idx, state_idx)
        if key not in self._states:
            slots, run = self.step.slots, self._slot_run()
            if run is not None:  # views of the slots: an in-place update (a decode step's) needs no copy back
                conv, ssm = slots.conv[key][run], slots.ssm[key][run]
            else:
                index = self.group.on("slots", self.group.slots, slots.conv[key].device)
                conv, ssm = slots.conv[key].index_select(0, index), slots.ssm[key].index_select(0, index)
            self._states[key] = [conv, ssm, not self.group.fresh, conv, ssm]  # the last two: as handed out
        return self._states[key]

    def _slot_run(self) -> slice | None:
        """The rows' slots as one slice when they are consecutive in row order (one request always is), else None."""
        if self._run is False:
            first, rows = self.group.segments[0].request.slot, self.group.segments
            consecutive = all(s.request.slot == first + i for i, s in enumerate(rows))
            self._run = slice(first, first + len(rows)) if consecutive else None
        return self._run

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if layer_idx is None:
            return not self.group.fresh
        return self._state(layer_idx, state_idx or 0)[2]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        conv, _, has = self._state(layer_idx, state_idx)[:3]
        return conv if has else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        _, ssm, has = self._state(layer_idx, state_idx)[:3]
        return ssm if has and ssm.numel() else None

    def update_conv_state(self, conv_inputs: torch.Tensor, layer_idx: int, state_idx: int = 0, conv_kernel_size=None,
                          **kwargs) -> torch.Tensor:
        """``LinearAttentionLayer.update_conv_state``: returns the window before the call + ``conv_inputs``
        ``[G, C, T]`` (zero-padded to ``W`` on a fresh prefill) and keeps the last ``W`` inputs."""
        state = self._state(layer_idx, state_idx)
        conv, _, has = state[:3]
        width = conv_kernel_size or conv.shape[-1]
        emitted = emission.active()
        if emitted is not None and emitted.key == state_key(layer_idx, state_idx) and emitted.conv is None:
            emitted.capture_conv(conv_inputs, conv if has else None, width)
        if has:
            full = torch.cat([conv, conv_inputs.to(conv.dtype)], dim=-1)
        else:
            full = conv_inputs
            if full.shape[-1] < width:
                full = F.pad(full, (width - full.shape[-1], 0))
        state[0], state[2] = full[..., -width:].clone(), True
        return full

    def update_recurrent_state(self, recurrent: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        state = self._state(layer_idx, state_idx)
        state[1] = recurrent
        return recurrent

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """0: transformers 5.25's mixers keep no per-token states for its own rollback in an engine step."""
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """A decode step's in-place conv update (transformers 5.25 counts it on its linear layers); the engine's
        positions come from its plan, so there is nothing to count."""

    # ------------------------------------------------------------------ the package's checkpoint protocol

    def checkpoint_positions(self, seq_len: int) -> tuple[int, ...]:
        """Token counts inside the group's chunk after which its rows keep a checkpoint (the union over rows)."""
        return self.group.emit_positions if seq_len == self.group.num_tokens else ()

    def capture_states(self, key: StateKey, positions, states: list) -> None:
        """Receive one state's copies ``(conv [G, C, W], ssm [G, ...])`` after each of ``positions`` tokens."""
        # A prefill row's slice would keep the whole group's tensor alive when the other rows want no state there; a
        # verify group's rows all want every position, so slices keep nothing extra (and cloning 8 rows' states at 4
        # positions in every layer was a seventh of an 8-stream verify step).
        copy = self.group.num_rows > 1 and not self.group.ragged
        for t, (conv, ssm) in zip(positions, states):
            for row, segment in enumerate(self.group.segments):
                if t in segment.emit_positions:
                    pair = (conv[row : row + 1].detach(), ssm[row : row + 1].detach())
                    segment.captured.setdefault(segment.past + t, {})[key] = tuple(x.clone() for x in pair) if copy else pair

    def write_back(self) -> None:
        """Copy the states the module changed back into the rows' slots (none when it updated slot views in place)."""
        slots, run = self.step.slots, self._slot_run()
        for key, (conv, ssm, has, given_conv, given_ssm) in self._states.items():
            if not has:
                continue
            if run is not None:
                if conv is not given_conv:
                    slots.conv[key][run].copy_(conv)
                if ssm.numel() and ssm is not given_ssm:
                    slots.ssm[key][run].copy_(ssm)
                continue
            index = self.group.on("slots", self.group.slots, slots.conv[key].device)
            slots.conv[key].index_copy_(0, index, conv.to(slots.conv[key].dtype))
            if ssm.numel():
                slots.ssm[key].index_copy_(0, index, ssm.to(slots.ssm[key].dtype))

    # ------------------------------------------------------------------ attention

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the group's new keys ``[G, Hkv, T, Dk]`` and values ``[G, Hkv, T, Dv]`` into its rows' pages and
        return every key and value its queries read: ``[G, Hkv, K, Dk]`` and ``[G, Hkv, K, Dv]`` (views of one
        gather from the pool), in the group's layout for the layer."""
        pages, group = self.step.pages, self.group
        flat_keys, _ = pages.rows(layer_idx)
        device = flat_keys.device
        rows, num_heads = group.num_rows, key_states.shape[1]
        write = group.on("write", group.write_rows, device)
        pages.write_rows(layer_idx, write, key_states.transpose(1, 2).reshape(-1, num_heads, key_states.shape[-1]),
                         value_states.transpose(1, 2).reshape(-1, num_heads, value_states.shape[-1]))
        layout = group.layout(self.step.windows[layer_idx])
        read = group.on(f"read{self.step.windows[layer_idx]}", layout.rows, device)
        keys, values = pages.read_rows(layer_idx, read)
        self.last_layer = layer_idx
        shape = (rows, layout.num_keys, num_heads)
        return (keys.view(*shape, -1).transpose(1, 2).to(key_states.dtype),
                values.view(*shape, -1).transpose(1, 2).to(value_states.dtype))

    def attention_mask(self, query: torch.Tensor, key: torch.Tensor, explicit: bool) -> torch.Tensor | None:
        """The additive mask of the last updated layer for ``query`` ``[G, H, T, D]`` (see
        :mod:`hf_hybridcache._compat.engine_attention`); None when no mask is needed (``explicit``: eager
        attention, which applies no causal mask of its own)."""
        window = self.step.windows[self.last_layer]
        layout = self.group.layout(window)
        if layout.allowed is None and not (explicit and layout.causal):
            return None
        return self.group.mask(window, query.shape[-2], query.dtype, query.device)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        layout = self.group.layout(self.step.windows[layer_idx])
        return layout.num_keys, layout.kv_offset

    def get_query_offset(self, layer_idx: int = 0) -> int:
        layout = self.group.layout(self.step.windows[layer_idx])
        return layout.kv_offset + layout.num_keys - self.group.num_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.get_query_offset(layer_idx)
