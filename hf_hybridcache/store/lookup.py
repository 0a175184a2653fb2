"""The hit search: how far a prompt's full blocks match stored blocks, where it leaves a stored path (the divergence
point) and the deepest restorable boundary. Read-only: :func:`find_hit` composes these over any pool-like view
(:meth:`PrefixStore.find <hf_hybridcache.store.PrefixStore.find>` over the store's own pool; a dry run of a batch over
the store plus what its earlier rows will store), and :meth:`PrefixStore.lookup
<hf_hybridcache.store.PrefixStore.lookup>` touches what it returns.

After vLLM v1's hybrid coordinator (``vllm/v1/core/kv_cache_coordinator.py``): the attention chain is matched left to
right, then the Mamba side searches right to left for the deepest checkpoint, and the hit shrinks until both agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..hashing import BlockHash, block_hash
from .block_pool import BlockPool


@dataclass(frozen=True)
class Hit:
    """A restorable prefix: ``hit_tokens`` tokens, the block ids and hashes of ``[0, hit_tokens)``.

    Attributes:
        divergence_tokens: the block boundary past the hit where the prompt leaves an already stored token path (a
            stored block continues that prefix differently from the prompt's next full block), or 0 when there is
            none.
        kv_hashes: hashes of every stored block the prompt's full blocks match, from block 0 (``block_hashes`` is
            their first ``hit_tokens / block_size``): the KV chain reaches ``len(kv_hashes) * block_size`` tokens.
        leaves_path: the block that ends the matched chain has stored children and none is the prompt's next full
            block (the prompt leaves a stored path there, whether or not that lies past the hit).
        tier_kv_tokens: with a remote tier asked, how far the prompt's KV chain reaches in the local store and the
            tier together (0: no tier asked, or it holds no more than the local store).
        tier_checkpoint_tokens: the deepest checkpoint within that chain the tier holds and the request left there,
            recomputing being measured faster than fetching (0: none).
    """

    hit_tokens: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    divergence_tokens: int = 0
    kv_hashes: tuple[BlockHash, ...] = ()
    leaves_path: bool = False
    tier_kv_tokens: int = 0
    tier_checkpoint_tokens: int = 0


def match_blocks(
    pool: BlockPool, token_ids: list[int], root: BlockHash, block_size: int
) -> tuple[list[int], list[BlockHash]]:
    """Ids and hashes of the stored blocks that hold the prompt's full blocks, from block 0 to the first one missing.
    The pool re-compares token ids and parents, so a hash collision never matches another prefix."""
    chain: list[int] = []
    hashes: list[BlockHash] = []
    parent_hash, parent_id = root, None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = tuple(token_ids[start : start + block_size])
        parent_hash = block_hash(parent_hash, tokens)
        parent_id = pool.lookup(parent_hash, parent_id, tokens)
        if parent_id is None:
            break
        chain.append(parent_id)
        hashes.append(parent_hash)
    return chain, hashes


def divergence_tokens(pool: BlockPool, chain: list[int], num_tokens: int, block_size: int) -> int:
    """Marconi's admission point (MLSys 2025): the prompt's full blocks match stored blocks up to D tokens, the
    stored block at D has children, and none of them is the prompt's next full block. 0 when the prompt only extends
    a stored path (the matched block is a leaf), ends inside it, or shares nothing."""
    diverges = 0 < len(chain) < num_tokens // block_size and not pool[chain[-1]].is_leaf
    return len(chain) * block_size if diverges else 0


def hit_blocks(
    chain: list[int], has_checkpoint: Callable[[int], bool], num_tokens: int, block_size: int, tail_tokens: int = 1
) -> int:
    """Blocks in the longest hit: the deepest matched block with a checkpoint at its end whose boundary is at most
    ``num_tokens - tail_tokens`` (at least one token must run to produce logits); 0 for a miss."""
    for depth in range(min(len(chain), (num_tokens - tail_tokens) // block_size), 0, -1):
        if has_checkpoint(chain[depth - 1]):
            return depth
    return 0


def find_hit(
    pool: BlockPool,
    has_checkpoint: Callable[[int], bool],
    token_ids: list[int],
    root: BlockHash,
    block_size: int,
    tail_tokens: int = 1,
) -> Hit:
    """The longest hit of ``token_ids`` under ``root`` that leaves ``tail_tokens`` to run, its divergence point reported
    only past the hit; reads ``pool`` and ``has_checkpoint`` only."""
    chain, hashes = match_blocks(pool, token_ids, root, block_size)
    divergence = divergence_tokens(pool, chain, len(token_ids), block_size)
    depth = hit_blocks(chain, has_checkpoint, len(token_ids), block_size, tail_tokens)
    hit_tokens = depth * block_size
    return Hit(hit_tokens, tuple(chain[:depth]), tuple(hashes[:depth]), divergence if divergence > hit_tokens else 0,
               tuple(hashes), bool(divergence))
