"""The page pool: ref-counted pages of per-layer pool tensors that grow on demand; a stored block is a page, read per
block (views), per request (one gather per layer) or per token row."""

import threading

import pytest
import torch

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.config import AttentionLayerSpec
from hf_hybridcache.store.kv_store import KVStore
from hf_hybridcache.store.pages import PagePool

BS = 4
LAYERS = (
    AttentionLayerSpec(1, num_kv_heads=2, head_dim=3, dtype=torch.float32),
    AttentionLayerSpec(5, num_kv_heads=1, head_dim=6, dtype=torch.float32, value_head_dim=2),  # MLA-like widths
)


def block(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {a.layer_idx: (torch.randn(a.num_kv_heads, BS, a.head_dim, generator=g),
                          torch.randn(a.num_kv_heads, BS, a.value_head_dim, generator=g)) for a in LAYERS}


def test_pages_are_ref_counted_and_reused_from_the_free_list():
    pool = PagePool(LAYERS, BS, lambda idx: torch.device("cpu"), initial_pages=4)
    first = pool.allocate(3)
    assert first == [0, 1, 2] and pool.num_used == 3 and pool.num_free == 1
    pool.ref([1])
    pool.unref([0, 1])
    assert pool.ref_count(1) == 1 and pool.num_free == 2
    assert pool.allocate(1) == [0]  # the page freed last comes back first
    with pytest.raises(AssertionError):
        pool.unref([3])


def test_the_pool_grows_on_demand_and_keeps_its_pages():
    pool = PagePool(LAYERS, BS, lambda idx: torch.device("cpu"), initial_pages=2)
    pages = pool.allocate(2)
    for page in pages:
        pool.write_block(page, block(page))
    assert pool.capacity == 2 and pool.reserved_bytes == 2 * pool.page_bytes
    more = pool.allocate(3)  # doubles past the need
    assert pool.capacity == 5 and more == [2, 3, 4]
    for page in pages:
        for idx, (keys, values) in pool.block(page).items():
            assert torch.equal(keys, block(page)[idx][0]) and torch.equal(values, block(page)[idx][1])


def test_gather_rows_and_blocks_agree():
    pool = PagePool(LAYERS, BS, lambda idx: torch.device("cpu"))
    pages = pool.allocate(3)
    for page in pages:
        pool.write_block(page, block(10 + page))
    order = torch.tensor([2, 0])
    keys, values = pool.gather(5, order, room_tokens=3)
    expected = torch.cat([block(12)[5][0], block(10)[5][0]], dim=1)[None]
    assert torch.equal(keys, expected) and keys.shape == (1, 1, 2 * BS, 6)
    assert keys.stride(-3) == (2 * BS + 3) * 6  # the leading view of a buffer with room for 3 more tokens
    assert torch.equal(values, torch.cat([block(12)[5][1], block(10)[5][1]], dim=1)[None])
    rows = torch.tensor([2 * BS + 1, 0 * BS + 3])  # token 1 of page 2, token 3 of page 0
    row_keys, row_values = pool.read_rows(1, rows)
    assert torch.equal(row_keys[0], block(12)[1][0][:, 1]) and torch.equal(row_values[1], block(10)[1][1][:, 3])
    pool.write_rows(1, rows, torch.zeros(2, 2, 3), torch.ones(2, 2, 3))
    assert torch.equal(pool.block(2)[1][0][:, 1], torch.zeros(2, 3))
    assert torch.equal(pool.block(0)[1][1][:, 3], torch.ones(2, 3))


def test_growth_waits_for_a_forward_in_use():
    pool = PagePool(LAYERS, BS, lambda idx: torch.device("cpu"), initial_pages=1)
    pool.allocate(1)
    grown = threading.Event()

    def grow():
        pool.allocate(4)
        grown.set()

    with pool.in_use():
        thread = threading.Thread(target=grow)
        thread.start()
        assert not grown.wait(timeout=0.3), "the pool grew under a forward using it"
    assert grown.wait(timeout=30)
    thread.join()


def test_kv_store_adopts_pages_by_reference():
    store = KVStore(LAYERS, BS)
    store.put(7, block(1))
    page = store.pages.allocate(1)[0]
    store.pages.write_block(page, block(2))
    store.adopt(8, page)
    assert store.page_of(8) == page and store.pages.ref_count(page) == 2
    assert store.num_bytes == 2 * store.pages.page_bytes
    store.remove(8)
    assert store.pages.ref_count(page) == 1  # the writer still holds it
    store.clear()
    assert len(store) == 0 and store.pages.ref_count(page) == 1


@pytest.mark.parametrize("family", ["jamba"])
def test_a_small_cache_does_not_reserve_its_budget(model):
    """The default 2 GiB budget is a bound, not an allocation: the pool holds about what is stored."""
    cache = HybridPrefixCache(model)
    ids = torch.randint(6, 200, (1, 100))
    model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=2, do_sample=False)
    pages = cache.store.pages
    assert cache.stats.kv_blocks == 6
    assert pages.reserved_bytes <= 2 * max(pages.num_used, 16) * pages.page_bytes

