"""A hit's decode steps write their KV in place: the restored buffers of full attention layers have room for the
prompt's tail and every token ``generate()`` will feed after it, so no step after a hit concatenates (decoding past
the room concatenates as transformers does: ``test_regressions.py``)."""

import pytest
import torch
from conftest import random_ids

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache

NEW_TOKENS = 12


def generate_with_logits(model, ids, cache=None):
    kwargs = {} if cache is None else {CACHE_KWARG: cache}
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
        do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs,
    )
    return out.sequences, torch.cat(out.logits)


def record_updates(cache, monkeypatch) -> list[tuple[int, int, int]]:
    """(layer idx, data pointer, tokens) of the keys every attention ``update`` of ``cache`` returns."""
    seen, update = [], type(cache).update

    def recorded(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = update(self, key_states, value_states, layer_idx, *args, **kwargs)
        seen.append((layer_idx, keys.data_ptr(), keys.shape[-2]))
        return keys, values

    monkeypatch.setattr(type(cache), "update", recorded)
    return seen


# One family per kind: Mamba-1, Mamba-2 (attention in a hybrid cache layer), gated delta net, short conv.
@pytest.mark.parametrize("family", ["jamba", "zamba2", "qwen3_5_text", "lfm2"])
def test_decode_after_a_hit_writes_in_place_and_matches_a_cold_run(model, cold_model, monkeypatch):
    cache = HybridPrefixCache(model)
    ids = random_ids(48, seed=900)
    generate_with_logits(model, ids, cache)
    prompt = torch.cat([ids, random_ids(7, seed=901)], dim=1)
    seen = record_updates(cache, monkeypatch)
    sequences, logits = generate_with_logits(model, prompt, cache)
    assert cache.last_hit_tokens == [48]
    full_layers = {a.layer_idx for a in cache.spec.attention if a.sliding_window is None}
    for layer_idx in full_layers:
        steps = [(ptr, tokens) for idx, ptr, tokens in seen if idx == layer_idx]
        # The tail's forward, then one per decode step; the last sampled token is never fed.
        assert [tokens for _, tokens in steps] == list(range(55, 55 + NEW_TOKENS))
        assert len({ptr for ptr, _ in steps}) == 1, f"layer {layer_idx} left its restored buffer while decoding"
    cold_sequences, cold_logits = generate_with_logits(cold_model, prompt)
    assert torch.equal(sequences, cold_sequences)
    torch.testing.assert_close(logits, cold_logits, rtol=0, atol=1e-4)

