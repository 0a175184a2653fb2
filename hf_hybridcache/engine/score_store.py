"""Prompt logprobs of stored prefixes, so that a request that asks for its prompt's logprobs (an eval harness scoring
continuations after one long shared preamble) can restore a stored prefix and still get them, equal to a cold run's.

A hit restores a prefix's KV and checkpoint and skips its forward, and with it the logits a request's prompt logprobs
are made of. Restoring only up to where its logprobs start would never hit for an eval harness: it asks for the whole
prompt's logprobs (``echo``) and cuts the continuation's out itself. So whenever a scoring request computes them, the
engine keeps them here, keyed as the store's entries are, by the block hash chain under the request's root (seed,
model identity, weights state, salt):

- per block ``i``: the :class:`~hf_hybridcache.engine.scoring.TokenScore` of its tokens ``[i * bs, (i + 1) * bs)``
  (top :data:`~hf_hybridcache.engine.scoring.PROMPT_TOP_K`; block ``i``'s hash certifies the prefix they depend on;
  token 0 has none), about 45 bytes a token;
- per boundary ``b`` where the request keeps a checkpoint: the log-softmax row ``[V]`` at position ``b - 1`` under the
  hash of the block ending at ``b``, from which a request restoring ``b`` scores its token ``b``, whichever it is.

A scoring request restores the deepest boundary ``b`` of its stored hit for which the scores of tokens ``[0, b]`` are
here (blocks, then the row at ``b``), computes the rest as a cold run does, and stores what it computed for the next
one. Where they are missing it restores less (its report says ``prompt_logprobs``). Bounded by ``max_bytes``
(``EngineLimits.max_score_bytes``; least recently used first), apart from the cache's budget; emptied with the store
(``cache.clear()``, which the engine follows).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

import torch

from ..core.explain import HitReport
from ..hashing import BlockHash
from ..store import Hit
from .plan import Segment
from .requests import EngineRequest
from .scoring import PROMPT_TOP_K, TokenScore


class ScoreStore:
    """Stored prompt scores (see the module docstring).

    Args:
        block_size: tokens per block.
        max_bytes: bytes of stored score tensors at most.

    Attributes:
        num_bytes: bytes stored now.
    """

    def __init__(self, block_size: int, max_bytes: int) -> None:
        self.block_size, self.max_bytes = block_size, max_bytes
        self._entries: OrderedDict[tuple[str, BlockHash], tuple[torch.Tensor, ...]] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.num_bytes = 0

    # ------------------------------------------------------------------ admission

    def restorable(self, request: EngineRequest, hit: Hit, deepest: Callable[[int], int]) -> Hit:
        """The part of ``hit`` (the store's hit of ``request``, a scoring request) it may restore: the deepest
        boundary ``b <= hit.hit_tokens`` with a checkpoint whose tokens ``[0, b]`` have scores (``request``'s own,
        from an earlier admission, or stored here, which fill ``request.prompt_scores`` as far as they reach).
        ``deepest(b)``: the deepest boundary at or below ``b`` with a stored checkpoint on the request's chain."""
        scores, bs, prompt = request.prompt_scores, self.block_size, len(request.prompt)
        if not scores:
            scores.append(None)
        self._fill(request)
        found = hit.hit_tokens
        if len(scores) < prompt:  # scores of tokens [0, b] are there up to b = len - 1, and b = len with its row
            covered = (len(scores) - 1) // bs * bs
            best = deepest(covered) if covered < found else found
            edge = len(scores)
            if best < edge <= found and edge % bs == 0:
                row = self._get("row", request.chain_hashes[edge // bs - 1])
                if row is not None and deepest(edge) == edge:
                    scores.append(_score(row, request.prompt[edge]))
                    best = edge
            found = best
        if found == hit.hit_tokens:
            return hit
        blocks = found // bs
        return replace(hit, hit_tokens=found, block_ids=hit.block_ids[:blocks], block_hashes=hit.block_hashes[:blocks])

    def _fill(self, request: EngineRequest) -> None:
        """Extend ``request.prompt_scores`` with stored blocks' scores, as far as they are contiguous."""
        scores, bs, prompt = request.prompt_scores, self.block_size, len(request.prompt)
        while len(scores) < prompt:
            index = len(scores) // bs
            if (index + 1) * bs > prompt:
                return
            block = self._get("block", request.chain_hashes[index])
            if block is None:
                return
            scores.extend(_unpack(block)[len(scores) - index * bs :])

    # ------------------------------------------------------------------ after a step

    def settle(self, segment: Segment) -> None:
        """Take what ``segment``'s forward scored into its request, and store the blocks it completed and the rows
        it kept (not for a request whose weights changed while it ran: its chain names the old weights)."""
        request, bs = segment.request, self.block_size
        if segment.scores:
            scores, start = request.prompt_scores, segment.past + 1
            assert start <= len(scores), "prompt scores are filled from token 0 on, without gaps"
            scores[start : start + len(segment.scores)] = segment.scores
        row = request.row
        if row is None or row.stale or request.chain_hashes is None or not (segment.scores or segment.boundary_rows):
            return
        filled = min(len(request.prompt_scores), len(request.prompt))
        for index in range((segment.past + 1) // bs, filled // bs):
            key = ("block", request.chain_hashes[index])
            if self._get(*key) is None:
                self._put(key, _pack(request.prompt_scores[index * bs : (index + 1) * bs]))
        for boundary, logprobs in segment.boundary_rows.items():
            self._put(("row", request.chain_hashes[boundary // bs - 1]), (logprobs,))

    # ------------------------------------------------------------------ entries

    def _get(self, kind: str, block_hash: BlockHash):
        entry = self._entries.get((kind, block_hash))
        if entry is not None:
            self._entries.move_to_end((kind, block_hash))
            return entry[0] if kind == "row" else entry
        return None

    def _put(self, key: tuple[str, BlockHash], tensors: tuple[torch.Tensor, ...]) -> None:
        size = sum(t.nbytes for t in tensors)
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_bytes -= sum(t.nbytes for t in old)
        while self._entries and self.num_bytes + size > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.num_bytes -= sum(t.nbytes for t in dropped)
        self._entries[key] = tensors
        self.num_bytes += size


def scored_report(report: HitReport, hit_tokens: int) -> HitReport:
    """``report`` (of the store's hit) for a scoring request that restores ``hit_tokens``: reason ``prompt_logprobs``
    when that is less than the store held; else its detail says the restored tokens' logprobs came with them."""
    if hit_tokens >= report.hit_tokens:
        if not hit_tokens:
            return report
        return replace(report, detail=f"{report.detail} The logprobs of the {hit_tokens:,} restored tokens and of the "
                       "one after them came from the cache too.")
    return replace(report, hit_tokens=hit_tokens, reason="prompt_logprobs", detail=(
        f"the request asks for its prompt's logprobs, and those of the stored prefix's tokens past {hit_tokens:,} "
        f"were not kept (a request that did not ask for them stored its KV and checkpoint up to "
        f"{report.hit_tokens:,}); it computes them from {hit_tokens:,} and keeps them for the next request."))


def _score(row: torch.Tensor, token: int) -> TokenScore:
    """The score of ``token`` from the log-softmax ``row`` ``[V]`` of the position before it."""
    top = row.topk(min(PROMPT_TOP_K, row.shape[-1]))
    return TokenScore(row[token].item(), tuple(top.indices.tolist()), tuple(top.values.tolist()))


def _pack(scores: list[TokenScore | None]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's scores as ``(logprob [bs] float32 (NaN: none), top ids [bs, K] int32, top logprobs [bs, K])``."""
    k = next(len(s.top_ids) for s in scores if s is not None)
    logprob = torch.tensor([math.nan if s is None else s.logprob for s in scores], dtype=torch.float32)
    ids = torch.tensor([(-1,) * k if s is None else s.top_ids for s in scores], dtype=torch.int32)
    values = torch.tensor([(math.nan,) * k if s is None else s.top_logprobs for s in scores], dtype=torch.float32)
    return logprob, ids, values


def _unpack(block: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> list[TokenScore | None]:
    logprob, ids, values = (t.tolist() for t in block)
    return [None if math.isnan(lp) else TokenScore(lp, tuple(i), tuple(v)) for lp, i, v in zip(logprob, ids, values)]
