"""The plan of one engine step: which requests feed which tokens, packed along the token axis, and the page rows and
masks every attention layer reads.

A step is one forward over ``[1, N]`` packed tokens: first one token of each request in the *decode group* (a
single token over the request's own state; sorted by past length), then the *verify groups* (each ``G`` requests
feeding their last token and ``T - 1`` draft tokens over their own states, pasts unequal:
:mod:`~hf_hybridcache.engine.speculative`), then the *prefill groups*, each ``G`` requests feeding ``T`` tokens over
equal pasts (all fresh, or all continuing from their slots)::

    input_ids  [ d0 d1 d2 | v0 v1 v2 v3 v4 w0 ... w4 | a0 a1 ... a23 b0 ... b23 | c0 ... c12 ]
                 decode      verify group [2, 5]       prefill group [2, 24]      prefill group [1, 13]

Token-wise layers run on the pack; every stateful module (mixer, attention) runs once per group on ``[G, T, ...]``
(:mod:`~hf_hybridcache.engine.grouping`), so a recurrence or a conv window never crosses a request boundary, and
each group's attention reads its keys from the page pool through the rows computed here:

- decode and verify groups: request ``b`` has ``L_b`` keys (its past + its ``T`` new tokens); the rows are
  left-padded to ``K = max L_b`` (right-aligned, so the distance from query ``q`` to key ``j`` is ``K - T + q - j`` in
  every row), padding and the keys after each query masked;
- prefill group over past ``P``: keys ``[kv_start, P + T)`` of every row, causal mask offset by ``P``;
- a sliding-window layer of window ``w`` reads only the keys a query may see (``q - w < k <= q``) and masks the rest.

Shapes: ``G`` rows of a group, ``T`` tokens per row, ``K`` keys per row; rows of the pool are
``page * page_size + offset`` (:class:`~hf_hybridcache.store.pages.PagePool`). Source: the packed layout of
transformers' continuous batching (``cu_seq_lens``) and flash-attention's varlen API, with the per-group calls of
the engine's feasibility study.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..config import StateKey
from ..store import LayerState
from .requests import EngineRequest


@dataclass(eq=False)
class Segment:
    """One request's part of a step: ``tokens`` fed at positions ``past .. past + len(tokens) - 1``.

    Attributes:
        emit_positions: token counts ``1 <= t < len(tokens)`` after which the mixers hand over the request's states
            (the block boundaries inside the chunk that it keeps).
        samples: the chunk reaches the end of the request's remaining tokens: its last logits are sampled.
        draft: draft tokens at the end of ``tokens`` (a decoding request's last token comes first), each verified
            against the logits of the position before it (:mod:`~hf_hybridcache.engine.speculative`); the logits of
            every position from the last token on are sampled.
        captured: ``{boundary tokens: {state key: (conv [1, C, W], ssm [1, ...])}}`` the mixers handed over.
        scores, boundary_rows, sampled_scores: what the forward scored for a request that asks for logprobs
            (:mod:`~hf_hybridcache.engine.scoring`): its prompt tokens ``past + 1 ..``, the log-softmax rows
            ``{boundary: [V] float32 (CPU)}`` before the boundaries it keeps, and the tokens it emitted.
    """

    request: EngineRequest
    tokens: list[int]
    past: int
    fresh: bool
    emit_positions: tuple[int, ...] = ()
    samples: bool = False
    draft: tuple[int, ...] = ()
    captured: dict[int, dict[StateKey, LayerState]] = field(default_factory=dict)
    scores: list | None = None
    boundary_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    sampled_scores: list | None = None

    @property
    def is_decode(self) -> bool:
        return len(self.tokens) == 1 and not self.fresh

    @property
    def end(self) -> int:
        return self.past + len(self.tokens)

    @property
    def num_logits(self) -> int:
        """Positions whose logits are sampled: none, the last, or the last token's and every draft token's."""
        return len(self.draft) + 1 if self.samples else 0


@dataclass(frozen=True)
class Layout:
    """Where one group's rows read their keys for one kind of attention layer.

    Attributes:
        rows: pool rows ``[G * K]`` int64 (row ``b``'s keys are ``rows[b * K : (b + 1) * K]``).
        num_keys: ``K``.
        allowed: ``[G, 1, T, K]`` (decode, verify) or ``[1, 1, T, K]`` (prefill) bool, True where a query sees a
            key; None when every key is visible (decode) or plain causal attention from position 0 applies.
        causal: plain causal attention from position 0 applies (a fresh prefill group, no window cut).
        kv_offset: absolute position of key 0 (of the longest row in a decode group of unequal pasts).
    """

    rows: torch.Tensor
    num_keys: int
    allowed: torch.Tensor | None
    causal: bool
    kv_offset: int


class Group:
    """Requests that run as one ``[G, T]`` batch in every stateful module.

    Args:
        segments: the group's segments (equal token counts; equal pasts unless a decode or verify group).
        start: offset of its first token in the pack.
        tables: the engine's page tables ``[num slots, max pages]`` int64, page ``i`` of the request in a slot.
        page_size: tokens per page.
    """

    def __init__(self, segments: Sequence[Segment], start: int, tables: torch.Tensor, page_size: int) -> None:
        self.segments = list(segments)
        self.start = start
        self.num_rows = len(self.segments)
        self.num_tokens = len(self.segments[0].tokens)
        self.fresh = self.segments[0].fresh
        self.is_decode = self.segments[0].is_decode
        self.ragged = self.is_decode or bool(self.segments[0].draft)  # rows over their own pasts, right-aligned
        self.page_size = page_size
        self.tables = tables
        self.pasts = torch.tensor([s.past for s in self.segments], dtype=torch.int64)
        self.uniform = all(s.past == self.segments[0].past for s in self.segments)
        self.emit_positions = tuple(sorted({t for s in self.segments for t in s.emit_positions}))
        self.slots = torch.tensor([s.request.slot for s in self.segments], dtype=torch.int64)
        positions = self.pasts[:, None] + torch.arange(self.num_tokens)[None]  # [G, T]
        self.write_rows = self._rows(positions).reshape(-1)
        self._layouts: dict[int | None, Layout] = {}
        self._on: dict[tuple[str, torch.device], torch.Tensor] = {}

    @property
    def end(self) -> int:
        return self.start + self.num_rows * self.num_tokens

    def _rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Pool rows of ``positions`` ``[G, X]`` of each row's request."""
        pages = self.tables[self.slots[:, None], positions // self.page_size]
        return pages * self.page_size + positions % self.page_size

    def split_by_past(self) -> list[Group]:
        """Sub-groups of equal pasts (for modules that read absolute positions from the cache)."""
        if self.uniform:
            return [self]
        groups, start = [], self.start
        for _, same in itertools.groupby(self.segments, key=lambda s: s.past):
            part = Group(list(same), start, self.tables, self.page_size)
            groups.append(part)
            start = part.end
        return groups

    def on(self, name: str, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor`` on ``device``, moved once per step."""
        key = (name, device)
        if key not in self._on:
            self._on[key] = tensor.to(device, non_blocking=True)
        return self._on[key]

    def mask(self, window: int | None, num_queries: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The additive mask of :meth:`layout` (0 where a query sees a key, the dtype's minimum elsewhere), built once
        per step: ``[G, 1, 1, K]`` or ``[1, 1, T, K]`` in ``dtype`` on ``device``."""
        key = (f"mask{window}{dtype}", device)
        if key not in self._on:
            layout = self.layout(window)
            allowed = layout.allowed
            if allowed is None:
                allowed = torch.ones(num_queries, layout.num_keys, dtype=torch.bool).tril(layout.num_keys - num_queries)
                allowed = allowed[None, None]
            mask = torch.zeros(allowed.shape, dtype=dtype)
            self._on[key] = mask.masked_fill_(~allowed, torch.finfo(dtype).min).to(device)
        return self._on[key]

    def layout(self, window: int | None) -> Layout:
        """The keys of the rows for attention layers of sliding ``window`` (None: full attention)."""
        if window not in self._layouts:
            self._layouts[window] = self._ragged_layout(window) if self.ragged else self._prefill_layout(window)
        return self._layouts[window]

    def _ragged_layout(self, window: int | None) -> Layout:
        num_tokens = self.num_tokens
        lengths = self.pasts + num_tokens
        first = torch.zeros_like(lengths) if window is None else (self.pasts + 1 - window).clamp(min=0)
        num_keys = int((lengths - first).max())
        positions = (lengths - num_keys)[:, None] + torch.arange(num_keys)[None]  # right-aligned [G, K]
        rows = self._rows(torch.maximum(positions, first[:, None]))
        if num_tokens == 1:
            visible = positions >= first[:, None]
            allowed = None if bool(visible.all()) else visible[:, None, None, :]
        else:
            queries = self.pasts[:, None, None] + torch.arange(num_tokens)[None, :, None]  # [G, T, 1]
            allowed = (positions[:, None, :] <= queries) & (positions[:, None, :] >= first[:, None, None])
            if window is not None:
                allowed &= positions[:, None, :] > queries - window
            allowed = allowed[:, None]
        return Layout(rows.reshape(-1), num_keys, allowed, False, int(lengths.max()) - num_keys)

    def _prefill_layout(self, window: int | None) -> Layout:
        past, num_tokens = self.segments[0].past, self.num_tokens
        kv_start = 0 if window is None else max(0, past - window + 1)
        keys = torch.arange(kv_start, past + num_tokens)
        rows = self._rows(keys[None].expand(self.num_rows, -1))
        if past == 0 and (window is None or num_tokens <= window):
            return Layout(rows.reshape(-1), len(keys), None, True, 0)
        queries = torch.arange(past, past + num_tokens)[:, None]
        allowed = keys[None] <= queries
        if window is not None:
            allowed &= keys[None] > queries - window
        return Layout(rows.reshape(-1), len(keys), allowed[None, None], False, kv_start)


class StepPlan:
    """The packed inputs of one step and its groups.

    Args:
        segments: every request's part of the step.
        tables: the engine's page tables (see :class:`Group`).
        page_size: tokens per page.

    Attributes:
        groups: the decode group (if any) first, then the prefill groups, in pack order.
        input_ids, position_ids: ``[1, N]`` int64.
        logits_index: ``[M]`` int64, the pack offsets of the sampled positions (each sampled segment's last token,
            or its last token and drafts: :attr:`Segment.num_logits` of them), in order.
        sampled: the segments whose logits are sampled, in ``logits_index`` order.
    """

    def __init__(self, segments: Sequence[Segment], tables: torch.Tensor, page_size: int) -> None:
        decodes = sorted((s for s in segments if s.is_decode), key=lambda s: s.past)
        verifies: dict[int, list[Segment]] = {}
        prefills: dict[tuple[int, int, bool], list[Segment]] = {}
        for s in segments:
            if s.draft:
                verifies.setdefault(len(s.tokens), []).append(s)
            elif not s.is_decode:
                prefills.setdefault((len(s.tokens), s.past, s.fresh), []).append(s)
        self.groups: list[Group] = []
        start = 0
        verify_groups = [sorted(members, key=lambda s: s.past) for _, members in sorted(verifies.items())]
        for members in ([decodes] if decodes else []) + verify_groups + list(prefills.values()):
            self.groups.append(Group(members, start, tables, page_size))
            start = self.groups[-1].end
        ordered = [s for g in self.groups for s in g.segments]
        self.num_tokens = start
        self.input_ids = torch.tensor([[t for s in ordered for t in s.tokens]], dtype=torch.int64)
        self.position_ids = torch.tensor([[p for s in ordered for p in range(s.past, s.end)]], dtype=torch.int64)
        offsets = itertools.accumulate((len(s.tokens) for s in ordered), initial=0)
        ends = [offset + len(s.tokens) for offset, s in zip(offsets, ordered)]
        self.sampled = [s for s in ordered if s.samples]
        self.logits_index = torch.tensor([i for end, s in zip(ends, ordered) for i in range(end - s.num_logits, end)],
                                         dtype=torch.int64)
        self.segments = ordered
