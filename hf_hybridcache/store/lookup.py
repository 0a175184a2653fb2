"""The hit search: how far a prompt's full blocks match stored blocks, where it leaves a stored path (the divergence
point) and the deepest restorable boundary. Read-only over the block pool; :meth:`PrefixStore.lookup
<hf_hybridcache.store.PrefixStore.lookup>` composes these and touches what it returns.

After vLLM v1's hybrid coordinator (``vllm/v1/core/kv_cache_coordinator.py``): the attention chain is matched left to
right, then the Mamba side searches right to left for the deepest checkpoint, and the hit shrinks until both agree.
"""

from __future__ import annotations

from collections.abc import Callable

from ..hashing import BlockHash, block_hash
from .block_pool import BlockPool


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
