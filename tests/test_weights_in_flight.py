"""Weights edited while a request runs (an RL loop updating a live server's weights between two decode steps): the
request goes on under the new weights and stores nothing more, since its states mix two weights states and its root
names the first. Entries stored before the change stay valid: once the weights are restored, a later prompt that
extends the request hits only those and equals a cold run, on generate() and on the engine alike."""

import copy

import pytest
import torch
from conftest import assert_matches_cold, random_ids
from engine_scenarios import config, ids

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache, _compat
from hf_hybridcache.core import check_store
from hf_hybridcache.toy import build_model

FAMILIES = ["jamba", "qwen3_5_text", "lfm2"]  # Mamba-1, gated delta net, short conv
PROMPT = ids(40, seed=3100)
NEW_TOKENS = 30
EDIT_AT_FORWARD = 4  # the prefill, then three decode steps under the original weights


def _edit_weights_at(model, forward: int, through_data: bool):
    """A pre-hook that scales the first decoder layer's weights in place before the ``forward``-th forward."""
    calls = [0]

    def hook(module, args, kwargs):
        calls[0] += 1
        if calls[0] == forward:
            with torch.no_grad():
                for param in _compat.decoder_layers(model)[0].parameters():
                    (param.data if through_data else param).mul_(1.25)

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def _restore(model, original, through_data: bool):
    if through_data:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.data.copy_(original[name])
    else:
        model.load_state_dict(original)


def _decode_while_weights_change(model, cache, path: str, through_data: bool) -> list[int]:
    original = copy.deepcopy(model.state_dict())
    handle = _edit_weights_at(model, EDIT_AT_FORWARD, through_data)
    try:
        if path == "generate":
            with torch.no_grad():
                out = model.generate(torch.tensor([PROMPT]), **{CACHE_KWARG: cache}, max_new_tokens=NEW_TOKENS,
                                     min_new_tokens=NEW_TOKENS, do_sample=False)
            reply = out[0, len(PROMPT):].tolist()
        else:
            gen = config(max_new_tokens=NEW_TOKENS, eos_token_id=-1)
            reply = model.generate_batch([PROMPT], generation_config=gen)["req_0"].generated_tokens
    finally:
        handle.remove()
    _restore(model, original, through_data)
    return reply


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("path", ["generate", "engine"])
def test_a_request_whose_weights_changed_midway_stores_nothing_more(family, path, cold_model, model, caplog):
    cache = HybridPrefixCache(model, retention_interval="dense")
    reply = _decode_while_weights_change(model, cache, path, through_data=False)
    # Stored before the change: the prompt's blocks (0-32) and checkpoints; the rest of the reply mixes both weights
    extended = torch.tensor([PROMPT + reply + ids(6, seed=3101)])
    assert_matches_cold(model, cold_model, cache, extended, new_tokens=6)
    assert cache.last_hit_tokens == [32]
    assert "weights changed while requests ran" in caplog.text
    check_store(cache)


@pytest.mark.parametrize("family", ["jamba"])
def test_a_write_through_data_midway_is_seen_too(family, cold_model, model):
    """``param.data.mul_()`` bumps no version counter: the sampled values tell the change."""
    cache = HybridPrefixCache(model, retention_interval="dense")
    reply = _decode_while_weights_change(model, cache, "generate", through_data=True)
    extended = torch.tensor([PROMPT + reply + ids(6, seed=3102)])
    assert_matches_cold(model, cold_model, cache, extended, new_tokens=6)
    assert cache.last_hit_tokens == [32]


@pytest.mark.parametrize("family", ["jamba"])
def test_requests_begun_after_the_change_store_again(family, cold_model, model):
    """Only the requests that ran across the change stop storing: the next request stores again, and the one after
    it hits."""
    cache = HybridPrefixCache(model, retention_interval="dense")
    _decode_while_weights_change(model, cache, "engine", through_data=False)
    prompt = random_ids(45, seed=3103)
    assert_matches_cold(model, cold_model, cache, prompt, new_tokens=4)
    assert_matches_cold(model, cold_model, cache, prompt, new_tokens=4)
    assert cache.last_hit_tokens == [32]


def test_bf16_reply_replay_of_a_request_whose_weights_changed_stores_from_a_fresh_prefill():
    """A bf16 request stores its reply from a replay after it ends: the replay prefills the reply under the weights
    of its own time (the restored ones here), so what it stores is exact under their root."""
    model, cold = build_model("lfm2", seed=0, dtype=torch.bfloat16), build_model("lfm2", seed=0, dtype=torch.bfloat16)
    cache = HybridPrefixCache(model)
    assert cache.options.replay_replies
    reply = _decode_while_weights_change(model, cache, "generate", through_data=False)
    extended = torch.tensor([PROMPT + reply + ids(6, seed=3104)])
    assert_matches_cold(model, cold, cache, extended, new_tokens=6)
    check_store(cache)
