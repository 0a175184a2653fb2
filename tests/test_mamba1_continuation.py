"""A multi-token forward over an existing cache continues from the cached state (Mamba-1 families).

transformers 5.23's Jamba and Zamba mixers restart the SSM recurrence from zero on such a forward; the patched
mixers fix it for every cache (here a plain ``DynamicCache``), not only for HybridPrefixCache.
"""

import pytest
import torch
from transformers import DynamicCache

from conftest import random_ids
from hf_hybridcache.models import support_for
from hf_hybridcache.toy import build_model

MAMBA1_FAMILIES = ["jamba", "zamba"]


def _one_forward(model, ids):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits
    return logits, cache


def _two_forwards(model, ids, split):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :split], past_key_values=cache, use_cache=True)
        logits = model(ids[:, split:], past_key_values=cache, use_cache=True).logits
    return logits, cache


def _patched(family):
    model = build_model(family)
    support_for(model).install(model)
    return model


def _mamba_layers(cache):
    return [i for i, layer in enumerate(cache.layers) if hasattr(layer, "recurrent_states")]


@pytest.mark.parametrize("family", MAMBA1_FAMILIES)
def test_forty_then_twenty_five_tokens_equal_one_forward(family):
    model = _patched(family)
    ids = random_ids(65, seed=90)
    ref_logits, ref = _one_forward(model, ids)
    logits, cache = _two_forwards(model, ids, 40)
    torch.testing.assert_close(logits, ref_logits[:, 40:], rtol=0, atol=1e-4)
    for idx in _mamba_layers(ref):
        torch.testing.assert_close(cache.layers[idx].conv_states[0], ref.layers[idx].conv_states[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(
            cache.layers[idx].recurrent_states[0], ref.layers[idx].recurrent_states[0], rtol=0, atol=1e-5
        )


@pytest.mark.parametrize("family", MAMBA1_FAMILIES)
def test_unpatched_model_restarts_from_a_zero_state(family):
    """The bug the patch fixes, shown on the unpatched model (so the test above has power)."""
    model = build_model(family)
    ids = random_ids(65, seed=90)
    ref_logits, ref = _one_forward(model, ids)
    logits, cache = _two_forwards(model, ids, 40)
    assert (logits - ref_logits[:, 40:]).abs().max().item() > 1e-2
    state_error = max(
        (cache.layers[i].recurrent_states[0] - ref.layers[i].recurrent_states[0]).abs().max().item()
        for i in _mamba_layers(ref)
    )
    assert state_error > 1e-2


@pytest.mark.parametrize("family", MAMBA1_FAMILIES)
def test_fresh_prompt_is_bit_identical_to_the_unpatched_model(family):
    ids = random_ids(30, seed=91)
    logits, cache = _one_forward(_patched(family), ids)
    ref_logits, ref = _one_forward(build_model(family), ids)
    assert torch.equal(logits, ref_logits)
    for idx in _mamba_layers(ref):
        assert torch.equal(cache.layers[idx].recurrent_states[0], ref.layers[idx].recurrent_states[0])
