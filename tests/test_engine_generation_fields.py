"""Every ``GenerationConfig`` field against the continuous-batching engine: applied as ``generate()`` applies it, or
refused with a ``ValueError`` that names it (:mod:`hf_hybridcache.engine.generation_fields`), never dropped.

``min_new_tokens`` was dropped: 8 requests with ``min_new_tokens = max_new_tokens = 32`` ended at the model's EOS
(token 2), which ``generate()`` holds off, and so differed from ``generate()``. The prompts here are ones whose greedy
reply reaches token 2 on ``qwen3_5_text`` (checked: the test has power)."""

import pytest
import torch
from engine_scenarios import config, finals, ids
from transformers import ContinuousBatchingConfig, GenerationConfig

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.engine.generation_fields import ALLOWED, APPLIED, OFF, engine_generation_config, refused_fields

EOS = 2  # the toy models' end-of-sequence id
#: (length, seed) of prompts whose greedy reply on qwen3_5_text reaches EOS within 32 tokens (all but the first).
EOS_PROMPTS = [(20, 1200), (23, 1201), (41, 1207), (23, 1209), (41, 1215), (20, 1216), (35, 1221), (26, 1226)]


def reference(cold_model, prompt: list[int], **generation) -> list[int]:
    """The request alone: greedy generate() without any cache, with ``generation`` on top of :func:`config`'s."""
    with torch.no_grad():
        out = cold_model.generate(torch.tensor([prompt]), generation_config=config(**generation))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["qwen3_5_text"])
def test_min_new_tokens_and_min_length_hold_off_eos_as_generate_does(model, cold_model):
    prompts = [ids(length, seed) for length, seed in EOS_PROMPTS]
    free = [reference(cold_model, p, max_new_tokens=32) for p in prompts]
    assert sum(len(reply) < 32 and reply[-1] == EOS for reply in free) >= 6  # without a floor most end at EOS
    cache = HybridPrefixCache(model)
    runs = {  # name: (engine outputs in prompt order, generate()'s keyword arguments)
        "config": (model.generate_batch(prompts, generation_config=config(32, min_new_tokens=32)),
                   dict(max_new_tokens=32, min_new_tokens=32)),
        "kwargs, fewer": (model.generate_batch(prompts, max_new_tokens=32, min_new_tokens=12, do_sample=False),
                          dict(max_new_tokens=32, min_new_tokens=12)),
        "min_length": (model.generate_batch(prompts, generation_config=config(32, min_length=45)),
                       dict(max_new_tokens=32, min_length=45)),
        "both": (model.generate_batch(prompts, generation_config=config(32, min_length=60, min_new_tokens=12)),
                 dict(max_new_tokens=32, min_length=60, min_new_tokens=12)),  # min_new_tokens takes precedence
        "max_length": (model.generate_batch(prompts, generation_config=config(None, max_length=44)),
                       dict(max_new_tokens=None, max_length=44)),  # counts the prompt
    }
    for name, (outputs, generation) in runs.items():
        replies = [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))]
        assert replies == [reference(cold_model, p, **generation) for p in prompts], name
    assert all(len(r) == 32 and EOS not in r for r in (o.generated_tokens for o in runs["config"][0].values()))
    lengths = sorted(len(o.generated_tokens) for o in runs["kwargs, fewer"][0].values())
    assert lengths[0] > 12 and lengths[0] < 32  # each request counts its own tokens: some end past 12, before 32

    # The requests: eos_token_id=-1 per request (no EOS ends them); the config's EOS is still held off.
    manager = cache.init_continuous_batching(config(32, min_new_tokens=32))
    manager.start()
    try:
        request_ids = [manager.add_request(p, eos_token_id=-1) for p in prompts]
        outputs = finals(manager, request_ids)
    finally:
        manager.stop()
    assert [outputs[r].generated_tokens for r in request_ids] == [
        o.generated_tokens for o in runs["config"][0].values()]
    # A prompt that reaches max_length leaves no new token: generate() raises, the engine fails the request.
    reached = model.generate_batch([ids(44, seed=1230)], generation_config=config(None, max_length=44))["req_0"]
    assert "max_length (44)" in reached.error and reached.generated_tokens == []


@pytest.mark.parametrize("family", ["jamba"])
def test_fields_the_engine_does_not_apply_are_refused_by_name_and_the_manager_goes_on(model, cold_model):
    cache = HybridPrefixCache(model)
    prompts = [ids(18, seed=1300), ids(29, seed=1301)]
    manager = cache.init_continuous_batching(config(6))
    manager.start()
    try:
        for fields in ({"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}, {"bad_words_ids": [[5], [7, 8]]},
                       {"num_beams": 2}, {"stop_strings": ["x"]}, {"output_logits": True}):
            (name, value), = fields.items()
            says = f"{name}={value!r}"
            with pytest.raises(ValueError, match=f"does not apply.*{says}".replace("[", r"\[")):
                model.generate_batch(prompts, generation_config=config(6, **fields))
            with pytest.raises(ValueError, match=says.replace("[", r"\[")):
                model.generate_batch(prompts, max_new_tokens=6, **fields)
            with pytest.raises(ValueError, match=says.replace("[", r"\[")):
                cache.init_continuous_batching(GenerationConfig(max_new_tokens=6, **fields))
        with pytest.raises(ValueError, match="max_new_token, which is neither"):
            model.generate_batch(prompts, max_new_token=6)  # a typo transformers' generate_batch drops
        model.generation_config.repetition_penalty = 1.2  # the model's config fills the fields a config leaves unset
        try:
            with pytest.raises(ValueError, match="repetition_penalty=1.2"):
                model.generate_batch(prompts, generation_config=config(6))
        finally:
            model.generation_config.repetition_penalty = None
        refused = manager.add_request(prompts[0], request_id="per-request", repetition_penalty=1.3)
        assert "repetition_penalty" in finals(manager, [refused])[refused].error
        request_ids = [manager.add_request(p) for p in prompts]  # the running manager goes on
        outputs = finals(manager, request_ids)
    finally:
        manager.stop()
    expected = [reference(cold_model, p, max_new_tokens=6) for p in prompts]
    assert [outputs[r].generated_tokens for r in request_ids] == expected
    off = config(6, repetition_penalty=1.0, num_beams=1, output_scores=False, use_cache=True, max_length=4)
    outputs = model.generate_batch(prompts, generation_config=off)  # off values, and max_length beside max_new_tokens
    assert [outputs[f"req_{i}"].generated_tokens for i in range(2)] == expected


@pytest.mark.parametrize("family", ["jamba"])
def test_suppress_tokens_and_the_batching_config_of_a_generation_config_are_applied(model, cold_model):
    cache = HybridPrefixCache(model)
    prompt = ids(21, seed=1310)
    free = reference(cold_model, prompt, max_new_tokens=6)
    suppress = sorted(set(free[:3]))
    out = model.generate_batch([prompt], generation_config=config(6, suppress_tokens=suppress))["req_0"]
    assert out.generated_tokens == reference(cold_model, prompt, max_new_tokens=6, suppress_tokens=suppress) != free
    batching = ContinuousBatchingConfig(max_batch_tokens=64)
    with pytest.warns(FutureWarning):  # deprecated in GenerationConfig, still read by transformers' manager
        generation = config(6, continuous_batching_config=batching)
    manager = cache.init_continuous_batching(generation)
    assert manager.continuous_batching_config == batching and manager.limits.max_batch_tokens == 64


def test_every_field_is_applied_allowed_or_refused_by_name():
    """A field set to a value that is neither its default nor its off value is refused, named, unless the engine
    applies it or it cannot change a token: nothing a config sets is dropped silently."""

    class Set:
        def __repr__(self) -> str:
            return "<set>"

    assert not (APPLIED & ALLOWED.keys()) and not (APPLIED & OFF.keys()) and not (ALLOWED.keys() & OFF.keys())
    fields = GenerationConfig().to_dict()
    for name in fields:
        generation = GenerationConfig(max_new_tokens=4)
        setattr(generation, name, Set())
        refused = refused_fields(generation)
        if name in ALLOWED or (name in APPLIED and name != "continuous_batching_config"):
            assert refused == [], name
        else:
            assert len(refused) == 1 and refused[0].startswith(f"{name}=<set>"), (name, refused)


@pytest.mark.parametrize("family", ["jamba"])
def test_the_engine_config_is_filled_as_generate_fills_it(model):
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.7
    try:
        filled = engine_generation_config(model, GenerationConfig(max_new_tokens=4))
    finally:
        model.generation_config.do_sample = model.generation_config.temperature = None
    assert (filled.do_sample, filled.temperature, filled.top_k, filled.eos_token_id) == (True, 0.7, 50, EOS)
    greedy = engine_generation_config(model, GenerationConfig(max_new_tokens=4, do_sample=False))
    assert (greedy.do_sample, greedy.top_k) == (False, None)
