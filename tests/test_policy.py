"""Eviction orders of both policies and divergence detection, on small hand-made traces of the store (no model).

The store below has ``block_size=2``, KV blocks of 16 bytes and checkpoints of 64 bytes, and a FLOP model of one
FLOP per token (no attention term), so a checkpoint's FLOP efficiency is just the number of tokens a hit would have to
recompute without it.

FLOP-aware ranks by ``t + K * e`` (recency stamp t, efficiency e) with ``K = alpha * t_span / e_span`` re-measured
before a victim once 1/32 of the candidates changed; with the few candidates here that is at every victim, so the
orders below are Marconi's min-max score ``(t - t_min) / t_span + alpha * (e - e_min) / e_span`` exactly, and the
comments derive them in that form (``test_flop_aware_picks_marconis_min_max_victim_when_rekeyed_every_time`` checks
the equivalence on a longer trace).
"""

import pytest
import torch

from hf_hybridcache.config import AttentionLayerSpec, MambaLayerSpec, ModelStateSpec, TensorSpec
from hf_hybridcache.hashing import root_hash
from hf_hybridcache.store import FlopAwareEviction, FlopModel, LRUEviction, PrefixStore

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

    def spy():
        key = choose()
        if key is not None:
            order.append((key[0], store.end_tokens(key[1])))
        return key

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
    assert sorted(b.block_id for b in store.blocks()) == sorted(hit.block_ids)  # ... but B's pinned KV stays
    assert store.stored_bytes == 3 * KV and store.num_checkpoints == 0


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
        stored = {block.block_id for block in store.blocks()}
        assert all(block.parent_id in stored | {None} for block in store.blocks())  # never an orphan
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


def _min_max_victim(store, policy) -> tuple[str, int]:
    """Marconi's rule computed from scratch over every candidate: lowest (t - t_min) / t_span + alpha * (e - e_min) /
    e_span, ties to the least recently used; e is the tokens [previous checkpoint, end) per byte, 0 for KV."""
    blocks = {block.block_id: block for block in store.blocks()}

    def efficiency(key):
        kind, block_id = key
        if kind == "kv":
            return 0.0
        previous = blocks[block_id].parent_id
        while previous is not None and blocks[previous].checkpoint is None:
            previous = blocks[previous].parent_id
        start = 0 if previous is None else store.end_tokens(previous)
        return (store.end_tokens(block_id) - start) / CKPT

    keys = store.candidates()
    stamps, effs = [policy.last_used(k) for k in keys], [efficiency(k) for k in keys]
    t_span, e_span = (max(stamps) - min(stamps)) or 1, (max(effs) - min(effs)) or 1.0
    scores = [((t - min(stamps)) / t_span + policy.alpha * (e - min(effs)) / e_span, t) for t, e in zip(stamps, effs)]
    return keys[min(range(len(keys)), key=scores.__getitem__)]


def test_flop_aware_picks_marconis_min_max_victim_when_rekeyed_every_time():
    # With a handful of candidates, K is re-measured at every victim: the incremental order is Marconi's min-max
    # score exactly.
    policy = FlopAwareEviction(ONE_FLOP_PER_TOKEN, alpha=0.75)
    store = make_store(policy, 6 * KV + 2 * CKPT)
    choose, checked = policy.victim, []

    def spy():
        expected = _min_max_victim(store, policy) if store.candidates() else None
        key = choose()
        checked.append(key == expected)
        return key

    policy.victim = spy
    for i in range(12):
        run_request(store, [1, 2, 3, 4] + [10 + i % 5, 20 + i, 30 + i, 40 + i, 50, 60], checkpoints_at=(4, 8, 12))
    assert len(checked) > 20 and all(checked)


def test_flop_aware_alpha_is_settable_and_rekeys():
    policy = FlopAwareEviction(ONE_FLOP_PER_TOKEN, alpha=1.0)
    store = make_store(policy)
    run_request(store, list(range(100, 140)), checkpoints_at=(40,))
    run_request(store, [1, 2, 3, 4], checkpoints_at=(4,))
    # The only candidates: the checkpoint at 40 (oldest, saves 40 tokens) and at 4 (newest, saves 4): scores 0 + 1
    # and 1 + 0 tie, so the older one goes.
    assert store.end_tokens(policy.victim()[1]) == 40
    policy.alpha = 1.5  # benchmarks/hit_rate.py sweeps it: the next victim re-keys (0 + 1.5 against 1 + 0)
    assert store.end_tokens(policy.victim()[1]) == 4


def test_checkpoint_links_relink_only_the_checkpoints_below():
    # Chain 2 -> 4 -> 6 -> 8 with a branch 6' under 4; checkpoints at 8 and 6' first, then 4 between them and the
    # root, then 4 dropped again.
    store = make_store(LRUEviction())
    ids = run_request(store, [1, 2, 3, 4, 5, 6, 7, 8], checkpoints_at=(8,))
    branch = run_request(store, [1, 2, 3, 4, 9, 9], checkpoints_at=(6,))
    links = store.links
    assert (links.previous(ids[3]), links.previous(branch[2])) == (None, None)
    assert sorted(links.add(store.pool, ids[1])) == sorted([ids[3], branch[2]])
    assert (links.previous(ids[3]), links.previous(branch[2])) == (ids[1], ids[1])
    assert sorted(links.remove(ids[1])) == sorted([ids[3], branch[2]])
    assert (links.previous(ids[3]), links.previous(branch[2])) == (None, None)


def test_export_and_import_keep_the_tree_the_checkpoints_and_the_recency():
    store = make_store(LRUEviction())
    branching_trace(store)
    blocks, recency = store.export_entries()
    assert [b.parent_id for b in blocks] == [None, blocks[0].block_id, blocks[1].block_id, blocks[0].block_id,
                                             blocks[3].block_id]
    copy = make_store(LRUEviction())
    new_ids = copy.import_entries(blocks, recency)
    assert eviction_order(copy) == eviction_order(store)
    assert sorted(new_ids) == [b.block_id for b in blocks]
    with pytest.raises(ValueError, match="budget"):
        make_store(LRUEviction(), budget=KV).import_entries(blocks, recency)


def test_a_block_whose_kv_cannot_be_written_is_not_stored():
    """A failing KV write (``make_kv`` or the page copy raising) leaves no block behind: before, the block stayed in
    the pool without KV, later lookups hit it and ``page_table`` raised ``KeyError`` on every call with that prompt."""

    def broken():
        raise RuntimeError("the page write failed")

    store = make_store(LRUEviction())
    with pytest.raises(RuntimeError, match="the page write failed"):
        store.add_block(None, None, (1, 2), broken)
    assert len(store.pool) == 0 and store.kv.block_ids() == []
    ids = run_request(store, [1, 2, 3, 4])
    assert sorted(store.pool.block_ids()) == sorted(store.kv.block_ids()) == sorted(ids)
