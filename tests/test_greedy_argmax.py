"""A sampling manager's top-k 1 requests (the server's greedy ones) take the argmax of the logits without running
the temperature / top-k / top-p warpers, the softmax and the draw (engine/runner.py ``_argmax_rows``), and equal a
greedy solo run; a request that samples, or a processor that can move the argmax, keeps the warpers.

Power: with ``_argmax_rows`` answering False the first test fails (the warpers run); answering True for every row
fails the second (a sampled request never calls them)."""

import pytest
from conftest import random_ids
from engine_scenarios import alone
from transformers import ContinuousBatchingConfig, GenerationConfig

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.toy import build_model


@pytest.fixture(scope="module")
def models():
    return build_model("jamba"), build_model("jamba")


def _run(model, monkeypatch, sampling: dict, **config):
    calls = []
    cache = HybridPrefixCache(model)
    manager = cache.init_continuous_batching(
        GenerationConfig(do_sample=True, temperature=0.5, top_k=1, top_p=0.5, pad_token_id=0, **config),
        ContinuousBatchingConfig(per_request_processors=True))
    original = type(manager.processors).__call__
    monkeypatch.setattr(type(manager.processors), "__call__",
                        lambda self, *args: calls.append(1) or original(self, *args))
    prompt = random_ids(20, seed=5)[0].tolist()
    manager.start()
    try:
        manager.add_request(prompt, request_id="r", max_new_tokens=6, seed=None if sampling["top_k"] == 1 else 3,
                            **sampling)
        out = manager.get_result("r", timeout=120)
    finally:
        manager.stop()
    return prompt, out.generated_tokens, calls


def test_top_k_1_requests_take_the_argmax_without_the_warpers(models, monkeypatch):
    model, cold = models
    prompt, tokens, calls = _run(model, monkeypatch, {"temperature": 1.0, "top_k": 1, "top_p": 1.0})
    assert tokens == alone(cold, prompt, 6) and calls == []


def test_sampled_requests_and_other_processors_keep_the_warpers(models, monkeypatch):
    model, cold = models
    assert _run(model, monkeypatch, {"temperature": 0.8, "top_k": 50, "top_p": 0.9})[2]
    prompt, tokens, calls = _run(model, monkeypatch, {"temperature": 1.0, "top_k": 1, "top_p": 1.0},
                                 suppress_tokens=[7])  # a processor that moves the argmax
    assert calls
