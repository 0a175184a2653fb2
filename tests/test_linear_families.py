"""The linear-attention and short-conv families: states at block boundaries inside a forward, the routed kernel's
pass-through, the piecewise path taken when ``fla`` is installed, and the families refused with their reason."""

import types

import pytest
import torch
import transformers
from conftest import (
    CCA_FAMILIES,
    GDN_FAMILIES,
    KDA_FAMILIES,
    LINEAR_FAMILIES,
    SHORT_CONV_FAMILIES,
    and_inkling2_loop,
    assert_matches_cold,
    cold_states,
    random_ids,
)

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.models.gated_delta import GDN_KERNEL
from hf_hybridcache.models.refused import REFUSED
from hf_hybridcache.toy import VOCAB_SIZE, build_model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


ATTENTION_FED_CONV_FAMILIES = CCA_FAMILIES + ["inkling_text", "inkling2_text", "inkling2_loop_text"]


@pytest.mark.parametrize("family", and_inkling2_loop(LINEAR_FAMILIES))
def test_states_at_every_boundary_of_one_prefill_equal_cold_prefills(family, model, cold_model):
    """Dense retention: one 150-token prefill hands over the state at each of its 9 block boundaries; restoring any of
    them equals a cold forward of that prefix (within fp32 round-off)."""
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(150, seed=90)
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=1)
    for hit in range(16, 150, 16):
        cache.restore(ids[:, : hit + 1])
        try:
            assert cache.last_hit_tokens == [hit]
            ref = cold_states(cold_model, ids, hit)
            for m in cache.spec.mamba:
                live, cold = cache.layers[m.layer_idx], ref.layers[m.layer_idx]
                i = m.state_idx
                if family in ATTENTION_FED_CONV_FAMILIES:
                    # These windows hold attention outputs (Inkling's post-attention conv) or projections of a layer
                    # fed by attention (ZAYA's q|k), whose sums over 150 and over `hit` keys differ in fp32
                    # round-off (up to 1.0e-5 measured).
                    torch.testing.assert_close(live.conv_states[i], cold.conv_states[i], rtol=0, atol=5e-5)
                else:
                    # Projections of 150 and of `hit` rows: a GEMM may block (and so round) by its row count (bit for
                    # bit on some CPUs, up to 2.3e-6 apart on AMD EPYC's), so fp32 round-off, not bits.
                    torch.testing.assert_close(live.conv_states[i], cold.conv_states[i], rtol=0, atol=1e-5,
                                               msg=lambda text, hit=hit, layer=m.layer_idx: f"{text} (conv window at {hit}, "
                                               f"layer {layer})")
                if family in [*SHORT_CONV_FAMILIES, "inkling2_loop_text"]:
                    assert live.recurrent_states[i] is None and cold.recurrent_states[i] is None
                else:
                    torch.testing.assert_close(live.recurrent_states[i], cold.recurrent_states[i], rtol=0, atol=1e-5)
        finally:
            cache.reset()


@pytest.mark.parametrize("family", GDN_FAMILIES[:1] + KDA_FAMILIES)
def test_a_state_one_token_off_fails_the_state_check(family, model, cold_model):
    """Power of the check above: the cold state one token later differs by far more than its tolerance."""
    ids = random_ids(150, seed=90)
    at_64, at_65 = cold_states(cold_model, ids, 64), cold_states(cold_model, ids, 65)
    layer = HybridPrefixCache(model).spec.mamba[0].layer_idx
    diff = (at_64.layers[layer].recurrent_states[0] - at_65.layers[layer].recurrent_states[0]).abs().max()
    assert diff > 1e-3
    assert not torch.equal(at_64.layers[layer].conv_states[0], at_65.layers[layer].conv_states[0])


@pytest.mark.parametrize("family", KDA_FAMILIES)
@pytest.mark.parametrize("part", ["conv", "recurrent"])
def test_zeroed_restored_kda_state_fails_the_exactness_check(family, part, model, cold_model):
    """Power for the KDA families: the prefix reaches the logits through both parts of the restored state, so a hit
    whose conv window or recurrent state is zeroed after the restore no longer equals the cold run."""
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(100, seed=94)
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=1)
    cache.restore(ids)
    assert cache.last_hit_tokens == [96]
    for m in cache.spec.mamba:
        layer = cache.layers[m.layer_idx]
        (layer.conv_states if part == "conv" else layer.recurrent_states)[0].zero_()
    with torch.no_grad():
        broken = model(ids[:, 96:], **{CACHE_KWARG: cache}, use_cache=True).logits[:, -1]
    cache.reset()
    assert (broken - _logits(cold_model, ids)[:, -1]).abs().max() > 1e-2


@pytest.mark.parametrize("family", GDN_FAMILIES[:1] + KDA_FAMILIES)
def test_other_models_of_the_family_run_the_kernel_unchanged(family, model):
    """The kernel is rebound in its modeling module; outside a cache's own mixer calls it passes every call through."""
    other = build_model(family, seed=1)
    ids = random_ids(100, seed=91)
    before = _logits(other, ids)
    cache = HybridPrefixCache(model)
    model.generate(ids, max_new_tokens=1, **{CACHE_KWARG: cache})
    assert torch.equal(_logits(other, ids), before)


@pytest.mark.parametrize("family", GDN_FAMILIES + KDA_FAMILIES)
def test_piecewise_kernel_calls_are_exact(family, model, cold_model, monkeypatch):
    """With ``fla`` installed the states come from calling the kernel piecewise (initial_state -> final_state); the
    same path on CPU keeps the cache exact."""
    monkeypatch.setattr(type(GDN_KERNEL), "uses_fast_package", property(lambda self: True))
    cache = HybridPrefixCache(model, retention_interval=32)
    ids = random_ids(150, seed=92)
    for expected_hit in (0, 144):
        assert_matches_cold(model, cold_model, cache, ids)
        assert cache.last_hit_tokens == [expected_hit]


def test_ling_conv_kept_in_float32_in_a_bf16_checkpoint(tmp_path):
    """Ling keeps ``conv1d`` in float32 when loaded in bf16 (``_keep_in_fp32_modules_strict``) while its conv state
    holds the bf16 q|k|v projections; the checkpoint spec follows the state, so a loaded bf16 model hits exactly."""
    build_model("bailing_hybrid", seed=0).save_pretrained(tmp_path)
    model, cold_model = (
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval() for _ in range(2)
    )
    mixer = model.model.layers[0].self_attn
    assert mixer.conv1d.weight.dtype == torch.float32 and mixer.q_proj.weight.dtype == torch.bfloat16
    cache = HybridPrefixCache(model)
    assert {m.conv.dtype for m in cache.spec.mamba} == {torch.bfloat16}
    ids = random_ids(100, seed=95)
    for expected_hit in (0, 96):
        assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
        assert cache.last_hit_tokens == [expected_hit]


def _stub(model_type: str) -> torch.nn.Module:
    stub = torch.nn.Linear(1, 1)
    stub.config = types.SimpleNamespace(model_type=model_type)
    stub.generate = lambda *args, **kwargs: None
    return stub


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_families_say_why(model_type):
    with pytest.raises(ValueError, match=f"model_type='{model_type}'") as info:
        HybridPrefixCache(_stub(model_type))
    assert REFUSED[model_type] in str(info.value)


_REFUSED_MODELS = {
    "minimax": (
        "MiniMaxConfig",
        dict(
            head_dim=16,
            layer_types=["full_attention", "linear_attention"],
            num_local_experts=2,
            num_experts_per_tok=1,
            block_size=16,
        ),
    ),
    "recurrent_gemma": (
        "RecurrentGemmaConfig",
        dict(
            block_types=["recurrent", "attention"],
            lru_width=64,
            attention_window_size=16,
            conv1d_width=4,
        ),
    ),
}


@pytest.mark.parametrize("model_type", sorted(_REFUSED_MODELS))
def test_refused_real_models_stay_usable(model_type):
    class_name, settings = _REFUSED_MODELS[model_type]
    config = getattr(transformers, class_name)(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **settings,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = random_ids(20, seed=93)
    before = _logits(model, ids)
    with pytest.raises(ValueError, match=REFUSED[model_type][:40]):
        HybridPrefixCache(model)
    assert torch.equal(_logits(model, ids), before)


def test_a_qwen3_5_vision_language_checkpoint_is_served_as_published_and_through_its_text_loader(tmp_path):
    """Qwen3.5 checkpoints are vision-language models (model_type 'qwen3_5'). The wrapper is served (images:
    tests/test_vision.py); AutoModelForCausalLM.from_pretrained of the same saved checkpoint builds the text decoder,
    which hits and equals the wrapper's own text-only generation too."""
    text = build_model("qwen3_5_text", seed=0)
    config = transformers.Qwen3_5Config(
        text_config=text.config.to_dict(),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
    )
    torch.manual_seed(0)
    wrapper = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    wrapper.save_pretrained(tmp_path)
    ids = random_ids(70, seed=95)
    reference = wrapper.generate(ids, max_new_tokens=8, do_sample=False)
    wrapper_cache = HybridPrefixCache(wrapper)
    for _ in range(2):
        out = wrapper.generate(ids, **{CACHE_KWARG: wrapper_cache}, max_new_tokens=8, do_sample=False)
        assert torch.equal(out, reference)
    assert wrapper_cache.last_hit_tokens == [64]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert model.config.model_type == "qwen3_5_text"
    cache = HybridPrefixCache(model)
    for _ in range(2):
        out = model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=8, do_sample=False)
        assert torch.equal(out, reference)
    assert cache.last_hit_tokens == [64]
