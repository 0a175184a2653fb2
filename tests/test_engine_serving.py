"""The richer continuous-batching scenarios, on a Mamba-1, a gated-delta-net and a sliding-window family: long and
one-token prompts, EOS mid-run, different max_new_tokens, cancellations, bad requests, a forward that raises,
preemption under tight memory bounds, sampling, stop() with requests in flight, and generate() calls in another
thread on the same cache. Every request that succeeds equals itself alone with generate() and no cache."""

import threading
import time

import pytest
import torch
from conftest import greedy, random_ids
from engine_scenarios import alone, config, finals, ids
from transformers import ContinuousBatchingConfig

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.core import check_store
from hf_hybridcache.engine import EngineLimits

pytestmark = pytest.mark.parametrize("family", ["jamba", "qwen3_5_text", "lfm3"])


def run(manager, requests: dict) -> dict:
    """Add ``{name: (prompt, kwargs)}`` to a started manager and wait for every final output."""
    for name, (prompt, kwargs) in requests.items():
        manager.add_request(prompt, request_id=name, **kwargs)
    return finals(manager, list(requests))


def test_long_and_short_prompts_eos_and_lengths_match_each_alone(model, cold_model):
    cache = HybridPrefixCache(model, retention_interval=256)
    long_prompt = ids(2000, seed=930)
    reference = alone(cold_model, ids(25, seed=931), 12, eos_token_id=-1)
    eos = reference[4]  # the request stops at its 5th token (or earlier if it repeats)
    requests = {
        "long": (long_prompt, dict(max_new_tokens=5)),
        "one": (ids(1, seed=932), dict(max_new_tokens=9)),
        "eos": (ids(25, seed=931), dict(max_new_tokens=12, eos_token_id=eos)),
        "longer": (long_prompt[:1500] + ids(30, seed=933), dict(max_new_tokens=3)),
    }
    manager = cache.init_continuous_batching(config(), limits=EngineLimits(max_batch_tokens=256))
    manager.start()
    try:
        outputs = run(manager, requests)
    finally:
        manager.stop()
    for name, (prompt, kwargs) in requests.items():
        expected = alone(cold_model, prompt, kwargs["max_new_tokens"], kwargs.get("eos_token_id"))
        assert outputs[name].generated_tokens == expected, name
    assert outputs["eos"].generated_tokens[-1] == eos and len(outputs["eos"].generated_tokens) <= 5
    # longer arrives with long and waits for long to compute their shared 1,488 tokens, which keeps a checkpoint there
    assert outputs["longer"].hit_tokens == 1488
    check_store(cache)


def test_context_manager_add_requests_and_streaming(model, cold_model, speculation):
    """transformers' own verbs on the model: continuous_batching_context_manager, add_requests, request_id_iter."""
    cache = HybridPrefixCache(model)
    prompts = [ids(18, seed=925), ids(37, seed=926)]
    with model.continuous_batching_context_manager(generation_config=config(max_new_tokens=5)) as manager:
        first, second = manager.add_requests(prompts, max_new_tokens=5, streaming=True)
        streamed = [output.generated_tokens for output in manager.request_id_iter(first)]
        final = finals(manager, [second])[second]
    assert manager.batch_processor is not None and not manager.is_running()
    expected = alone(cold_model, prompts[0], 5)
    if speculation == "plain":
        assert streamed == [expected[:n] for n in range(1, 6)]  # one output per token, the last one final
    else:  # one output per step, which may emit several tokens
        assert [expected[: len(tokens)] for tokens in streamed] == streamed and streamed[-1] == expected
        assert all(len(a) < len(b) for a, b in zip(streamed, streamed[1:]))
    assert final.generated_tokens == alone(cold_model, prompts[1], 5)
    assert cache.stats.requests == 2
    check_store(cache)


def test_bad_requests_and_cancellations_disturb_no_one(model, cold_model):
    cache = HybridPrefixCache(model)
    good = {name: ids(30 + i, seed=940 + i) for i, name in enumerate(["g0", "g1", "g2"])}
    manager = cache.init_continuous_batching(config(max_new_tokens=8))
    manager.start()
    try:
        manager.add_request(good["g0"], request_id="g0")
        manager.add_request([], request_id="empty")
        manager.add_request([5, 10**6], request_id="vocab")
        manager.add_request(ids(10, seed=949), request_id="kwargs", temperature="hot")
        manager.add_request(ids(10, seed=948), request_id="huge", max_new_tokens=10**9)
        manager.add_request(ids(40, seed=947), request_id="cancel", max_new_tokens=200, streaming=True)
        manager.add_request(good["g1"], request_id="g1")
        assert manager.get_result(request_id="cancel", timeout=120) is not None  # it runs
        manager.cancel_request("cancel")
        manager.add_request(good["g2"], request_id="g2")
        outputs = finals(manager, ["empty", "vocab", "kwargs", "huge", "cancel", "g0", "g1", "g2"])
        engine = manager.batch_processor
        assert engine.slots.num_free == engine.slots.num_slots  # every slot back once the others finished
    finally:
        manager.stop()
    assert "empty" in outputs["empty"].error and "vocabulary" in outputs["vocab"].error
    assert "temperature" in outputs["kwargs"].error and "limit" in outputs["huge"].error
    assert outputs["cancel"].error == "cancelled" and len(outputs["cancel"].generated_tokens) < 200
    for name, prompt in good.items():
        assert outputs[name].error is None and outputs[name].generated_tokens == alone(cold_model, prompt, 8), name
    check_store(cache)


def test_a_forward_that_raises_fails_only_its_request(model, cold_model):
    cache = HybridPrefixCache(model)
    poison = [9, 7, 11]  # a run of tokens only the bad request's prompt holds

    def raise_on_poison(module, args):
        if any(args[0][0, i : i + 3].tolist() == poison for i in range(args[0].shape[1] - 2)):
            raise RuntimeError("poisoned input")

    good = {name: ids(24 + 3 * i, seed=950 + i) for i, name in enumerate(["a", "b", "c"])}
    handle = model.get_input_embeddings().register_forward_pre_hook(raise_on_poison)
    manager = cache.init_continuous_batching(config(max_new_tokens=6))
    manager.start()
    try:
        manager.add_request(good["a"], request_id="a")
        manager.add_request(good["b"], request_id="b")
        manager.add_request([10, *poison, 12], request_id="bad")
        manager.add_request(good["c"], request_id="c")
        outputs = finals(manager, ["a", "b", "bad", "c"])
        assert manager.background_thread_status.fatal_error is None and manager.is_running()
    finally:
        manager.stop()
        handle.remove()
    assert "poisoned input" in outputs["bad"].error
    for name, prompt in good.items():
        assert outputs[name].error is None and outputs[name].generated_tokens == alone(cold_model, prompt, 6), name
    check_store(cache)


def test_preemption_under_tight_bounds_recomputes_exactly(model, cold_model):
    """Six requests that cannot all hold their pages at once (a store budget of a few blocks keeps them from handing
    their pages to the store): the newest are preempted and resume from what the store holds."""
    cache = HybridPrefixCache(model)
    cache.max_cache_bytes = 3 * cache.spec.kv_block_bytes + cache.spec.checkpoint_bytes
    limits = EngineLimits(max_running_requests=4, max_batch_tokens=48, max_running_pages=6, max_request_tokens=160)
    prompts = {f"r{i}": ids(20 + 7 * i, seed=960 + i) for i in range(6)}
    manager = cache.init_continuous_batching(config(max_new_tokens=40), limits=limits)
    manager.start()
    try:
        outputs = run(manager, {name: (prompt, {}) for name, prompt in prompts.items()})
        engine = manager.batch_processor
        assert engine.preempted > 0
        assert engine.peak_running_pages <= limits.max_running_pages and engine.peak_batch_tokens <= 48
    finally:
        manager.stop()
    for name, prompt in prompts.items():
        assert outputs[name].generated_tokens == alone(cold_model, prompt, 40), name
    check_store(cache)


def test_sampling_and_return_sequences(model, cold_model):
    cache = HybridPrefixCache(model)
    prompt = ids(30, seed=970)
    sampled = config(max_new_tokens=6, do_sample=True, top_k=1, num_return_sequences=3)
    outputs = model.generate_batch([prompt], generation_config=sampled)
    assert sorted(outputs) == ["req_0", "req_0__child#0", "req_0__child#1"]
    expected = alone(cold_model, prompt, 6)  # top-k 1 samples the argmax
    assert all(o.generated_tokens == expected for o in outputs.values())
    assert sorted(o.hit_tokens for o in outputs.values()) == [0, 16, 16]  # the children hit the parent's prompt
    free = config(max_new_tokens=8, do_sample=True, temperature=1.5, top_p=0.9)
    outputs = model.generate_batch([prompt, ids(12, seed=971)], generation_config=free)
    for output in outputs.values():
        assert output.error is None and len(output.generated_tokens) <= 8
        assert all(0 <= t < model.config.vocab_size for t in output.generated_tokens)
    check_store(cache)


def test_a_seeded_request_samples_the_same_tokens_alone_and_beside_others(model, cold_model):
    """A request with a seed draws from its own generator: alone, or added with other sampled requests (which draw
    from the shared generator before it in the same steps), it gets the same tokens; another seed gets others."""
    cache = HybridPrefixCache(model)
    prompt, others = ids(30, seed=990), [ids(20 + i, seed=991 + i) for i in range(3)]
    manager = cache.init_continuous_batching(config(max_new_tokens=12, do_sample=True, temperature=1.5))
    manager.start()
    try:
        manager.add_request(prompt, request_id="alone", seed=11, eos_token_id=-1)
        alone_tokens = finals(manager, ["alone"])["alone"].generated_tokens
        for i, other in enumerate(others):
            manager.add_request(other, request_id=f"other{i}", eos_token_id=-1)
        manager.add_request(prompt, request_id="beside", seed=11, eos_token_id=-1)
        manager.add_request(prompt, request_id="another", seed=12, eos_token_id=-1)
        manager.add_request(prompt, request_id="bad", seed="eleven")
        outputs = finals(manager, ["beside", "another", "bad"] + [f"other{i}" for i in range(3)])
    finally:
        manager.stop(block=True)
    assert len(alone_tokens) == 12
    assert outputs["beside"].generated_tokens == alone_tokens
    assert outputs["another"].generated_tokens != alone_tokens
    assert outputs["bad"].error == "seed must be an int or None, got 'eleven'."
    check_store(cache)


def test_an_unseeded_request_samples_the_same_tokens_beside_a_seeded_one(model):
    """Seeded requests draw only from their own generators, so with the manager's shared generator seeded, an
    unseeded request samples the same tokens alone and beside a seeded request added before it."""
    cache = HybridPrefixCache(model)
    prompt, seeded_prompt = ids(30, seed=996), ids(26, seed=997)
    tokens = []
    for beside in (False, True):
        manager = cache.init_continuous_batching(config(max_new_tokens=12, do_sample=True, temperature=1.5),
                                                 ContinuousBatchingConfig(seed=5))
        manager.start()
        try:
            if beside:
                manager.add_request(seeded_prompt, request_id="seeded", seed=3, eos_token_id=-1)
            manager.add_request(prompt, request_id="shared", eos_token_id=-1)
            outputs = finals(manager, ["shared", "seeded"] if beside else ["shared"])
        finally:
            manager.stop(block=True)
        tokens.append(outputs["shared"].generated_tokens)
    assert len(tokens[0]) == 12 and tokens[1] == tokens[0]
    check_store(cache)


def test_stop_returns_promptly_with_requests_in_flight(model):
    cache = HybridPrefixCache(model)
    manager = cache.init_continuous_batching(config(max_new_tokens=500))
    manager.start()
    for i in range(3):
        manager.add_request(ids(30, seed=980 + i), request_id=f"r{i}", streaming=True, eos_token_id=-1)
    assert manager.get_result(request_id="r0", timeout=120) is not None
    started = time.perf_counter()
    manager.stop(block=True, timeout=0.5)
    assert time.perf_counter() - started < 30 and not manager.is_running()
    outputs = finals(manager, ["r0", "r1", "r2"])
    assert all(o.error == "stopped" and len(o.generated_tokens) < 500 for o in outputs.values())
    assert manager.add_request([5, 6]) is None  # a stopped manager takes nothing
    check_store(cache)


def test_generate_in_another_thread_beside_the_engine(model, cold_model):
    """generate() calls on the same cache from another thread run beside the engine's steps (neither waits for the
    other's whole call) and both reuse what the other stored."""
    cache = HybridPrefixCache(model, retention_interval="dense")
    shared = ids(48, seed=990)
    engine_prompts = {f"e{i}": shared + ids(5 + i, seed=991 + i) for i in range(4)}
    thread_prompts = [torch.cat([torch.tensor([shared]), random_ids(9 + i, seed=995 + i)], dim=1) for i in range(3)]
    got = {}

    def generate_calls():
        for i, prompt in enumerate(thread_prompts):
            got[i] = (greedy(model, prompt, cache.with_salt(None), new_tokens=5)[0], None)

    manager = cache.init_continuous_batching(config(max_new_tokens=10))
    manager.start()
    thread = threading.Thread(target=generate_calls)
    try:
        thread.start()
        outputs = run(manager, {name: (prompt, {}) for name, prompt in engine_prompts.items()})
        thread.join(timeout=600)
        assert not thread.is_alive()
    finally:
        manager.stop()
    for name, prompt in engine_prompts.items():
        assert outputs[name].generated_tokens == alone(cold_model, prompt, 10), name
    for i, prompt in enumerate(thread_prompts):
        assert torch.equal(got[i][0], greedy(cold_model, prompt, new_tokens=5)[0])
    assert cache.stats.hit_tokens >= 48 * 5
    check_store(cache)


def test_engine_requests_report_why_they_hit(model):
    """Each engine output carries its HitReport (the same one ``cache.explain()`` predicts), and the reasons are
    counted in ``stats.misses_by_reason`` like generate()'s."""
    cache = HybridPrefixCache(model)
    prompt = random_ids(40, seed=760)[0].tolist()
    first = model.generate_batch([prompt], generation_config=config(2))
    predicted = cache.explain(prompt)
    second = model.generate_batch([prompt], generation_config=config(2))
    (out1,), (out2,) = first.values(), second.values()
    assert out1.hit_report.reason == "new_tokens" and out1.hit_tokens == 0
    assert out2.hit_report == predicted and (predicted.reason, predicted.hit_tokens) == ("complete", 32)
    assert cache.stats.misses_by_reason["new_tokens"] == 1 and cache.stats.misses_by_reason["complete"] == 1


def test_a_copy_of_the_model_is_not_served_by_the_original_cache(model):
    """A deep copy (or an unpickled copy) of a model carries the continuous-batching hook but not the cache it was
    built for: it gets a ValueError that says to build a cache for it, not a manager that runs the original model."""
    import copy

    cache = HybridPrefixCache(model)
    twin = copy.deepcopy(model)
    with pytest.raises(ValueError, match="this model is a copy"):
        twin.init_continuous_batching()
    twin_cache = HybridPrefixCache(twin)
    assert twin.init_continuous_batching().cache is twin_cache
    assert model.init_continuous_batching().cache is cache
