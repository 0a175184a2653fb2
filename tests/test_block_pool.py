import pytest

from hf_hybridcache.hashing import BlockHash
from hf_hybridcache.store import LRUEviction, retained_boundaries
from hf_hybridcache.store.block_pool import BlockPool


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def test_add_lookup_and_ids():
    pool = BlockPool()
    a = pool.add(h(1), None, (1, 2))
    b = pool.add(h(2), a, (3, 4))
    assert (a, b) == (0, 1)
    assert pool.lookup(h(2), a, (3, 4)) == b
    assert pool[a].children == {b}
    assert not pool.is_evictable(a) and pool.is_evictable(b)


def test_lookup_recompares_tokens_and_parent():
    pool = BlockPool()
    a = pool.add(h(1), None, (1, 2))
    assert pool.lookup(h(1), None, (9, 9)) is None  # a colliding hash with other tokens is a miss
    assert pool.lookup(h(1), a, (1, 2)) is None
    assert pool.lookup(h(3), None, (1, 2)) is None


def test_ref_counts_pin_blocks():
    pool = BlockPool()
    a = pool.add(h(1), None, (1,))
    pool.ref([a])
    assert not pool.is_evictable(a)
    with pytest.raises(AssertionError):
        pool.remove(a)
    pool.unref([a])
    assert pool.is_evictable(a)
    pool.remove(a)
    assert len(pool) == 0 and pool.lookup(h(1), None, (1,)) is None


def test_removing_a_leaf_makes_its_parent_a_leaf():
    pool = BlockPool()
    a = pool.add(h(1), None, (1,))
    b = pool.add(h(2), a, (2,))
    with pytest.raises(AssertionError):
        pool.remove(a)
    pool.remove(b)
    assert pool.is_evictable(a)


def test_evictable_set_tracks_unreferenced_leaves():
    pool = BlockPool()
    a = pool.add(h(1), None, (1,))
    b = pool.add(h(2), a, (2,))
    c = pool.add(h(3), a, (3,))
    assert pool.evictable_ids() == {b, c} and (pool[a].depth, pool[b].end_blocks) == (0, 2)
    pool.ref([b])
    assert pool.evictable_ids() == {c}
    pool.remove(c)
    assert pool.evictable_ids() == set()  # a still has the pinned child b
    pool.unref([b])
    assert pool.evictable_ids() == {b}
    pool.remove(b)
    assert pool.evictable_ids() == {a}


def test_lru_touch_chain_puts_leaves_first():
    lru = LRUEviction()
    lru.touch_chain([10, 11, 12])  # root 10 ... leaf 12
    lru.touch(("checkpoint", 12))
    keys = [("kv", 10), ("kv", 11), ("kv", 12), ("checkpoint", 12)]
    for key in keys:
        lru.add_candidate(key, (0, 0, 1))
    assert lru.victim() == ("kv", 12)
    assert lru.candidates() == [("kv", 12), ("kv", 11), ("kv", 10), ("checkpoint", 12)]
    lru.touch_chain([10, 11])
    assert lru.candidates() == [("kv", 12), ("checkpoint", 12), ("kv", 11), ("kv", 10)]
    lru.remove_candidate(("kv", 12))  # e.g. pinned again: it keeps its recency but cannot go
    assert lru.victim() == ("checkpoint", 12) and lru.last_used(("kv", 12)) == 1


def test_pool_reports_evictable_changes():
    events = []
    pool = BlockPool(lambda block_id, evictable: events.append((block_id, evictable)))
    a = pool.add(h(1), None, (1, 2))
    b = pool.add(h(2), a, (3, 4))
    pool.ref([b])
    pool.unref([b])
    pool.remove(b)
    assert events == [(a, True), (a, False), (b, True), (b, False), (b, True), (b, False), (a, True)]


@pytest.mark.parametrize(
    "start,end,prompt,retention,expected",
    [
        (0, 100, 100, 0, [96]),  # last <= L and last < L coincide
        (0, 96, 96, 0, [80, 96]),  # a block-aligned prompt keeps the boundary below it too
        (0, 100, 100, 32, [32, 64, 96]),
        (0, 100, 100, 16, [16, 32, 48, 64, 80, 96]),
        (64, 100, 100, 16, [80, 96]),
        (100, 101, 100, 16, []),  # decode step inside a block
        (100, 112, 100, 16, [112]),
        (0, 10, 10, 0, []),  # shorter than a block
    ],
)
def test_retained_boundaries(start, end, prompt, retention, expected):
    assert retained_boundaries(start, end, prompt, 16, retention, 0, 1) == expected


@pytest.mark.parametrize(
    "prompt,tail,expected",
    [
        (33, 1, [32]),
        (33, 2, [16, 32]),  # a re-sent 33-token prompt may hit at most 31 tokens: 16
        (49, 2, [32, 48]),
        (32, 2, [16, 32]),
        (40, 2, [32]),
        (16, 2, [16]),
    ],
)
def test_retained_boundaries_keep_the_deepest_hit_a_re_sent_prompt_may_return(prompt, tail, expected):
    assert retained_boundaries(0, prompt, prompt, 16, 0, 0, tail) == expected
