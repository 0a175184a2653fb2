"""``cache.explain``: the reports a ``generate()`` of these ids would give (:mod:`~hf_hybridcache.core.explain`),
changing nothing: no recency is touched, nothing is stored or counted, the tier is read only when asked (one
``EXISTS`` pipeline per row, which leaves no trace) and never written.

The rows of a batch replay one after another in ``generate()`` (:mod:`~hf_hybridcache.generate.batch`), each storing its
blocks and checkpoints before the next one looks up, so a row can hit what an earlier row of the same batch stores.
The dry run follows that: each row is looked up in the store plus what the earlier rows would store
(:class:`Planned`). It assumes the budget keeps all of it (a batch that evicts while it replays may hit less).
"""

from __future__ import annotations

import torch

from .. import _compat
from ..core import HitReport, not_cacheable
from ..hashing import BlockHash, chain_hashes
from ..store import Hit, PrefixStore, last_boundary, retained_boundaries
from ..store.lookup import find_hit
from . import lifecycle
from .batch import mask_lengths, unpadded_rows


def explain_call(cache, input_ids, salt: str | None, remote: bool, attention_mask: torch.Tensor | None = None):
    """What a ``generate()`` of ``input_ids`` with ``cache`` (or its view under ``salt``) would restore and why,
    changing nothing (see the module docstring); ``cache.explain(input_ids, salt=None, remote=False,
    attention_mask=None)`` with ``salt`` None meaning the view's own.

    Args:
        input_ids: one prompt (a list of token ids, a ``[T]`` or ``[1, T]`` int64 tensor) or a batch ``[B, T]``.
        salt: the salt of the view a ``generate()`` would run on (None: unsalted).
        remote: ask the remote tier too (one ``EXISTS`` pipeline per row, leaving no trace); without it the hit is
            the local store's, which a ``generate()`` may extend from the tier.
        attention_mask: ``[B, T]`` as for ``generate()`` (left padding), or None.

    Returns:
        A :class:`~hf_hybridcache.core.explain.HitReport` for one prompt, a list of them (one per row) for B > 1.

    Raises:
        ValueError: ``salt`` is not None or a non-empty string; ids that ``generate()`` with the cache refuses (not
            ``[B, T]``, empty, outside the vocabulary; a model that changed dtype or devices).
    """
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"`salt` must be a non-empty string naming the tenant, or None; got {salt!r}.")
    ids = torch.as_tensor(input_ids)
    ids = ids.long() if ids.numel() == 0 else ids  # torch.as_tensor([]) is float32: an empty prompt, not float ids
    ids = ids[None] if ids.dim() == 1 else ids
    lifecycle.check_request(cache, ids)
    with cache.core.store_lock:
        reports = explain(cache, ids, attention_mask, salt, remote)
    return reports[0] if len(reports) == 1 else reports


def explain(cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, salt: str | None,
            remote: bool) -> list[HitReport]:
    """One report per row of ``input_ids`` ``[B, T]`` (``attention_mask`` ``[B, T]`` or None) under ``salt``. The
    caller has checked the ids and holds the core's lock."""
    lengths = mask_lengths(input_ids, attention_mask)
    cause = _compat.uncached_cause(cache.model, grad=False)  # as generate() runs: without autograd
    if cause is not None:
        return [not_cacheable(n, cause) for n in lengths]
    rows = unpadded_rows(input_ids, attention_mask)
    if rows is None:
        return [not_cacheable(n, "padding") for n in lengths]
    core = cache.core
    root = core.request_root(salt)
    planned = Planned(core.store)
    reports: list[HitReport] = []
    for index, tokens in enumerate(rows):
        twin = rows.index(tokens)
        if twin < index:  # generate() replays a repeated row once, and the copy shares its hit
            reports.append(reports[twin])
            continue
        hit = core.peek(tokens, root, remote, find=planned.find if planned.blocks else None)
        reports.append(core.report(tokens, root, hit))
        if len(rows) > 1:
            planned.add_row(tokens, root, hit, core.options)
    return reports


class _Node:
    """What the hit search reads of a block besides its id."""

    __slots__ = ("is_leaf",)

    def __init__(self, is_leaf: bool) -> None:
        self.is_leaf = is_leaf


class Planned:
    """The store's blocks and checkpoints plus those earlier rows of a batch store while they replay: a pool-like
    view for :func:`~hf_hybridcache.store.lookup.find_hit`, in which a planned block's id is its hash. Reads the store
    only.

    Attributes:
        blocks: hashes of the planned blocks.
        children: ``{parent hash: hashes of planned blocks after it}``.
        checkpoints: hashes of the blocks that end at a planned checkpoint.
    """

    def __init__(self, store: PrefixStore) -> None:
        self.store = store
        self.blocks: set[BlockHash] = set()
        self.children: dict[BlockHash, set[BlockHash]] = {}
        self.checkpoints: set[BlockHash] = set()

    def find(self, token_ids: list[int], root: BlockHash, tail_tokens: int = 1) -> Hit:
        return find_hit(self, self.has_checkpoint, token_ids, root, self.store.block_size, tail_tokens)

    def lookup(self, block_hash: BlockHash, parent_id, token_ids: tuple[int, ...]):
        if not isinstance(parent_id, bytes):  # a stored block's parent is stored
            block_id = self.store.pool.lookup(block_hash, parent_id, token_ids)
            if block_id is not None:
                return block_id
        return block_hash if block_hash in self.blocks else None

    def __getitem__(self, block_id) -> _Node:
        if isinstance(block_id, bytes):
            return _Node(not self.children.get(block_id))
        block = self.store.pool[block_id]
        return _Node(block.is_leaf and not self.children.get(block.block_hash))

    def has_checkpoint(self, block_id) -> bool:
        if isinstance(block_id, bytes):
            return block_id in self.checkpoints
        return block_id in self.store.checkpoints or self.store.pool[block_id].block_hash in self.checkpoints

    def add_row(self, token_ids: list[int], root: BlockHash, hit: Hit, options) -> None:
        """Plan what a batch row that hit ``hit`` stores while it replays up to its last token: its full blocks and
        the checkpoints at its retained boundaries and at the last boundary it reaches
        (:class:`~hf_hybridcache.generate.live.LiveRequest`)."""
        bs, start, end = options.block_size, hit.hit_tokens, len(token_ids) - 1
        if end <= start:
            return
        hashes = chain_hashes(root, token_ids[: end // bs * bs], bs)
        parent = root
        for block in hashes:
            if block not in self.blocks:
                self.blocks.add(block)
                self.children.setdefault(parent, set()).add(block)
            parent = block
        kept = retained_boundaries(
            start, end, len(token_ids), bs, options.retention_tokens, hit.divergence_tokens, options.min_tail_tokens
        )
        for boundary in {*kept, last_boundary(end, bs)}:
            if start < boundary <= end:
                self.checkpoints.add(hashes[boundary // bs - 1])
