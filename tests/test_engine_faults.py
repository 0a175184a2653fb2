"""The engine under operations on its cache from other threads: ``cache.clear()`` landing inside a step (it waits for
the step's end, as it waits for a running ``generate()`` call) and between steps; the running requests finish
exactly, the engine keeps serving, and a stopped engine leaves nothing pinned."""

import threading

import pytest
import torch
from conftest import assert_matches_cold, random_ids
from engine_scenarios import alone, config, finals, ids

from hf_hybridcache import HybridPrefixCache, _compat
from hf_hybridcache.core import check_store

PROMPTS = [ids(40 + i, seed=3110 + i) for i in range(8)]
NEW_TOKENS = 40


def _halve_budget(cache):
    cache.max_cache_bytes = max(cache.stored_bytes // 2, 1)


OPERATIONS = {"clear": lambda cache: cache.clear(), "halve_budget": _halve_budget}


def _clear_inside_forwards(cache, model, at: set[int], operation: str = "clear"):
    """A pre-hook on the first decoder layer that, at each forward in ``at``, runs ``operation`` on the cache from
    another thread and gives it 0.5 s (before the fix, clear() emptied the store under the running step)."""
    calls, threads = [0], []

    def hook(module, args):
        calls[0] += 1
        if calls[0] in at:
            thread = threading.Thread(target=OPERATIONS[operation], args=(cache,))
            thread.start()
            thread.join(0.5)
            threads.append(thread)

    return _compat.decoder_layers(model)[0].register_forward_pre_hook(hook), threads


@pytest.mark.parametrize("family,operation", [("jamba", "clear"), ("qwen3_5_text", "clear"), ("jamba", "halve_budget")])
def test_clear_inside_a_step_waits_for_it_and_every_request_finishes_exactly(family, operation, model, cold_model):
    """clear() (and its sibling, a smaller budget that evicts) from another thread while a step runs."""
    cache = HybridPrefixCache(model, retention_interval="dense")
    manager = cache.init_continuous_batching(config(max_new_tokens=NEW_TOKENS, eos_token_id=-1))
    manager.start()
    handle, threads = _clear_inside_forwards(cache, model, at={2, 20}, operation=operation)
    try:
        request_ids = manager.add_requests(PROMPTS)
        outputs = finals(manager, request_ids, timeout=120)
    finally:
        handle.remove()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    for request_id, prompt in zip(request_ids, PROMPTS):
        assert outputs[request_id].error is None
        assert outputs[request_id].generated_tokens == alone(cold_model, prompt, NEW_TOKENS, eos_token_id=-1)
    assert len(threads) == 2
    assert manager.is_running() and manager.background_thread_status.fatal_error is None
    # the engine still serves, from a store it refilled after the clears
    again = manager.add_requests([PROMPTS[0] + ids(5, seed=3120)])[0]
    output = finals(manager, [again])[again]
    assert output.generated_tokens == alone(cold_model, PROMPTS[0] + ids(5, seed=3120), NEW_TOKENS, eos_token_id=-1)
    manager.stop()
    assert cache.core.pinning == []
    check_store(cache)
    assert_matches_cold(model, cold_model, cache, random_ids(37, seed=3121), new_tokens=4)


@pytest.mark.parametrize("family", ["jamba"])
def test_clears_from_another_thread_while_requests_decode(family, model, cold_model):
    """The issue's scenario: clear() called again and again from the main thread while 8 requests decode."""
    cache = HybridPrefixCache(model, retention_interval="dense")
    manager = cache.init_continuous_batching(config(max_new_tokens=NEW_TOKENS, eos_token_id=-1))
    manager.start()
    request_ids = manager.add_requests(PROMPTS)
    outputs = {}
    waiter = threading.Thread(target=lambda: outputs.update(finals(manager, request_ids, timeout=120)))
    waiter.start()
    clears = 0
    while waiter.is_alive():
        cache.clear()
        clears += 1
    waiter.join()
    manager.stop()
    assert clears > 3
    for request_id, prompt in zip(request_ids, PROMPTS):
        assert outputs[request_id].generated_tokens == alone(cold_model, prompt, NEW_TOKENS, eos_token_id=-1)
    assert cache.core.pinning == []
    check_store(cache)


@pytest.mark.parametrize("family", ["jamba"])
def test_a_dying_loop_still_fails_every_request_and_unpins(family, model, monkeypatch):
    """When the loop itself dies (not a request's fault), every request gets a final output with the reason, the
    engine's pins leave the cache, and a new start() serves again."""
    cache = HybridPrefixCache(model)
    manager = cache.init_continuous_batching(config(max_new_tokens=30, eos_token_id=-1))
    manager.start()
    engine = manager.batch_processor
    steps = [0]
    original = engine.step

    def step():
        steps[0] += 1
        if steps[0] == 3:
            raise SystemError("boom")  # a fault of the loop, not of a request's forward
        return original()

    monkeypatch.setattr(engine, "step", step)
    request_ids = manager.add_requests(PROMPTS[:4])
    outputs = finals(manager, request_ids, timeout=60)
    assert all("the engine loop died" in outputs[r].error for r in request_ids)
    assert isinstance(manager.background_thread_status.fatal_error, SystemError)
    assert cache.core.pinning == []
    check_store(cache)
    manager.start()
    request_id = manager.add_requests([PROMPTS[0]])[0]
    assert finals(manager, [request_id])[request_id].error is None
    manager.stop()
    with torch.no_grad():
        assert cache.stats.requests >= 5


@pytest.mark.parametrize("family", ["jamba"])
def test_a_seed_torch_cannot_take_is_refused_at_once(family, model, cold_model):
    """A seed outside torch.Generator's range (or whose num_return_sequences children's seeds would be) failed inside
    a step; it is refused with the request's output, and the manager serves on."""
    cache = HybridPrefixCache(model)
    manager = cache.init_continuous_batching(config(max_new_tokens=4, do_sample=True, num_return_sequences=2))
    manager.start()
    bad = [manager.add_request(PROMPTS[0], seed=seed) for seed in (2**64, 2**64 - 1, -(2**63) - 1)]
    good = manager.add_request(PROMPTS[1], seed=2**64 - 2)
    outputs = finals(manager, [*bad, good])
    manager.stop()
    for request_id in bad:
        assert "seed must be in [-2**63, 2**64 - 2]" in outputs[request_id].error
    assert outputs[good].error is None and len(outputs[good].generated_tokens) == 4
