"""500 random requests under random small budgets and both policies: every output equals its cold run and the
budget holds after every stored entry (Jamba only, to keep the suite short)."""

import random

import pytest
import torch
from conftest import greedy

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.toy import VOCAB_SIZE, build_model

NUM_REQUESTS = 500
SEGMENTS = 5  # a new cache (budget, policy, retention, admission) every NUM_REQUESTS / SEGMENTS requests


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(6, VOCAB_SIZE) for _ in range(n)]


def _prompt(rng: random.Random, trunks: list[list[int]], history: list[list[int]]) -> list[int]:
    """A trunk cut anywhere plus a random tail; sometimes a repeat or an extension of an earlier sequence."""
    kind = rng.random()
    if history and kind < 0.2:
        return list(rng.choice(history[-20:]))
    if history and kind < 0.45:
        return rng.choice(history[-20:]) + _tokens(rng, rng.randint(1, 20))
    trunk = rng.choice(trunks)
    return trunk[: rng.randint(1, len(trunk))] + _tokens(rng, rng.randint(1, 24))


def _guard_budget(cache: HybridPrefixCache) -> None:
    """Assert the budget after every KV block and checkpoint the store keeps (each call stores at most one)."""
    store = cache.store
    for name in ("add_block", "add_checkpoint"):
        add = getattr(store, name)

        def checked_add(*args, add=add, **kwargs):
            added = add(*args, **kwargs)
            assert store.stored_bytes <= store.max_cache_bytes, "the budget was exceeded"
            return added

        setattr(store, name, checked_add)


@pytest.mark.slow
def test_random_requests_match_cold_runs_under_random_budgets():
    rng = random.Random(1234)
    model, cold_model = build_model("jamba", seed=0), build_model("jamba", seed=0)
    probe = HybridPrefixCache(model)
    kv_bytes, checkpoint_bytes = probe.spec.kv_block_bytes, probe.spec.checkpoint_bytes
    trunks = [_tokens(rng, rng.randint(20, 70)) for _ in range(4)]
    cold: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    history: list[list[int]] = []
    hits = evictions = 0
    for segment in range(SEGMENTS):
        budget = rng.randint(4, 24) * kv_bytes + rng.randint(2, 8) * checkpoint_bytes
        cache = HybridPrefixCache(
            model,
            retention_interval=rng.choice([0, 0, 32, "dense"]),
            max_cache_bytes=budget,
            admit_divergence=rng.random() < 0.7,
            eviction=("lru", "flop_aware")[segment % 2],
        )
        _guard_budget(cache)
        for _ in range(NUM_REQUESTS // SEGMENTS):
            prompt = _prompt(rng, trunks, history)
            new_tokens = rng.randint(1, 3)
            key = (*prompt, new_tokens)
            ids = torch.tensor([prompt])
            if key not in cold:
                cold[key] = greedy(cold_model, ids, None, new_tokens)
            seq, logits = greedy(model, ids, cache, new_tokens)
            assert torch.equal(seq, cold[key][0]), f"tokens differ from the cold run (hit {cache.last_hit_tokens})"
            torch.testing.assert_close(logits, cold[key][1], rtol=0, atol=1e-4)
            assert cache.stats.stored_bytes <= budget
            hits += cache.last_hit_tokens[0] > 0
            history.append(seq[0].tolist())
        evictions += cache.stats.evicted_kv_blocks + cache.stats.evicted_checkpoints
    # The trace exercised what it is meant to: many hits and many evictions.
    assert hits > NUM_REQUESTS // 4 and evictions > NUM_REQUESTS, (hits, evictions)
