"""Eviction cost against store size: the PrefixStore alone, with tiny tensors, under a request trace that evicts on
every request.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/eviction_scale.py
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/eviction_scale.py --entries 20000 --policies lru

Each request does what ``HybridPrefixCache`` does to the store: a lookup, then every full block of the prompt added
(found blocks are pinned, new ones stored, making room first), checkpoints at the two prompt-end boundaries and at the
divergence point, then the chain released. Prompts share one of ``--topics`` prefixes, then one of four branches,
then a tail of their own, so each request adds new KV blocks and checkpoints and, once the store is full, evicts.

For each policy the store is filled without eviction to ``--entries`` stored entries (KV blocks + checkpoints) and its
budget set to what it holds; the median time of a request is measured on it and on a small store of
``--small-entries`` entries (same trace); then the full store's budget is cut to 10% and the time that shrink takes
(one ``make_room``) is measured. The bars: median per request at most 2x the small store's, shrink at most 5 s.
Sizes: a KV block is 128 bytes, a checkpoint 4,160 (about 32 KV blocks, near Jamba-1.5-Mini's ratio), and the FLOP
model is Jamba-1.5-Mini's order of magnitude.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from hf_hybridcache.config import AttentionLayerSpec, MambaLayerSpec, ModelStateSpec, TensorSpec
from hf_hybridcache.hashing import root_hash
from hf_hybridcache.store import FlopModel, PrefixStore, make_eviction

BS = 16
SPEC = ModelStateSpec(
    attention=(AttentionLayerSpec(0, num_kv_heads=1, head_dim=1, dtype=torch.float32),),
    mamba=(MambaLayerSpec(1, conv=TensorSpec((4, 4), torch.float32), ssm=TensorSpec((32, 32), torch.float32)),),
    block_size=BS,
)
FLOPS = FlopModel(flops_per_token=2.4e10, flops_per_key=65536.0)
PREFIX_BLOCKS, BRANCH_BLOCKS, TAIL_BLOCKS = 6, 2, 4
ROOT = root_hash(b"seed", "eviction-scale")


def prompts(topics: int, seed: int):
    """An endless trace of prompts (token id lists) that share prefixes: topic, then branch, then a tail of their own
    and a partial block."""
    rng = random.Random(seed)
    serial = 0
    while True:
        topic, branch = rng.randrange(topics), rng.randrange(4)
        prefix = [100_000 + topic * 1_000 + i for i in range(PREFIX_BLOCKS * BS)]
        middle = [200_000 + topic * 100 + branch * 10 + i % 10 for i in range(BRANCH_BLOCKS * BS)]
        serial += 1
        tail = [1_000_000 + serial * 100 + i for i in range(TAIL_BLOCKS * BS + BS // 2)]
        yield prefix + middle + tail


def kv() -> dict[int, torch.Tensor]:
    return {0: torch.zeros(2, 1, BS, 1)}


def checkpoint() -> dict:
    return {1: (torch.zeros(1, 4, 4), torch.zeros(1, 32, 32))}


def run_request(store: PrefixStore, token_ids: list[int]) -> None:
    hit = store.lookup(token_ids)
    keep = {(len(token_ids) // BS) * BS, ((len(token_ids) - 1) // BS) * BS, hit.divergence_tokens}
    ids, parent_hash = [], None
    for start in range(0, len(token_ids) - BS + 1, BS):
        added = store.add_block(ids[-1] if ids else None, parent_hash, tuple(token_ids[start : start + BS]), kv)
        if added is None:
            break
        ids.append(added[0])
        parent_hash = added[1]
        if start + BS in keep:
            store.add_checkpoint(added[0], checkpoint())
    store.release(ids)


def filled_store(policy: str, entries: int, seed: int):
    """A store holding at least ``entries`` entries with its budget set to what it holds, and the trace going on."""
    store = PrefixStore(SPEC, ROOT, 2**60, eviction=make_eviction(policy, FLOPS))
    trace = prompts(max(8, entries // 60), seed)
    while store.num_kv_blocks + store.num_checkpoints < entries:
        run_request(store, next(trace))
    store.max_cache_bytes = store.stored_bytes
    return store, trace


def median_request_seconds(store: PrefixStore, trace, requests: int) -> float:
    times = []
    for _ in range(requests):
        started = time.perf_counter()
        run_request(store, next(trace))
        times.append(time.perf_counter() - started)
    assert store.evicted_kv_blocks + store.evicted_checkpoints > 0, "the trace did not evict"
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=10_000, help="entries in the large store")
    parser.add_argument("--small-entries", type=int, default=200, help="entries in the small store")
    parser.add_argument("--requests", type=int, default=200, help="timed requests per store")
    parser.add_argument("--policies", default="lru,flop_aware", help="comma-separated eviction policies")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for policy in args.policies.split(","):
        small, small_trace = filled_store(policy, args.small_entries, args.seed)
        small_s = median_request_seconds(small, small_trace, args.requests)
        large, large_trace = filled_store(policy, args.entries, args.seed)
        held = large.num_kv_blocks + large.num_checkpoints
        large_s = median_request_seconds(large, large_trace, args.requests)
        evictions = large.evicted_kv_blocks + large.evicted_checkpoints
        before = large.num_kv_blocks + large.num_checkpoints
        large.max_cache_bytes //= 10
        started = time.perf_counter()
        assert large.make_room(0), "the shrink could not fit"
        shrink_s = time.perf_counter() - started
        after = large.num_kv_blocks + large.num_checkpoints
        rows.append([
            policy, f"{held:,}", f"{evictions / args.requests:.1f}", f"{small_s * 1e3:.2f} ms",
            f"{large_s * 1e3:.2f} ms", f"{large_s / small_s:.2f}x", f"{before:,} -> {after:,}", f"{shrink_s:.2f} s",
        ])
    header = ["policy", "entries", "evictions / request", f"median request, {args.small_entries} entries",
              "median request, large store", "ratio (bar <= 2x)", "shrink to 10% (entries)", "shrink time (bar <= 5 s)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
