"""Everything generate() does keeps working with the cache, against cold runs."""

import threading
import warnings

import pytest
import torch
from conftest import assert_matches_cold, greedy, random_ids
from transformers import TextIteratorStreamer, TextStreamer, pipeline

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache, _compat
from hf_hybridcache.toy import byte_tokenizer


@pytest.fixture
def warm(model, cold_model):
    """A cache that has seen a 96-token trunk, and a prompt that extends it."""
    cache = HybridPrefixCache(model)
    trunk = random_ids(97, seed=200)
    assert_matches_cold(model, cold_model, cache, trunk)
    return cache, torch.cat([trunk, random_ids(6, seed=201)], dim=1)


def test_sampling_with_a_seed_equals_the_cold_run(model, cold_model, warm):
    cache, ids = warm
    kwargs = dict(do_sample=True, top_k=20, temperature=0.8, max_new_tokens=16)
    torch.manual_seed(7)
    out = model.generate(ids, **{CACHE_KWARG: cache}, **kwargs)
    torch.manual_seed(7)
    ref = cold_model.generate(ids, **kwargs)
    assert torch.equal(out, ref)
    assert cache.last_hit_tokens == [96]


def test_num_return_sequences_samples_every_row_from_the_hit(model, cold_model, warm):
    cache, ids = warm
    kwargs = dict(do_sample=True, num_return_sequences=3, max_new_tokens=12)
    torch.manual_seed(8)
    out = model.generate(ids, **{CACHE_KWARG: cache}, **kwargs)
    torch.manual_seed(8)
    ref = cold_model.generate(ids, **kwargs)
    assert torch.equal(out, ref)
    assert cache.last_hit_tokens == [96, 96, 96]


def test_beam_search_twice_on_one_cache(model, cold_model, warm):
    cache, ids = warm
    kwargs = dict(num_beams=3, max_new_tokens=12, do_sample=False, num_return_sequences=2)
    ref = cold_model.generate(ids, **kwargs)
    for expected_hit in (96, 96):
        out = model.generate(ids, **{CACHE_KWARG: cache}, **kwargs)
        assert torch.equal(out, ref)
        assert cache.last_hit_tokens == [expected_hit] * 3


def test_streamers_see_exactly_the_returned_tokens(model, cold_model, warm):
    cache, ids = warm
    tokenizer = byte_tokenizer()
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(out=model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=16,
                                                        do_sample=False, streamer=streamer))
    )
    thread.start()
    streamed = "".join(streamer)
    thread.join()
    assert streamed == tokenizer.decode(result["out"][0, ids.shape[1] :])
    assert torch.equal(result["out"], cold_model.generate(ids, max_new_tokens=16, do_sample=False))
    assert cache.last_hit_tokens == [96]
    model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=4, streamer=TextStreamer(tokenizer))


def test_eos_and_stop_strings(model, cold_model, warm):
    cache, ids = warm
    # The pad id stands in for the config's EOS, which some tiny random models emit within a few tokens.
    no_eos = dict(max_new_tokens=16, do_sample=False, eos_token_id=0)
    reference = cold_model.generate(ids, **no_eos)[0, ids.shape[1] :]
    assert len(reference) == 16
    eos = int(reference[5])
    out = model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=16, do_sample=False, eos_token_id=eos)
    assert out[0, ids.shape[1] :].tolist() == reference[: reference.tolist().index(eos) + 1].tolist()
    tokenizer = byte_tokenizer()
    # A stop string must be text: random models mostly emit bytes that are not valid UTF-8 alone.
    texts = [tokenizer.decode([t]) for t in reference.tolist()[:15]]
    printable = [i for i, text in enumerate(texts) if len(text) == 1 and text.isascii() and text.isprintable()]
    assert printable, f"no printable token to stop at in {reference.tolist()}"
    stop = tokenizer.decode(reference[printable[0] : printable[0] + 1])
    kwargs = dict(**no_eos, stop_strings=[stop], tokenizer=tokenizer)
    out = model.generate(ids, **{CACHE_KWARG: cache}, **kwargs)
    assert torch.equal(out, cold_model.generate(ids, **kwargs))
    assert out.shape[1] <= ids.shape[1] + printable[0] + 1


@pytest.mark.parametrize("chunk", [5, 16, 40])
def test_prefill_chunk_size(model, cold_model, warm, chunk):
    """Chunked prefill continues each chunk from the last one's state (transformers 5.23 restarts Jamba from zero)."""
    if _compat.cache_kwarg(model) == "cache_params":
        pytest.skip("needs transformers >= 5.24: 5.23's chunked prefill looks for Mamba's cache under past_key_values, "
                    "not cache_params, and raises 'Cannot use prefill chunking without a cache', with or without "
                    "hf_hybridcache; run it with transformers 5.24 or 5.25")
    cache, _ = warm
    ids = random_ids(120, seed=202)
    seq, logits = greedy(model, ids, cache, prefill_chunk_size=chunk)
    ref, ref_logits = greedy(cold_model, ids)
    assert torch.equal(seq, ref)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [112]


def test_max_new_tokens_one(model, cold_model, warm):
    cache, ids = warm
    for _ in range(2):
        assert_matches_cold(model, cold_model, cache, ids, new_tokens=1)
        assert cache.last_hit_tokens == [96]


def test_pipeline_reuses_one_cache_across_calls(model, cold_model):
    tokenizer = byte_tokenizer()
    cache = HybridPrefixCache(model)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    cold_pipe = pipeline("text-generation", model=cold_model, tokenizer=tokenizer)
    system = "You are a helpful assistant for a bicycle shop. " * 3
    hits = []
    for question in ["Do you fix brakes?", "Open on Sunday?", "Do you fix brakes?"]:
        kwargs = dict(max_new_tokens=12, do_sample=False)
        out = pipe(system + question, **{CACHE_KWARG: cache}, **kwargs)
        assert out == cold_pipe(system + question, **kwargs)
        hits.append(cache.last_hit_tokens[0])
    assert hits[0] == 0 and hits[2] >= 160


def test_chat_template_multi_turn(model, cold_model):
    """Each turn's prompt is the previous prompt + reply + new message: it hits at the decode-end checkpoint."""
    tokenizer = byte_tokenizer()
    # A random model emits arbitrary bytes; keep replies to printable ASCII so that they re-encode to the same tokens.
    ascii_ids = set(tokenizer(bytes(range(32, 127)).decode()).input_ids)
    suppress = [i for i in range(len(tokenizer)) if i not in ascii_ids]
    cache = HybridPrefixCache(model)
    messages = [{"role": "system", "content": "Answer briefly. " * 4}, {"role": "user", "content": "Hello!"}]
    for turn in range(3):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        seq = assert_matches_cold(model, cold_model, cache, ids, suppress_tokens=suppress)
        if turn:  # the previous turn put its prompt and all but its last reply token through the model
            assert cache.last_hit_tokens == [(seen // 16) * 16]
        seen = ids.shape[1] + 15
        reply = tokenizer.decode(seq[0, ids.shape[1] :], skip_special_tokens=True)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"And {turn}?"}]


def test_the_cache_kwarg_of_this_transformers_works_without_deprecation_warnings(model, cold_model):
    # transformers 5.24 renamed generate(past_key_values=) to cache= and warns on the old name; the package's own calls
    # (batch replay, direct forwards) used the old name and warned on every call.
    cache = HybridPrefixCache(model)
    ids = random_ids(40, seed=480)
    rows = torch.cat([torch.cat([ids[:, :33], random_ids(4, seed=481)], dim=1), random_ids(37, seed=482)])
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out = model.generate(ids, **kwargs, **{CACHE_KWARG: cache})
        batch = model.generate(rows, **kwargs, **{CACHE_KWARG: cache})
        with torch.no_grad():
            model(ids[:, :5], use_cache=True, **{CACHE_KWARG: cache.with_salt("direct")})
    deprecations = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not [m for m in deprecations if "past_key_values" in m or "cache" in m], deprecations
    assert torch.equal(out, cold_model.generate(ids, **kwargs))
    assert cache.last_hit_tokens == [32, 0]
    for i in range(2):
        assert torch.equal(batch[i], cold_model.generate(rows[i : i + 1], **kwargs)[0])


@pytest.mark.parametrize("family", ["jamba", "qwen3_5_text"])
def test_either_name_of_the_cache_kwarg_works_on_either_transformers(model, cold_model):
    # The README's generate(..., cache=cache) failed on 5.23 with transformers' "model_kwargs are not used" error, and
    # code written for 5.23 (past_key_values=cache) warned on 5.24: the package hands its cache on under the name of
    # the installed version.
    cache = HybridPrefixCache(model)
    ids = random_ids(40, seed=490)
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = model.generate(ids, cache=cache, **kwargs)
        second = model.generate(ids, past_key_values=cache, **kwargs)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not [m for m in deprecations if "past_key_values" in m or "cache" in m], deprecations
    expected = cold_model.generate(ids, **kwargs)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert cache.last_hit_tokens == [32]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["jamba", "zamba2"])
def test_torch_compile_of_the_model_keeps_outputs_exact(model, cold_model):
    # Dynamo traces through the forward wrapper and the patched mixers (graph breaks at the cache's bookkeeping);
    # backend="eager" checks that tracing, which is what meets our code, in seconds (inductor only changes kernels).
    cache = HybridPrefixCache(model, retention_interval="dense")
    compiled = torch.compile(model, backend="eager")
    ids = random_ids(40, seed=490)
    with torch.no_grad():
        logits = compiled(ids, **{CACHE_KWARG: cache}, use_cache=True).logits
        ref = cold_model(ids).logits
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)
    assert (cache.stats.kv_blocks, cache.stats.checkpoints) == (2, 2)
    out = compiled.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, cold_model.generate(ids, max_new_tokens=4, do_sample=False))
    assert cache.last_hit_tokens == [32]
