"""Grammars in the engine and in generate(): rows with and without a grammar in one step (the grammar rows equal
generate() with :class:`~hf_hybridcache.structured.JSONSchemaLogitsProcessor`, the free rows generate() alone), a
grammar request preempted under tight bounds and recomputed, the processor with a prefix hit equal to a cold run, the
requests a grammar cannot run refused with a sentence, and a missing llguidance named with its extra."""

import json
import sys

import jsonschema
import pytest
import torch
from engine_scenarios import alone, config, finals, ids
from transformers import GenerationConfig

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.engine import EngineLimits
from hf_hybridcache.structured import GrammarCompiler, JSONSchemaLogitsProcessor
from hf_hybridcache.toy import build_model, byte_tokenizer

pytest.importorskip("llguidance")

EOS = 2  # the byte tokenizer's </s>
SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                         "tag": {"type": "string", "maxLength": 4}},
          "required": ["id", "ok", "tag"], "additionalProperties": False}
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def cold_model():
    return build_model("jamba", seed=0)


def with_processor(cold_model, prompt: list[int]) -> list[int]:
    """Greedy generate() without a cache under the schema's processor."""
    processor = JSONSchemaLogitsProcessor(byte_tokenizer(), SCHEMA)
    with torch.no_grad():
        out = cold_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  eos_token_id=EOS, pad_token_id=0, logits_processor=[processor])
    return out[0, len(prompt):].tolist()


def document(tokens: list[int]) -> dict:
    value = json.loads(byte_tokenizer().decode(tokens, skip_special_tokens=True))
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.mark.parametrize("tight", [False, True], ids=["one step", "preempted"])
def test_rows_with_and_without_a_grammar_in_one_step(cold_model, tight):
    cache = HybridPrefixCache(build_model("jamba", seed=0))
    grammar = GrammarCompiler(byte_tokenizer()).json_schema(SCHEMA)
    limits = EngineLimits(max_running_requests=4, max_batch_tokens=48, max_running_pages=6, max_request_tokens=160) \
        if tight else None
    if tight:  # a store of a few blocks keeps the requests from handing their pages to it: some are preempted
        cache.max_cache_bytes = 3 * cache.spec.kv_block_bytes + cache.spec.checkpoint_bytes
    prompts = {f"r{i}": ids(20 + 7 * i, seed=700 + i) for i in range(6)}
    manager = cache.init_continuous_batching(config(max_new_tokens=NEW_TOKENS), limits=limits)
    manager.start()
    try:
        with manager._intake:  # together: they start in the same step
            for i, (name, prompt) in enumerate(prompts.items()):
                manager.add_request(prompt, request_id=name, eos_token_id=EOS, grammar=grammar if i % 2 else None,
                                    max_new_tokens=NEW_TOKENS if i % 2 else 40)
        outputs = finals(manager, list(prompts))
        assert not tight or manager.batch_processor.preempted > 0
    finally:
        manager.stop()
    for i, (name, prompt) in enumerate(prompts.items()):
        tokens = outputs[name].generated_tokens
        if i % 2:
            assert tokens == with_processor(cold_model, prompt), name
            assert tokens[-1] == EOS and document(tokens[:-1])
        else:
            assert tokens == alone(cold_model, prompt, 40, eos_token_id=EOS), name


def test_the_processor_with_a_prefix_hit_equals_a_cold_run(cold_model):
    model, tokenizer = build_model("jamba", seed=0), byte_tokenizer()
    cache = HybridPrefixCache(model)
    prompt = torch.tensor([ids(70, seed=710)] * 2)  # two rows: each follows the grammar on its own
    cold = cold_model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=EOS, pad_token_id=0,
                               logits_processor=[JSONSchemaLogitsProcessor(tokenizer, SCHEMA)])
    for turn in range(2):
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=EOS, pad_token_id=0,
                             logits_processor=[JSONSchemaLogitsProcessor(tokenizer, SCHEMA)], cache=cache)
        assert torch.equal(out, cold)
        assert (cache.last_hit_tokens[0] > 0) == (turn == 1)
    for row in cold[:, prompt.shape[1]:].tolist():
        document([t for t in row if t not in (EOS, 0)])


def test_requests_a_grammar_cannot_run_are_refused_with_a_sentence():
    model, tokenizer = build_model("jamba", seed=0), byte_tokenizer()
    cache = HybridPrefixCache(model)
    grammar = GrammarCompiler(tokenizer).json_schema(SCHEMA)
    cases = {
        "vocab": ({"grammar": GrammarCompiler(tokenizer, vocab_size=300).json_schema(SCHEMA)}, "vocab_size=262"),
        "eos": ({"grammar": grammar, "eos_token_id": 5}, "eos_token_id="),
        "type": ({"grammar": SCHEMA}, "GrammarCompiler(tokenizer).json_schema"),
    }
    manager = cache.init_continuous_batching(config())
    manager.start()
    try:
        for name, (kwargs, words) in cases.items():
            manager.add_request([5, 6, 7], request_id=name, **kwargs)
        outputs = finals(manager, list(cases))
    finally:
        manager.stop()
    floor = cache.init_continuous_batching(GenerationConfig(max_new_tokens=4, min_new_tokens=2, do_sample=False,
                                                           eos_token_id=EOS, pad_token_id=0))
    floor.add_request([5, 6, 7], request_id="floor", grammar=grammar)
    outputs["floor"] = floor.get_result("floor", timeout=5)
    cases["floor"] = (None, "min_new_tokens")
    for name, (_, words) in cases.items():
        assert outputs[name].error and words in outputs[name].error, (name, outputs[name].error)
    with pytest.raises(ValueError, match="cannot be compiled"):
        GrammarCompiler(tokenizer).json_schema({"type": "object", "properties": {"x": {"type": "no such type"}}})


def test_a_vocab_size_below_the_tokenizer_names_that_cause_not_fastness():
    with pytest.raises(ValueError, match=r"vocab_size=100 is smaller than the tokenizer's 262 tokens") as caught:
        GrammarCompiler(byte_tokenizer(), vocab_size=100)
    assert "fast tokenizer" not in str(caught.value)

    class SlowTokenizer:  # what llguidance refuses: anything but a PreTrainedTokenizerFast
        eos_token_id = 2

        def __len__(self) -> int:
            return 262

    with pytest.raises(ValueError, match=r"need a fast tokenizer \(PreTrainedTokenizerFast\), got SlowTokenizer"):
        GrammarCompiler(SlowTokenizer())


def test_a_missing_llguidance_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ImportError, match=r"pip install 'llguidance>=1.0,<2' \(or pip install -e '\.\[structured\]'"):
        GrammarCompiler(byte_tokenizer())
