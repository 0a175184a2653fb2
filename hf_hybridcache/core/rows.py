"""Per batch row of the live request: the tokens fed to the model, the stored chain they map to, and storing them.

A row's blocks are stored as soon as they are full; its checkpoints at the retained boundaries are kept for good,
and the checkpoint at the last boundary it reached is kept until a later boundary replaces it (so the last one a
request reaches becomes its decode-end checkpoint).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ..hashing import BlockHash
from ..kernels.paged_copy import KVBlock
from ..store import LayerState, PrefixStore, last_boundary
from .explain import HitReport

logger = logging.getLogger("hf_hybridcache")


@dataclass
class Row:
    """One batch row of the live request.

    Attributes:
        prompt_tokens: the row's prompt length L (without padding).
        pad: live-layout positions before the row's first token (left padding).
        token_ids: tokens this row has put through the model (or restored), in order.
        hit_tokens: prefix tokens restored at the start of the request.
        block_ids, block_hashes: the stored chain of the row's full blocks, pinned while the request lives.
        root: parent hash of the row's block 0 (None: the unsalted root; a cache salt gives its own root).
        storing: False once a block could not be stored (the chain cannot continue).
        tentative_block: block whose checkpoint is the last boundary reached and not retained.
        divergence_tokens: boundary where the prompt leaves a stored token path, kept as a retained checkpoint
            (0: none, or divergence admission is off).
        stop_at: tokens after which generate() feeds this row the pad id (its stopping criteria finished it).
        finished: the row ended in a batch and is now fed padding, which is not recorded.
        prefill_tokens: when replies are replayed, the row's tokens before its first decode step (a one-token
            forward over a cached state); blocks and checkpoints past them are not stored while the request runs
            (:mod:`~hf_hybridcache.generate.reply_replay` stores them from one prefill when ``generate()`` ends). None:
            no decode step yet, or replies are not replayed.
        report: why the row hit what it hit (:class:`~hf_hybridcache.core.explain.HitReport`), made at its lookup.
        weights_generation: the weights generation its request began under
            (:meth:`~hf_hybridcache.core.sharing.CacheCore.request_start`).
        stale: the weights changed while the row ran: nothing more of it is stored (its states mix two weights
            states and its root names the first; :meth:`~hf_hybridcache.core.sharing.CacheCore.check_weights`).
        keys: the prompt's token keys where images stand in for placeholder ids
            (:mod:`~hf_hybridcache.multimodal.prompt`): ``token_ids`` holds them in place of the ids it is fed.
    """

    prompt_tokens: int
    pad: int = 0
    token_ids: list[int] = field(default_factory=list)
    hit_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    root: BlockHash | None = None
    storing: bool = True
    tentative_block: int | None = None
    divergence_tokens: int = 0
    stop_at: int | None = None
    finished: bool = False
    prefill_tokens: int | None = None
    report: HitReport | None = None
    weights_generation: int = 0
    stale: bool = False
    keys: list[int] | None = None

    @property
    def storable_tokens(self) -> int:
        """Tokens whose blocks and checkpoints may be stored now."""
        return len(self.token_ids) if self.prefill_tokens is None else self.prefill_tokens


def store_row_blocks(
    store: PrefixStore,
    row: Row,
    live_block_kv: Callable[[int], dict[int, KVBlock]] | None = None,
    page_of_block: Callable[[int], int] | None = None,
) -> None:
    """Store every full block of ``row`` not stored yet. The KV of block ``index`` is ``live_block_kv(index)``, a
    copy of the row's live KV (``{attention layer idx: (keys [Hkv, block_size, Dk], values [Hkv, block_size,
    Dv])}``), or the page ``page_of_block(index)`` of the store's page pool that already holds it (stored by
    reference)."""
    bs = store.block_size
    while row.storing and not row.stale and len(row.block_ids) < row.storable_tokens // bs:
        index = len(row.block_ids)
        source = (
            {"page": page_of_block(index)} if page_of_block is not None else {"make_kv": lambda: live_block_kv(index)}
        )
        added = store.add_block(
            row.block_ids[-1] if index else None,
            row.block_hashes[-1] if index else row.root,
            tuple(row.token_ids[index * bs : (index + 1) * bs]),
            **source,
        )
        if added is None:
            row.storing = False
            logger.debug("KV block %d does not fit in the budget; the rest of this row is not stored", index)
            return
        row.block_ids.append(added[0])
        row.block_hashes.append(added[1])


def store_row_checkpoint(
    store: PrefixStore, row: Row, boundary: int, states: dict[int, LayerState], tentative: bool
) -> bool:
    """Store the row's state after ``boundary`` tokens (copies), if the block ending there is stored. True if a new
    checkpoint was stored."""
    index = boundary // store.block_size - 1
    if row.stale or index >= len(row.block_ids) or set(states) != set(store.mamba_layers):
        return False
    block_id = row.block_ids[index]
    previous, row.tentative_block = row.tentative_block, None
    if previous is not None and previous != block_id:
        # Beyond the retained boundaries only the last boundary reached keeps its checkpoint: the decode-end one,
        # which lets the next chat turn reuse the reply. Dropping the superseded one first means the new one never
        # evicts anything to make room for a checkpoint that is about to go.
        store.drop_checkpoint(previous)
    stored = store.add_checkpoint(block_id, states)
    if stored is None:
        logger.debug("checkpoint at %d tokens does not fit in the budget", boundary)
    elif tentative and (stored or block_id == previous):
        row.tentative_block = block_id
    return bool(stored)


def replay_start(row: Row, block_size: int) -> int | None:
    """The boundary a row's replay starts from (its last one before the first decode step), or None when no block
    boundary was reached past it."""
    if row.prefill_tokens is None or not row.storing:
        return None
    start = last_boundary(row.prefill_tokens, block_size)
    return start if last_boundary(len(row.token_ids), block_size) > start else None
