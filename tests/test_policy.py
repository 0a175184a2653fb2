"""Eviction orders of both policies and divergence detection, on small hand-made traces of the store (no model).

The store below has ``block_size=2``, KV blocks of 16 bytes and checkpoints of 64 bytes, and a FLOP model of one
FLOP per token (no attention term), so a checkpoint's FLOP efficiency is just the number of tokens a hit would have to
recompute without it.
"""

import pytest
import torch

from hf_hybridcache.config import AttentionLayerSpec, MambaLayerSpec, ModelStateSpec, TensorSpec
from hf_hybridcache.flops import FlopModel
from hf_hybridcache.hashing import root_hash
from hf_hybridcache.policy import FlopAwareEviction, LRUEviction
from hf_hybridcache.store import PrefixStore

BS = 2
SPEC = ModelStateSpec(
    attention=(AttentionLayerSpec(0, num_kv_heads=1, head_dim=1, dtype=torch.float32),),
    mamba=(MambaLayerSpec(1, conv=TensorSpec((4, 2), torch.float32), ssm=TensorSpec((4, 2), torch.float32)),),
    block_size=BS,
)
KV, CKPT = SPEC.kv_block_bytes, SPEC.checkpoint_bytes
ONE_FLOP_PER_TOKEN = FlopModel(flops_per_token=1.0, flops_per_key=0.0)


def make_store(policy, budget=10**6) -> PrefixStore:
    return PrefixStore(SPEC, root_hash(b"seed", "test-model"), budget, eviction=policy)


def run_request(store, tokens, checkpoints_at=()):
    """Store the full blocks of ``tokens`` as a request does (each pinned while it runs) with checkpoints at the
    given boundaries, then release the chain. Returns the block ids."""
    ids, hashes = [], []
    for i in range(len(tokens) // BS):
        block = tuple(tokens[i * BS : (i + 1) * BS])
        added = store.add_block(ids[-1] if ids else None, hashes[-1] if hashes else None, block,
                                lambda: {0: torch.zeros(2, 1, BS, 1)})
        ids.append(added[0])
        hashes.append(added[1])
        if (i + 1) * BS in checkpoints_at:
            store.add_checkpoint(added[0], {1: (torch.zeros(1, 4, 2), torch.zeros(1, 4, 2))})
    store.release(ids)
    return ids


def eviction_order(store) -> list[tuple[str, int]]:
    """Evict everything that can go (as a request needing the whole budget would) and return (kind, boundary
    tokens) in eviction order."""
    order = []
    choose = store.eviction.victim

    def spy(candidates, value):
        kind, block_id = choose(candidates, value)
        order.append((kind, store.pool[block_id].end_blocks * BS))
        return kind, block_id

    store.eviction.victim = spy
    assert not store.make_room(store.max_cache_bytes + 1)
    return order


def branching_trace(store):
    """A: 6 tokens with checkpoints at 4 and 6; B shares A's first block and has a checkpoint at 6; then A is hit."""
    a = run_request(store, [1, 2, 3, 4, 5, 6], checkpoints_at=(4, 6))
    run_request(store, [1, 2, 7, 8, 9, 10], checkpoints_at=(6,))
    assert store.lookup([1, 2, 3, 4, 5, 6, 11]).block_ids == tuple(a)


def test_lru_evicts_least_recently_used_leaves_first():
    store = make_store(LRUEviction())
    branching_trace(store)
    # The checkpoint at 4 was last used when stored; B's checkpoint next; B's KV then goes leaf first (it is older
    # than A's chain, which the hit touched); A's checkpoint at 6 before A's KV, whose leaf goes before its parents.
    assert eviction_order(store) == [
        ("checkpoint", 4), ("checkpoint", 6), ("kv", 6), ("kv", 4), ("checkpoint", 6), ("kv", 6), ("kv", 4),
        ("kv", 2),
    ]
    assert store.stored_bytes == 0


def test_lru_never_evicts_the_running_request_and_may_keep_kv_without_its_checkpoint():
    store = make_store(LRUEviction())
    branching_trace(store)
    hit = store.lookup([1, 2, 7, 8, 9, 10, 11])
    store.pin(hit.block_ids)  # B is running again
    order = eviction_order(store)
    assert order[-1] == ("checkpoint", 6)  # B's own checkpoint may go (it was already restored) ...
    assert sorted(store.pool.block_ids()) == sorted(hit.block_ids)  # ... but B's pinned KV stays
    assert store.stored_bytes == 3 * KV and len(store.checkpoints) == 0


def test_flop_aware_keeps_the_checkpoint_that_saves_most_per_byte():
    # L: a 40-token prompt with its checkpoint at 40, then two short prompts with checkpoints at 4, used later.
    # LRU evicts L's checkpoint first; FLOP-aware keeps it until both short ones are gone.
    orders = {}
    for policy in (LRUEviction(), FlopAwareEviction(ONE_FLOP_PER_TOKEN, alpha=2.0)):
        store = make_store(policy)
        run_request(store, list(range(100, 140)), checkpoints_at=(40,))
        run_request(store, [1, 2, 3, 4], checkpoints_at=(4,))
        run_request(store, [5, 6, 7, 8], checkpoints_at=(4,))
        orders[policy.name] = [entry for entry in eviction_order(store) if entry[0] == "checkpoint"]
    assert orders["lru"] == [("checkpoint", 40), ("checkpoint", 4), ("checkpoint", 4)]
    # Candidates {40: oldest, saves 40 tokens; 4: saves 4; 4': newest, saves 4}: scores 0 + 2 x 1, 0.82 + 0, 1 + 0
    # -> the older short one; then {40: 0 + 2, 4': 1 + 0} -> the newer short one; then L's.
    assert orders["flop_aware"] == [("checkpoint", 4), ("checkpoint", 4), ("checkpoint", 40)]


def test_flop_aware_exact_order_on_a_branching_trace():
    store = make_store(FlopAwareEviction(ONE_FLOP_PER_TOKEN, alpha=1.0))
    branching_trace(store)
    # Stamps: ckpt@4 = 3, B's ckpt@6 = 12, A's ckpt@6 = 19. Savings: ckpt@4 = [0, 4), A's ckpt@6 = [4, 6) (backs
    # off to 4), B's ckpt@6 = [0, 6). Scores: 0 + 0.5, 1 + 0, 0.5625 + 1 -> ckpt@4. Then both 6s save 6 tokens:
    # recency decides -> B's. B's KV leaves (zero savings, older than A's ckpt) go next, then A's entries leaf first.
    assert eviction_order(store) == [
        ("checkpoint", 4), ("checkpoint", 6), ("kv", 6), ("kv", 4), ("checkpoint", 6), ("kv", 6), ("kv", 4),
        ("kv", 2),
    ]


def test_flop_aware_evicts_dead_kv_before_a_used_checkpoint():
    # A checkpoint at 4 on a 12-token path whose deep checkpoint was dropped: the path's KV leaves beyond 4 serve no
    # hit and go first although they were used after the checkpoint at 4 (scores 1 + 0 against 0 + 2 x 1). LRU
    # would take the checkpoint first.
    store = make_store(FlopAwareEviction(ONE_FLOP_PER_TOKEN, alpha=2.0))
    ids = run_request(store, list(range(1, 13)), checkpoints_at=(4, 12))
    store.drop_checkpoint(ids[-1])
    order = eviction_order(store)
    assert order == [("kv", 12), ("kv", 10), ("kv", 8), ("kv", 6), ("checkpoint", 4), ("kv", 4), ("kv", 2)]


@pytest.mark.parametrize("policy", [LRUEviction(), FlopAwareEviction(ONE_FLOP_PER_TOKEN)], ids=["lru", "flop_aware"])
def test_budget_holds_and_blocks_go_only_after_their_children(policy):
    budget = 6 * KV + 2 * CKPT
    store = make_store(policy, budget)
    for i in range(12):
        run_request(store, [1, 2, 3, 4] + [10 + i, 20 + i, 30 + i, 40 + i], checkpoints_at=(4, 8))
        assert store.stored_bytes <= budget
        for block_id in store.pool.block_ids():
            parent = store.pool[block_id].parent_id
            assert parent is None or parent in store.pool  # never an orphan
    assert store.evicted_kv_blocks > 0 and store.evicted_checkpoints > 0


def test_divergence_point_is_where_a_prompt_leaves_a_stored_path():
    store = make_store(LRUEviction())
    run_request(store, [1, 2, 3, 4, 5, 6, 7, 8], checkpoints_at=(8,))
    assert store.lookup([1, 2, 3, 4, 9, 9, 9, 9, 9]).divergence_tokens == 4  # leaves at 4
    assert store.lookup([1, 2, 3, 4, 9, 9]).divergence_tokens == 4  # its next full block differs
    assert store.lookup([1, 2, 3, 4, 9]).divergence_tokens == 0  # no next full block: the prompt end covers it
    assert store.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9]).divergence_tokens == 0  # extends the stored path
    assert store.lookup([1, 2, 3, 4, 5]).divergence_tokens == 0  # ends inside it
    assert store.lookup([9, 9, 9, 9]).divergence_tokens == 0  # nothing shared
    hit = store.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert (hit.hit_tokens, hit.divergence_tokens) == (8, 0)
    run_request(store, [1, 2, 3, 4, 9, 9], checkpoints_at=(4,))
    hit = store.lookup([1, 2, 3, 4, 8, 8])
    assert (hit.hit_tokens, hit.divergence_tokens) == (4, 0)  # the divergence checkpoint is there: a hit
