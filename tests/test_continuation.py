"""The patched mixers continue a multi-token forward from the cached state (transformers 5.23 restarts from zero for
Mamba-1 mixers)."""

import pytest
import torch
from conftest import MAMBA1_FAMILIES, MAMBA2_FAMILIES, random_ids
from transformers import DynamicCache

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache._compat import cache_kwarg


def positions(start, end):
    """Explicit position ids, as generate() passes them (Bamba's forward restarts them at 0 when they are missing)."""
    return torch.arange(start, end)[None]


def _split_run(model, ids, split):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        kwargs = {cache_kwarg(model): cache, "use_cache": True}
        model(ids[:, :split], **kwargs)
        logits = model(ids[:, split:], **kwargs, position_ids=positions(split, ids.shape[1])).logits
    return logits, cache


def _full_run(model, ids):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(ids, **{cache_kwarg(model): cache}, use_cache=True).logits
    return logits, cache


def test_40_then_25_tokens_equals_one_65_token_forward(model, cold_model):
    HybridPrefixCache(model)  # patches this model instance
    ids = random_ids(65, seed=80)
    full_logits, full_cache = _full_run(cold_model, ids)
    split_logits, split_cache = _split_run(model, ids, 40)
    torch.testing.assert_close(split_logits, full_logits[:, 40:], rtol=0, atol=1e-4)
    for idx, layer in enumerate(full_cache.layers):
        other = split_cache.layers[idx]
        for i in getattr(layer, "conv_states", {}):  # every state of the layer (Inkling keeps four)
            torch.testing.assert_close(other.recurrent_states[i], layer.recurrent_states[i], rtol=0, atol=1e-5)
            torch.testing.assert_close(other.conv_states[i], layer.conv_states[i], rtol=0, atol=1e-5)
        if getattr(layer, "keys", None) is not None:  # attention, or the attention half of a hybrid layer
            torch.testing.assert_close(other.keys, layer.keys, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", MAMBA1_FAMILIES)
def test_unpatched_model_restarts_from_zero(cold_model):
    """Documents the upstream bug the patch fixes (and that the test above has power)."""
    ids = random_ids(65, seed=80)
    full_logits, _ = _full_run(cold_model, ids)
    split_logits, _ = _split_run(cold_model, ids, 40)
    assert (split_logits - full_logits[:, 40:]).abs().max() > 0.1


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_unpatched_mamba2_model_continues_from_the_cached_state(cold_model):
    """transformers 5.23's Mamba-2 mixers continue from the cached conv and SSM state (the patched mixers call them
    whenever no checkpoint is wanted), also across a piece shorter than the conv width."""
    ids = random_ids(65, seed=80)
    full_logits, _ = _full_run(cold_model, ids)
    cache = DynamicCache(config=cold_model.config)
    with torch.no_grad():
        pieces = [
            cold_model(ids[:, a:b], **{cache_kwarg(cold_model): cache}, use_cache=True,
                       position_ids=positions(a, b)).logits
            for a, b in [(0, 40), (40, 42), (42, 65)]
        ]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full_logits, rtol=0, atol=1e-4)


def test_patched_model_without_prefix_cache_is_bit_identical(model, cold_model):
    HybridPrefixCache(model)
    ids = random_ids(70, seed=81)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, cold_model(ids).logits)
    assert torch.equal(
        model.generate(ids, max_new_tokens=16, do_sample=False),
        cold_model.generate(ids, max_new_tokens=16, do_sample=False),
    )


def test_installing_twice_and_other_instances_are_untouched(model, cold_model):
    first = HybridPrefixCache(model)
    second = HybridPrefixCache(model)
    ids = random_ids(40, seed=82)
    model.generate(ids, **{CACHE_KWARG: first}, max_new_tokens=4, do_sample=False)
    model.generate(ids, **{CACHE_KWARG: second}, max_new_tokens=4, do_sample=False)
    assert first.last_hit_tokens == [0] and second.last_hit_tokens == [0]
    assert not getattr(cold_model, "_hf_hybridcache_prefill_hook", False)
    assert all(not getattr(m, "_hf_hybridcache_patched", False) for m in cold_model.modules())
