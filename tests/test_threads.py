"""generate() from several threads on one cache: calls on one view run one at a time, calls on different views run at
the same time (only store operations are serialized), every output equals its cold run; store-wide operations wait
for running calls; re-entrant use from inside a running call fails fast."""

import threading

import pytest
import torch
from conftest import assert_matches_cold, greedy, random_ids

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache, _compat
from hf_hybridcache.core import check_store

pytestmark = pytest.mark.parametrize("family", ["jamba", "zamba2"])

NUM_THREADS = 4
CALLS_PER_THREAD = 3


def _prompts():
    """Prompts sharing two system prompts, so concurrent calls hit and extend the same chains."""
    systems = [random_ids(40, seed=500), random_ids(24, seed=501)]
    return [
        [torch.cat([systems[(t + c) % 2], random_ids(5 + 7 * c + t, seed=510 + 10 * t + c)], dim=1)
         for c in range(CALLS_PER_THREAD)]
        for t in range(NUM_THREADS)
    ]


def _run_threads(target, num_threads):
    errors, barrier = [], threading.Barrier(num_threads)

    def run(t):
        try:
            barrier.wait()
            target(t)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a thread hangs"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("salted", [False, True])
def test_concurrent_generate_calls_match_cold_runs(model, cold_model, salted):
    cache = HybridPrefixCache(model, retention_interval="dense")
    prompts = _prompts()
    expected = {
        (t, c): greedy(cold_model, ids, new_tokens=6) for t, row in enumerate(prompts) for c, ids in enumerate(row)
    }
    got = {}

    def worker(t):
        view = cache.with_salt(f"tenant-{t % 2}") if salted else cache
        for c, ids in enumerate(prompts[t]):
            got[(t, c)] = (greedy(model, ids, view, new_tokens=6), list(view.last_hit_tokens))

    _run_threads(worker, NUM_THREADS)
    for key, (ref_seq, ref_logits) in expected.items():
        (seq, logits), hit = got[key]
        assert torch.equal(seq, ref_seq), f"call {key} (hit {hit}) differs from its cold run"
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    assert cache.stats.requests == NUM_THREADS * CALLS_PER_THREAD
    assert cache.stats.hit_tokens > 0
    check_store(cache)


def test_store_operations_wait_for_the_running_call_and_other_views_do_not(model, cold_model, tmp_path):
    """clear() and save() from other threads wait until the running generate() returns; a direct forward and a
    generate() on other views run meanwhile (the running call holds only its own view, and the store only for each
    store operation) and match their cold runs."""
    cache = HybridPrefixCache(model)
    ids = random_ids(50, seed=520)
    other = random_ids(37, seed=521)
    started, release = threading.Event(), threading.Event()

    class BlockingStreamer:
        def put(self, value):
            started.set()
            assert release.wait(timeout=60)

        def end(self):
            pass

    result = {}
    def generate():
        result["out"] = greedy(model, ids, cache, streamer=BlockingStreamer())

    generating = threading.Thread(target=generate)
    generating.start()
    assert started.wait(timeout=60)
    errors = []

    def recording(operation):
        def run():
            try:
                operation()
            except BaseException as error:  # reported by the main thread
                errors.append(error)

        return threading.Thread(target=run)

    def save():
        cache.save(tmp_path / "c.safetensors")

    def direct_forward():
        with torch.no_grad():
            result["direct"] = model(other, **{CACHE_KWARG: cache.with_salt("direct")}, use_cache=True).logits[:, -1]

    def generate_on_a_view():
        result["view"] = greedy(model, other, cache.with_salt("view"), new_tokens=4)

    running = [recording(direct_forward), recording(generate_on_a_view)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a call on another view waited for the running generate()"
    waiting = [recording(cache.clear), recording(save)]
    for thread in waiting:
        thread.start()
    for thread in waiting:
        thread.join(timeout=0.5)
        assert thread.is_alive(), "a store operation ran while another thread's generate() was running"
    release.set()
    generating.join(timeout=60)
    for thread in waiting:
        thread.join(timeout=60)
        assert not thread.is_alive()
    assert not errors, errors
    seq, logits = result["out"]
    ref_seq, ref_logits = greedy(cold_model, ids)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(result["direct"], cold_model(other).logits[:, -1], rtol=0, atol=1e-4)
    assert torch.equal(result["view"][0], greedy(cold_model, other, new_tokens=4)[0])
    check_store(cache)


@pytest.mark.parametrize("operation", ["generate", "generate on a view", "clear", "save", "budget"])
def test_reentrant_use_from_a_running_call_fails_fast(model, cold_model, tmp_path, operation):
    cache = HybridPrefixCache(model)
    ids = random_ids(50, seed=530)
    assert_matches_cold(model, cold_model, cache, ids)
    before = check_store(cache)
    actions = {
        "generate": lambda: model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=2),
        "generate on a view": lambda: model.generate(ids, **{CACHE_KWARG: cache.with_salt("x")}, max_new_tokens=2),
        "clear": cache.clear,
        "save": lambda: cache.save(tmp_path / "c.safetensors"),
        "budget": lambda: setattr(cache, "max_cache_bytes", 10**6),
    }
    caught = []

    class ReentrantStreamer:
        def put(self, value):
            if not caught:
                with pytest.raises(RuntimeError, match="generate") as info:
                    actions[operation]()
                caught.append(info.value)

        def end(self):
            pass

    out, _ = greedy(model, ids, cache, streamer=ReentrantStreamer())
    assert caught, "the streamer was never called"
    assert torch.equal(out, greedy(cold_model, ids)[0])
    check_store(cache, before)
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [48]


def test_two_caches_on_one_model_run_in_parallel(model, cold_model):
    """Caches do not share a lock: two of them on one model serve two threads at once, and generate()'s per-call
    override of the model's stateful flag is left behind by neither."""
    caches = [HybridPrefixCache(model), HybridPrefixCache(model)]
    prompts = _prompts()[:2]
    expected = {(t, c): greedy(cold_model, ids, new_tokens=6) for t in range(2) for c, ids in enumerate(prompts[t])}
    got = {}

    def worker(t):
        for c, ids in enumerate(prompts[t]):
            got[(t, c)] = greedy(model, ids, caches[t], new_tokens=6)

    _run_threads(worker, 2)
    for key, (ref_seq, ref_logits) in expected.items():
        assert torch.equal(got[key][0], ref_seq), f"call {key} differs from its cold run"
        torch.testing.assert_close(got[key][1], ref_logits, rtol=0, atol=1e-4)
    assert "_is_stateful" not in vars(model)
    for cache in caches:
        check_store(cache)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit], ids=["ctrl-c", "system-exit"])
@pytest.mark.parametrize("call", ["generate", "direct forward", "batch replay"])
def test_an_interrupt_inside_a_forward_releases_the_lock(model, cold_model, call, interrupt):
    """A BaseException that is not an Exception (Ctrl-C, SystemExit) raised inside a forward in one thread must leave
    the cache's lock free: a generate() from another thread then completes and matches its cold run."""
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(40, seed=700)
    greedy(model, ids, cache, new_tokens=2)  # stored entries, so the batch replays a hit

    def raise_interrupt(module, args):
        raise interrupt()

    handle = _compat.decoder_layers(model)[-1].register_forward_pre_hook(raise_interrupt)
    caught = []

    def interrupted():
        try:
            if call == "generate":
                model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=4)
            elif call == "direct forward":
                model(ids, **{CACHE_KWARG: cache}, use_cache=True)
            else:
                batch = torch.cat([ids, random_ids(40, seed=701)])
                model.generate(batch, **{CACHE_KWARG: cache}, max_new_tokens=4)
        except interrupt:
            caught.append(call)

    _run_threads(lambda t: interrupted(), 1)
    handle.remove()
    assert caught == [call]
    other = torch.cat([ids[:, :32], random_ids(9, seed=702)], dim=1)
    _run_threads(lambda t: assert_matches_cold(model, cold_model, cache, other, new_tokens=6), 1)
    assert cache.last_hit_tokens == [32]
    check_store(cache)
