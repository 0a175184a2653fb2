"""Every family beyond the exactness suite: bf16 models, save_pretrained/from_pretrained round trips; and the
long-memory init of the Mamba-1 families (test_mamba2.py checks it for Mamba-2)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    CCA_FAMILIES,
    FAMILIES,
    MAMBA1_FAMILIES,
    SHORT_CONV_FAMILIES,
    and_inkling2_loop,
    assert_matches_cold,
    assert_restored_states_match,
    cold_states,
    greedy,
    random_ids,
)
from transformers import AutoModelForCausalLM
from transformers.cache_utils import LinearAttentionLayer

import hf_hybridcache._compat as compat
from hf_hybridcache import HybridPrefixCache
from hf_hybridcache._compat import new_live_layers
from hf_hybridcache.models import support_for
from hf_hybridcache.toy import build_model

#: Families whose short convs keep their window in float32 in every model dtype (Inkling computes them in float32).
FLOAT32_CONV_FAMILIES = ["inkling_text", "inkling2_text", "inkling2_loop_text"]


@pytest.fixture(params=and_inkling2_loop(FAMILIES))
def family(request):
    """Every family of the exactness suite, and Inkling 2 Loop (transformers >= 5.24)."""
    return request.param


def test_bf16_checkpoints_keep_the_live_dtypes_and_tokens_match(family):
    model, cold_model = build_model(family, dtype=torch.bfloat16), build_model(family, dtype=torch.bfloat16)
    cache = HybridPrefixCache(model)
    ids = random_ids(70, seed=77)
    ref_seq, _ = greedy(cold_model, ids)
    # In bf16 a sliding-window layer's attention over its window differs in round-off from the same keys inside the
    # whole prompt's masked attention (LFM3's tiny model: 0.016 on the logits, and a near-tie flips), in upstream's own
    # continuation too; there the reference for a hit at P is upstream continuing a DynamicCache holding P tokens.
    continued = _upstream_continuation(cold_model, ids, 64) if cache.spec.sliding_layers else ref_seq
    for expected_hit, ref in ((0, ref_seq), (64, continued)):
        seq, _ = greedy(model, ids, cache)
        assert cache.last_hit_tokens == [expected_hit]
        assert torch.equal(seq, ref), "bf16 tokens differ from the bf16 cold run"

    live = cold_states(cold_model, ids, 64)  # what the unpatched bf16 model keeps: the SSM state stays float32
    for m in cache.spec.mamba:
        layer = live.layers[m.layer_idx]
        recurrent = layer.recurrent_states[m.state_idx]
        if recurrent is None:  # a short conv: no recurrent state, an empty float32 stand-in in the store
            assert family in [*SHORT_CONV_FAMILIES, "inkling2_loop_text"] and m.ssm.num_bytes == 0
            recurrent = torch.empty(0)
        live_dtypes = (layer.conv_states[m.state_idx].dtype, recurrent.dtype)
        conv_dtype = torch.float32 if family in FLOAT32_CONV_FAMILIES else torch.bfloat16
        ssm_dtype = torch.bfloat16 if family in CCA_FAMILIES else torch.float32  # ZAYA's delayed value
        assert (m.conv.dtype, m.ssm.dtype) == live_dtypes == (conv_dtype, ssm_dtype)
    dtypes = {m.key: (m.conv.dtype, m.ssm.dtype) for m in cache.spec.mamba}
    for states in (block.checkpoint for block in cache.store.blocks() if block.checkpoint is not None):
        assert {key: (conv.dtype, ssm.dtype) for key, (conv, ssm) in states.items()} == dtypes
    assert all(a.dtype == torch.bfloat16 for a in cache.spec.attention)
    stats, spec = cache.stats, cache.spec
    assert stats.stored_bytes == stats.kv_blocks * spec.kv_block_bytes + stats.checkpoints * spec.checkpoint_bytes


def _upstream_continuation(cold_model, ids, prefix_tokens: int) -> torch.Tensor:
    """Greedy tokens of the unpatched model continuing a ``DynamicCache`` that holds ``ids[:, :prefix_tokens]``."""
    past = cold_states(cold_model, ids, prefix_tokens)
    return greedy(cold_model, ids, past)[0]


def test_save_pretrained_round_trip_then_a_cached_run(model, cold_model, tmp_path):
    cache = HybridPrefixCache(model)  # a model already patched by a cache saves like any other
    assert_matches_cold(model, cold_model, cache, random_ids(40, seed=78))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert support_for(loaded) is support_for(model)
    expected, got = cold_model.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name

    cache = HybridPrefixCache(loaded)
    ids = random_ids(60, seed=79)
    assert_matches_cold(loaded, cold_model, cache, ids)
    assert_matches_cold(loaded, cold_model, cache, ids)
    assert cache.last_hit_tokens == [48]


@pytest.mark.parametrize("family", MAMBA1_FAMILIES)
def test_long_memory_init_reaches_every_mamba1_mixer(family, model):
    mixers = [m for m in model.modules() if hasattr(m, "A_log")]
    assert len(mixers) == len(support_for(model).state_spec(model, 16).mamba)
    for mixer in mixers:
        assert torch.all(mixer.A_log == -3.0)
        dt_bias = mixer.dt_proj_bias if hasattr(mixer, "dt_proj_bias") else mixer.dt_proj.bias
        torch.testing.assert_close(F.softplus(dt_bias), torch.full_like(dt_bias, 0.2), rtol=0, atol=1e-6)
        if hasattr(mixer, "x_proj_weight"):  # Zamba: B and C without a norm need a larger projection
            assert 0.25 < mixer.x_proj_weight.std().item() < 0.35


#: transformers 5.25's linear cache layers count their own tokens (``cumulative_length_linear``), and
#: ``Cache.get_seq_length()`` reads layer 0; earlier versions count nothing there.
needs_counting_linear_layers = pytest.mark.skipif(
    not hasattr(LinearAttentionLayer(), "cumulative_length_linear"),
    reason="needs transformers >= 5.25 (linear cache layers count their tokens from 5.25 on): run it with 5.25",
)


@needs_counting_linear_layers
def test_a_restore_that_forgets_the_linear_token_count_fails_the_check(family, model, cold_model, monkeypatch):
    """A restore that writes the right states but leaves the linear layers' token count at 0 (as a restore written
    for 5.24 did): the state check catches it in every family, and where cache layer 0 is a linear layer (its count
    is what ``get_seq_length()`` answers, so ``generate()`` re-feeds the whole prompt over the restored state) the
    cold comparison does too."""
    cache = HybridPrefixCache(model)
    ids = random_ids(70, seed=78)
    assert_matches_cold(model, cold_model, cache, ids)
    original = compat.set_linear_state

    def forgetful(layer, conv, ssm, state_idx, num_tokens):
        original(layer, conv, ssm, state_idx, num_tokens)
        layer.cumulative_length_linear = torch.tensor(0)

    monkeypatch.setattr(compat, "set_linear_state", forgetful)
    with pytest.raises(AssertionError):
        assert_restored_states_match(cache, cold_model, ids, 64)
    if type(new_live_layers(model.config)[0]) is LinearAttentionLayer:
        with pytest.raises(AssertionError, match="differ from the cold run|not close"):
            assert_matches_cold(model, cold_model, cache, ids)
    monkeypatch.undo()
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [64]
