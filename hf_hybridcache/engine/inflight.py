"""Prefixes in flight: which running request is computing which uncached blocks right now, so that a request whose
next blocks another is computing waits for them instead of computing them too (bounded: only while that request's
prefill moves toward them), and that request keeps a checkpoint where their prompts part. The shared prefix is
computed once (the idea of vLLM's and SGLang's in-flight prefix sharing, applied to recurrent checkpoints)."""

from __future__ import annotations

from ..core import CacheCore
from ..hashing import BlockHash, chain_hashes
from .requests import EngineRequest


class InflightPrefixes:
    """``{block hash: the running request computing that block}`` for the blocks of running prompts past their
    hits, and the rules that make waiting requests wait for them.

    Args:
        core: the cache core (options, roots).
        block_size: tokens per block.
    """

    def __init__(self, core: CacheCore, block_size: int) -> None:
        self.core, self.block_size = core, block_size
        self.owners: dict[BlockHash, EngineRequest] = {}

    def __bool__(self) -> bool:
        return bool(self.owners)

    def hash_chain(self, request: EngineRequest, root: BlockHash) -> None:
        """Hash the full blocks of ``request``'s token keys under ``root`` (once per root and length)."""
        tokens, bs = request.key_tokens, self.block_size
        if (request.root, len(request.chain_hashes or ())) != (root, len(tokens) // bs):
            request.root, request.chain_hashes = root, chain_hashes(root, tokens, bs)

    def claim(self, request: EngineRequest, hit_tokens: int) -> None:
        """``request`` was admitted with ``hit_tokens`` restored: its prompt's blocks after them are in flight."""
        bs = self.block_size
        for block_hash in request.chain_hashes[hit_tokens // bs : len(request.prompt) // bs]:
            self.owners.setdefault(block_hash, request)

    def leave(self, request: EngineRequest) -> None:
        """``request`` computed its prompt, or stopped running: its blocks are no longer in flight."""
        if request.chain_hashes is None:
            return
        for block_hash in request.chain_hashes:
            if self.owners.get(block_hash) is request:
                del self.owners[block_hash]

    def ask_for_checkpoint(self, request: EngineRequest) -> None:
        """A waiting request that no slot or token budget admits yet still tells the running request computing its
        prefix where their prompts part, so that a checkpoint is kept there for it (once per request)."""
        if request.asked or request.is_admitted:
            return
        self.hash_chain(request, self.core.root(request.salt))
        chain = request.chain_hashes[: (len(request.tokens) - self.core.options.min_tail_tokens) // self.block_size]
        first = next((i for i, h in enumerate(chain) if h in self.owners), None)
        if first is not None:
            request.asked = self.waits_for(request, first)

    def waits_for(self, request: EngineRequest, hit_blocks: int) -> bool:
        """Whether ``request`` should wait: a running request is computing its next blocks after the hit. That
        request then keeps a checkpoint where the two prompts part (or where it is now, if it is further)."""
        tail = self.core.options.min_tail_tokens  # tokens a hit leaves to run
        chain = request.chain_hashes[: (len(request.tokens) - tail) // self.block_size]
        if hit_blocks >= len(chain):
            return False
        owner = self.owners.get(chain[hit_blocks])
        if owner is None or owner is request or not owner.is_admitted:
            return False
        shared = hit_blocks
        while shared < len(chain) and self.owners.get(chain[shared]) is owner:
            shared += 1
        boundary = shared * self.block_size
        if owner.past >= boundary:
            return False  # it went past the boundary without a checkpoint there: compute
        owner.extra_boundaries.add(boundary)
        return True
