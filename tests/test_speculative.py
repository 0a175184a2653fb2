"""Prompt-lookup and assisted decoding for hybrid models: rejected draft tokens roll back exactly."""

import pytest
import torch
from conftest import assert_matches_cold, random_ids
from transformers import LlamaConfig, LlamaForCausalLM

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache, _compat
from hf_hybridcache.toy import VOCAB_SIZE, build_model

#: transformers 5.23's assisted decoding reads the cache from ``past_key_values`` only: Mamba, Falcon-Mamba and Mamba-2
#: take theirs as ``cache_params`` there, and the cache refuses the call with the reason.
NEEDS_5_24_FOR_MAMBA = (
    "needs transformers >= 5.24 for Mamba, Falcon-Mamba and Mamba-2 (5.23's assisted decoding cannot find their "
    "cache_params; test_assisted_decoding_of_mamba_on_5_23_is_refused checks the refusal): run it with 5.24 or 5.25"
)


@pytest.fixture
def assisted_decoding(model):
    """Skips where transformers' assisted decoding cannot run ``model`` (Mamba's ``cache_params`` on 5.23)."""
    if _compat.cache_kwarg(model) == "cache_params":
        pytest.skip(NEEDS_5_24_FOR_MAMBA)


def repetitive_prompt(seed: int) -> torch.Tensor:
    """A document quoted several times, so prompt lookup finds many n-gram matches to draft from."""
    doc = random_ids(24, seed=seed)
    return torch.cat([doc, random_ids(5, seed + 1), doc, random_ids(3, seed + 2), doc[:, :12]], dim=1)


@pytest.fixture
def crop_calls(monkeypatch):
    calls = []
    original = HybridPrefixCache.crop

    def spy(self, tokens_to_remove):
        calls.append(tokens_to_remove)
        return original(self, tokens_to_remove)

    monkeypatch.setattr(HybridPrefixCache, "crop", spy)
    return calls


@pytest.mark.parametrize("draft_tokens", [3, 10])
def test_prompt_lookup_equals_greedy_on_a_cached_prompt(model, cold_model, crop_calls, draft_tokens, assisted_decoding):
    cache = HybridPrefixCache(model)
    ids = repetitive_prompt(seed=300)
    assert_matches_cold(model, cold_model, cache, ids)
    reference = cold_model.generate(ids, max_new_tokens=24, do_sample=False)
    for expected_hit in (64, 64):
        out = model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=24, do_sample=False,
                             prompt_lookup_num_tokens=draft_tokens)
        assert torch.equal(out, reference)
        assert cache.last_hit_tokens == [expected_hit]
    assert any(n < 0 for n in crop_calls), "no draft token was rejected: the rollback path did not run"


def test_prompt_lookup_on_a_miss(model, cold_model, crop_calls, assisted_decoding):
    cache = HybridPrefixCache(model)
    ids = repetitive_prompt(seed=310)
    out = model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=4)
    assert torch.equal(out, cold_model.generate(ids, max_new_tokens=20, do_sample=False))
    assert cache.last_hit_tokens == [0]
    assert_matches_cold(model, cold_model, cache, ids)  # what the speculative run stored serves a later request
    assert cache.last_hit_tokens == [64]


def test_assistant_model_equals_greedy(model, cold_model, crop_calls, assisted_decoding):
    torch.manual_seed(0)
    assistant = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                             pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
    cache = HybridPrefixCache(model)
    ids = random_ids(50, seed=320)
    assert_matches_cold(model, cold_model, cache, ids)
    out = model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=16, do_sample=False, assistant_model=assistant)
    assert torch.equal(out, cold_model.generate(ids, max_new_tokens=16, do_sample=False))
    assert cache.last_hit_tokens == [48]
    assert crop_calls


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
@pytest.mark.parametrize("how", ["prompt_lookup_num_tokens", "assistant_model"])
def test_assisted_decoding_of_mamba_on_5_23_is_refused(model, how):
    if _compat.cache_kwarg(model) != "cache_params":
        pytest.skip("needs transformers 5.23 (where Mamba takes its cache as cache_params): run it with 5.23, as CI's "
                    "pass over the older releases does (pytest -m transformers_version)")
    cache = HybridPrefixCache(model)
    value = 3 if how == "prompt_lookup_num_tokens" else build_model("mamba", seed=1)
    with pytest.raises(ValueError, match="need transformers 5.24 or 5.25 .* cache_params"):
        model.generate(random_ids(20, seed=332), **{CACHE_KWARG: cache}, max_new_tokens=4, **{how: value})
    assert cache.stats.requests == 0


def test_crop_refuses_what_it_cannot_roll_back(model):
    cache = HybridPrefixCache(model)
    model.generate(random_ids(20, seed=330), **{CACHE_KWARG: cache}, max_new_tokens=3)
    with pytest.raises(ValueError, match="roll back"):
        cache.crop(-2)


def test_crop_refuses_a_positive_count_like_transformers_layers(model, cold_model, assisted_decoding):
    # crop(+k) used to be taken as crop(-k); transformers' own layers refuse a positive count (a length, not a count).
    cache = HybridPrefixCache(model)
    ids = repetitive_prompt(seed=331)
    kwargs = dict(max_new_tokens=12, do_sample=False)
    model.generate(ids, **{CACHE_KWARG: cache}, prompt_lookup_num_tokens=3, **kwargs)
    stored = cache.stats
    with pytest.raises(ValueError, match="negative count"):
        cache.crop(2)
    assert cache.stats == stored
    assert_matches_cold(model, cold_model, cache, ids)


def test_prompt_lookup_with_padding_inside_the_prompt(model, cold_model, crop_calls, assisted_decoding):
    """A pad id inside the prompt masks that position: no reuse, but rejected drafts still roll back."""
    cache = HybridPrefixCache(model)
    ids = repetitive_prompt(seed=340)
    ids[0, 30] = 0  # the pad id: generate() masks it out
    kwargs = dict(max_new_tokens=20, do_sample=False)
    out = model.generate(ids, **{CACHE_KWARG: cache}, prompt_lookup_num_tokens=5, **kwargs)
    assert torch.equal(out, cold_model.generate(ids, **kwargs))
    assert cache.last_hit_tokens == [0] and cache.stats.kv_blocks == 0
    assert any(n < 0 for n in crop_calls)


@pytest.mark.parametrize("assistant_family", ["jamba", "qwen3_5_text"])
def test_hybrid_assistant_model_equals_greedy(model, cold_model, crop_calls, assisted_decoding, assistant_family):
    """A hybrid assistant drafts in its own transformers cache while the target's HybridPrefixCache restores the
    prefix and rolls the target's rejected drafts back: greedy tokens equal a cold run, hits are kept. On every
    version: transformers 5.25 rolls the assistant's recurrent state back too, 5.23 - 5.24 crop only its conv windows
    (its next drafts then start from a state that holds rejected tokens, which costs acceptance, not exactness: the
    target verifies every token)."""
    assistant = build_model(assistant_family, seed=7)
    cache = HybridPrefixCache(model)
    ids = random_ids(50, seed=321)
    assert_matches_cold(model, cold_model, cache, ids)
    reference = cold_model.generate(ids, max_new_tokens=16, do_sample=False)
    for _ in range(2):
        out = model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=16, do_sample=False,
                             assistant_model=assistant)
        assert torch.equal(out, reference)
        assert cache.last_hit_tokens == [48]
    assert any(n < 0 for n in crop_calls), "no draft token was rejected: the rollback path did not run"
