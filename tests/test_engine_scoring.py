"""Scores in the engine (engine/scoring.py, engine/score_store.py) on a Mamba-1, a gated-delta-net and a
sliding-window family: the prompt and generated tokens' logprobs of scoring requests equal the cold model's
log-softmax (fp32, within 1e-4) whether their prefix was computed, restored with its kept logprobs, split over chunked
prefills or recomputed after a preemption; the kept logprobs stay within their bytes; bad arguments are refused."""

import pytest
import torch
from engine_scenarios import config, finals, ids

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.core import check_store
from hf_hybridcache.engine import EngineLimits
from hf_hybridcache.engine.scoring import PROMPT_TOP_K

pytestmark = pytest.mark.parametrize("family", ["jamba", "qwen3_5_text", "lfm3"])
TOL = 1e-4


def reference(cold_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(cold_model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def check_scores(cold_model, output, prompt: list[int], top_k: int) -> None:
    """Every prompt token's score and every generated token's score equals the cold model's log-softmax, and their
    alternatives are its top-k values."""
    tokens = prompt + (output.generated_tokens if output.token_scores is not None else [])
    expected = reference(cold_model, tokens)
    scores = output.prompt_scores + (output.token_scores or [])
    assert scores[0] is None and len(scores) == len(tokens)
    for position in range(1, len(tokens)):
        score, row = scores[position], expected[position - 1]
        assert abs(score.logprob - row[tokens[position]].item()) < TOL, (position, score.logprob)
        k = PROMPT_TOP_K if position < len(prompt) else top_k
        torch.testing.assert_close(torch.tensor(score.top_logprobs), row.topk(k).values, atol=TOL, rtol=0)


def run(manager, requests: dict) -> dict:
    for name, (prompt, kwargs) in requests.items():
        manager.add_request(prompt, request_id=name, **kwargs)
    return finals(manager, list(requests))


def test_scores_with_hits_and_chunked_prefills_equal_the_log_softmax(model, cold_model):
    """Four scoring requests after one 150-token preamble, in chunks of 48 tokens: the first computes everything
    and keeps its prompt-end checkpoint at 144 with the logprobs up to it; the later ones restore them."""
    cache = HybridPrefixCache(model)
    preamble = ids(150, seed=980)
    prompts = {f"s{i}": preamble + ids(9 + 5 * i, seed=981 + i) for i in range(4)}
    manager = cache.init_continuous_batching(config(max_new_tokens=3), limits=EngineLimits(max_batch_tokens=48))
    manager.start()
    try:
        outputs = {}
        for name, prompt in prompts.items():  # one after another: each finds what the earlier ones stored
            outputs |= run(manager, {name: (prompt, {"prompt_logprobs": 5, "logprobs": 2})})
        engine = manager.batch_processor
        assert 0 < engine.scores.num_bytes <= engine.limits.max_score_bytes
    finally:
        manager.stop()
    for name, prompt in prompts.items():
        check_scores(cold_model, outputs[name], prompt, 2)
    assert [outputs[n].hit_tokens for n in prompts] == [0, 144, 144, 144]
    assert "logprobs of the 144 restored tokens and of the one after them came from the cache" in str(
        outputs["s1"].hit_report)
    check_store(cache)


def test_preempted_scoring_requests_score_exactly(model, cold_model):
    """Scoring requests that cannot all hold their pages (a store of a few blocks): preempted ones resume from what
    the store and their own scores hold."""
    cache = HybridPrefixCache(model)
    cache.max_cache_bytes = 3 * cache.spec.kv_block_bytes + cache.spec.checkpoint_bytes
    # 5 pages and 40 new tokens: requests that verify drafts finish in fewer steps, and with 6 pages and 30 tokens
    # the speculation run preempted none on Jamba
    limits = EngineLimits(max_running_requests=4, max_batch_tokens=48, max_running_pages=5, max_request_tokens=160)
    prompts = {f"r{i}": ids(20 + 7 * i, seed=990 + i) for i in range(6)}
    manager = cache.init_continuous_batching(config(max_new_tokens=40), limits=limits)
    manager.start()
    try:
        outputs = run(manager, {n: (p, {"prompt_logprobs": 3, "logprobs": 4}) for n, p in prompts.items()})
        assert manager.batch_processor.preempted > 0
    finally:
        manager.stop()
    for name, prompt in prompts.items():
        check_scores(cold_model, outputs[name], prompt, 4)
    check_store(cache)


def test_kept_logprobs_stay_within_their_bytes(model, cold_model):
    """A budget of about two blocks' scores: entries are evicted least recently used first, the bytes never pass it,
    and a request whose prefix's scores were evicted restores less and still scores exactly."""
    cache = HybridPrefixCache(model)
    limits = EngineLimits(max_score_bytes=2000)
    preamble = ids(70, seed=995)
    prompts = {f"b{i}": preamble + ids(12, seed=996 + i) for i in range(3)}
    manager = cache.init_continuous_batching(config(max_new_tokens=2), limits=limits)
    manager.start()
    try:
        outputs = {}
        for name, prompt in prompts.items():
            outputs |= run(manager, {name: (prompt, {"prompt_logprobs": 1})})
            assert manager.batch_processor.scores.num_bytes <= 2000
    finally:
        manager.stop()
    for name, prompt in prompts.items():
        check_scores(cold_model, outputs[name], prompt, 0)
    assert outputs["b2"].hit_report.reason == "prompt_logprobs"  # the store held more than the kept scores allow


def test_bad_scoring_arguments_are_refused(model):
    cache = HybridPrefixCache(model)
    manager = cache.init_continuous_batching(config())
    manager.start()
    try:
        for kwargs, says in (({"logprobs": 21}, "logprobs must be"), ({"prompt_logprobs": 6}, "prompt_logprobs must"),
                             ({"logprobs": True}, "logprobs must be"), ({"prompt_logprobs": -1}, "prompt_logprobs")):
            name = manager.add_request(ids(20, seed=999), **kwargs)
            (output,) = finals(manager, [name]).values()
            assert output.error is not None and says in output.error, (kwargs, output.error)
    finally:
        manager.stop()
