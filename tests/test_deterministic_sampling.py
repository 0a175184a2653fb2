"""deterministic=True with sampling and at high concurrency (issue 46): a seeded sampled request gets the same tokens
and logprobs alone, among 16 or 32 concurrent requests of mixed lengths at several prefill chunk sizes, and after its
prompt was stored (a prefix hit); greedy requests among 32 equal each one alone; the server's seeded completions through
the ``openai`` client are the same bits alone and among 16 concurrent ones. In float32 and bfloat16, on Mamba (pure
SSM), Jamba (Mamba-1 + attention + routed experts) and Qwen3.5's text model (gated delta net + gated attention).

A seeded request samples from its own generator (``add_request(seed=...)``), and in deterministic mode its logits are
the same bits in any batch, so temperature, top-k / top-p and the draw see the same numbers: the sampled tokens agree
as long as every logits processor and the draw reduce a row on its own (they do: per-row softmax, sort and cumsum).

Power: with the mode off, some float32 case of this bank differs (the engine's logprobs move with the batch).
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import test_deterministic
import torch
from engine_scenarios import finals, ids
from test_serve import Server
from transformers import ContinuousBatchingConfig, GenerationConfig

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.models.deterministic import SUPPORTED
from hf_hybridcache.serve.__main__ import make_app, parse_args

SAMPLING = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.95, pad_token_id=0)
GREEDY = dict(do_sample=False, pad_token_id=0)
BASE = ids(60, seed=4700)
#: 32 prompts of 1-70 tokens; every fourth shares BASE's first 40 tokens (hits inside the engine).
PROMPTS = [BASE[:40] + ids(1 + n % 9, seed=4710 + n) if n % 4 == 0 else ids(1 + (7 * n) % 70, seed=4750 + n)
           for n in range(32)]
FAMILIES = ["mamba", "jamba", "qwen3_5_text"]
#: Every family the mode accepts, and Granite-4.0-H's, Nemotron-H's and Inkling's toys with routed experts
#: (test_deterministic.VARIANTS); each toy is the bank's (test_deterministic.toy: widths off the CPU's vector width).
ALL_FAMILIES = sorted(SUPPORTED) + ["granitemoehybrid-moe", "nemotron_h-moe", "inkling_text-moe"]


def serve(family, dtype, prompts, seeds, max_batch_tokens, deterministic=True, generation=SAMPLING, cache=None):
    """Each request's (tokens, logprobs) from one engine run of ``prompts`` sent together (``seeds[i]`` each), the
    cache, and the prompt tokens the run took from it."""
    if cache is None:
        cache = HybridPrefixCache(test_deterministic.toy(family, dtype), deterministic=deterministic)
    manager = cache.init_continuous_batching(GenerationConfig(max_new_tokens=6, **generation),
                                             ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens,
                                                                      return_logprobs=True))
    manager.start()
    try:
        names = [manager.add_request(p, max_new_tokens=6, seed=s) for p, s in zip(prompts, seeds)]
        outputs = finals(manager, names)
    finally:
        manager.stop()
    for name in names:
        assert outputs[name].error is None, outputs[name].error
    return ([(outputs[name].generated_tokens, list(outputs[name].logprobs)) for name in names], cache,
            sum(outputs[name].hit_tokens for name in names))


def alone(family, dtype, prompts, seeds, deterministic=True, generation=SAMPLING):
    """Each request alone in a fresh engine over a fresh cache (chunk 512: one prefill step each)."""
    return [serve(family, dtype, [p], [s], 512, deterministic, generation)[0][0] for p, s in zip(prompts, seeds)]


def sampled_case(family, dtype, count, max_batch_tokens, deterministic=True) -> bool:
    prompts, seeds = PROMPTS[:count], [1000 + n for n in range(count)]
    reference = alone(family, dtype, prompts, seeds, deterministic)
    together, cache, _ = serve(family, dtype, prompts, seeds, max_batch_tokens, deterministic)
    again, _, _ = serve(family, dtype, prompts, seeds, max_batch_tokens, deterministic, cache=cache)
    return together == reference and again == reference


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    return request.param


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("count, max_batch_tokens", [(16, 16), (16, 48), (32, 512)])
def test_seeded_sampled_requests_equal_each_alone_in_any_batch_and_after_a_hit(family, dtype, count,
                                                                                max_batch_tokens):
    prompts, seeds = PROMPTS[:count], [1000 + n for n in range(count)]
    reference = alone(family, dtype, prompts, seeds)
    together, cache, _ = serve(family, dtype, prompts, seeds, max_batch_tokens)
    assert together == reference
    again, _, hits = serve(family, dtype, prompts, seeds, max_batch_tokens, cache=cache)
    assert hits >= sum(len(p) - 1 for p in prompts) // 16 * 16 - 16 * count  # each stored prompt's blocks hit
    assert again == reference
    assert len({tuple(tokens) for tokens, _ in reference}) > count // 2  # sampling, not a constant reply


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
def test_thirty_two_greedy_requests_equal_each_alone(family, dtype, max_batch_tokens):
    seeds = [None] * len(PROMPTS)
    reference = alone(family, dtype, PROMPTS, seeds, generation=GREEDY)
    together, _, _ = serve(family, dtype, PROMPTS, seeds, max_batch_tokens, generation=GREEDY)
    assert together == reference


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_thirty_two_greedy_requests_of_every_family_equal_each_alone(family, dtype):
    seeds = [None] * len(PROMPTS)
    reference = alone(family, dtype, PROMPTS, seeds, generation=GREEDY)
    together, _, _ = serve(family, dtype, PROMPTS, seeds, 48, generation=GREEDY)
    assert together == reference


def test_with_the_mode_off_some_case_differs():
    assert not all(sampled_case(family, torch.float32, 16, 16, deterministic=False) for family in FAMILIES)


@pytest.mark.parametrize("model", ["toy:mamba", "toy:qwen3_5_text"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_server_seeded_completions_are_bitwise_alone_and_among_sixteen(model, dtype):
    prompts = [f"Request {n}: " + "the deterministic mode " * (n % 5) for n in range(16)]
    server = Server(make_app(parse_args(["--model", model, "--dtype", dtype, "--deterministic"])))

    def complete(prompt_seed):
        prompt, seed = prompt_seed
        reply = server.client().completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0.9,
                                                   top_p=0.95, seed=seed, logprobs=1)
        return reply.choices[0].text, reply.choices[0].logprobs.token_logprobs

    try:
        work = [(prompt, 7 + n) for n, prompt in enumerate(prompts)]
        single = [complete(item) for item in work]
        with ThreadPoolExecutor(len(work)) as pool:
            together = list(pool.map(complete, work))
        assert together == single
        assert len({text for text, _ in single}) > 8
    finally:
        server.close()


def test_a_saved_deterministic_cache_loads_in_its_mode_and_hits_bitwise(tmp_path):
    """save/load keeps the mode: a file saved in deterministic mode loads in it (the default) and its hits give cold
    runs' bits; asked for the other mode, either file is refused and nothing is loaded; the two modes' block hashes
    differ, so a tier or a file never hands one mode's states to the other."""
    from hf_hybridcache.core import entry_digests

    def fresh():
        return test_deterministic.toy("jamba", torch.bfloat16)

    def greedy(cache, model, prompt):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), cache=cache, max_new_tokens=5, min_new_tokens=5,
                                 output_logits=True, return_dict_in_generate=True, **GREEDY)
        return out.sequences[0, len(prompt):].tolist(), torch.stack([step[0] for step in out.logits])

    model = fresh()
    cache = HybridPrefixCache(model, deterministic=True, retention_interval="dense")
    prompt = BASE[:50]
    cold = greedy(cache, model, prompt)
    cache.save(tmp_path / "det.safetensors")
    loaded_model = fresh()
    loaded = HybridPrefixCache.load(tmp_path / "det.safetensors", loaded_model)
    assert entry_digests(loaded) == entry_digests(cache)
    tokens, logits = greedy(loaded, loaded_model, prompt + [7])
    assert loaded.last_hit_tokens == [48]
    model_ref = fresh()
    reference = greedy(HybridPrefixCache(model_ref, deterministic=True), model_ref, prompt + [7])
    assert tokens == reference[0] and torch.equal(logits, reference[1])
    assert cold[0] == greedy(loaded, loaded_model, prompt)[0]
    with pytest.raises(ValueError, match="saved by a cache with deterministic=True"):
        HybridPrefixCache.load(tmp_path / "det.safetensors", fresh(), deterministic=False)
    plain_model = fresh()
    plain = HybridPrefixCache(plain_model, retention_interval="dense")
    greedy(plain, plain_model, prompt)
    plain.save(tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="saved by a cache with deterministic=False"):
        HybridPrefixCache.load(tmp_path / "plain.safetensors", fresh(), deterministic=True)
    assert not set(entry_digests(plain)) & set(entry_digests(cache))  # other block hashes in each mode


def rollouts_and_recomputes(family, dtype, deterministic=True):
    """Four seeded sampled rollouts in one engine run (chunks of 48 tokens), each token's raw logprob as sampled,
    as the engine scores the prompt + completion as a prompt, and as one ``no_grad`` full-sequence forward computes
    it (``log_softmax`` of the float32 logits, the forward an RL trainer runs)."""
    model = test_deterministic.toy(family, dtype)
    cache = HybridPrefixCache(model, deterministic=deterministic)
    manager = cache.init_continuous_batching(GenerationConfig(max_new_tokens=10, **SAMPLING),
                                             ContinuousBatchingConfig(max_batch_tokens=48))
    prompts = [ids(n, seed=5000 + n) for n in (7, 33, 20, 51)]
    manager.start()
    try:
        names = [manager.add_request(p, max_new_tokens=10, seed=11 + i, logprobs=0) for i, p in enumerate(prompts)]
        rollouts = finals(manager, names)
        scored = finals(manager, [manager.add_request(p + rollouts[n].generated_tokens, max_new_tokens=1,
                                                      prompt_logprobs=0) for p, n in zip(prompts, names)])
    finally:
        manager.stop()
    results = []
    for prompt, name, scoring in zip(prompts, names, scored.values()):
        tokens = rollouts[name].generated_tokens
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens]), use_cache=False).logits[0].float()
        recomputed = torch.log_softmax(logits, dim=-1)
        results.append(([s.logprob for s in rollouts[name].token_scores],
                         [s.logprob for s in scoring.prompt_scores[len(prompt):]],
                         [recomputed[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]))
    return results


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_sampled_logprobs_equal_a_trainers_full_forward_bit_for_bit(family, dtype):
    """The stretch goal of issue 46: a rollout's sampled-token logprobs equal what a trainer recomputes in one
    full-sequence forward of prompt + completion, and what the engine scores for them as a prompt."""
    for sampled, scored, recomputed in rollouts_and_recomputes(family, dtype):
        assert sampled == scored == recomputed


def test_power_with_the_mode_off_a_trainers_forward_differs():
    assert not all(sampled == recomputed for family in ("jamba", "qwen3_5_text")
                   for sampled, _, recomputed in rollouts_and_recomputes(family, torch.float32, False))
