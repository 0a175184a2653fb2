"""Bad input gets a clear ValueError, and the cache keeps working afterwards."""

import re
import warnings

import pytest
import torch
from conftest import assert_matches_cold, greedy, needs_cuda, random_ids
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.utils import GenerationMixin

from hf_hybridcache import CACHE_KWARG, DEFAULT_MAX_CACHE_BYTES, HybridPrefixCache, _compat
from hf_hybridcache._compat.versions import ALLOW_UNTESTED_ENV
from hf_hybridcache.core import check_store, entry_digests
from hf_hybridcache.toy import VOCAB_SIZE, build_model


def test_unsupported_model_names_the_supported_families():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="Supported families: .*jamba"):
        HybridPrefixCache(llama)
    with pytest.raises(ValueError, match="Supported families"):
        HybridPrefixCache(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=0), "block_size"),
        (dict(block_size=-16), "block_size"),
        (dict(block_size=8.0), "block_size"),
        (dict(block_size=True), "block_size"),
        (dict(retention_interval=7), "multiple of block_size=16"),
        (dict(retention_interval=-16), "retention_interval"),
        (dict(retention_interval="sparse"), "retention_interval"),
        (dict(retention_interval=1.5), "retention_interval"),
        (dict(max_cache_bytes=0), "max_cache_bytes"),
        (dict(max_cache_bytes=-1), "max_cache_bytes"),
        (dict(max_cache_bytes=1.5e9), "max_cache_bytes"),
        (dict(max_cache_bytes=1000), "cannot hold one KV block plus one checkpoint"),
        (dict(admit_divergence="yes"), "admit_divergence"),
        (dict(admit_divergence=None), "admit_divergence"),
        (dict(eviction="lfu"), "'flop_aware' .* or 'lru'"),
        (dict(eviction=None), "eviction"),
        (dict(replay_replies="yes"), "replay_replies"),
    ],
)
def test_invalid_options(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        HybridPrefixCache(model, **kwargs)


def test_defaults(model):
    cache = HybridPrefixCache(model)
    assert (cache.block_size, cache.options.retention_interval, cache.max_cache_bytes) == (16, 0, DEFAULT_MAX_CACHE_BYTES)
    assert (cache.options.admit_divergence, cache.options.eviction) == (True, "flop_aware")
    assert cache.options.replay_replies is False  # float32: decode steps agree with a prefill to round-off
    assert HybridPrefixCache(model, block_size=4, retention_interval=8).options.retention_tokens == 8


def test_cache_passed_to_another_model_raises_and_keeps_working(model, cold_model, family):
    cache = HybridPrefixCache(model)
    ids = random_ids(60, seed=90)
    assert_matches_cold(model, cold_model, cache, ids)
    other = build_model(family, seed=0)
    with pytest.raises(ValueError, match="one HybridPrefixCache per model"):
        # an unpatched model (Mamba on 5.23 takes the cache as cache_params only)
        other.generate(ids, **{_compat.cache_kwarg(other): cache}, max_new_tokens=4)
    HybridPrefixCache(other)
    with pytest.raises(ValueError, match="one HybridPrefixCache per model"):
        other.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=4)  # a model patched by its own cache
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [48]


def test_inputs_embeds_only_runs_without_reuse(model, cold_model):
    cache = HybridPrefixCache(model)
    ids = random_ids(60, seed=91)
    assert_matches_cold(model, cold_model, cache, ids)
    embeds = model.get_input_embeddings()(ids).detach()
    kwargs = dict(inputs_embeds=embeds, max_new_tokens=8, do_sample=False)
    try:
        ref = cold_model.generate(**kwargs)
    except ValueError as refusal:  # Zamba, Zamba2, Falcon-H1, Bamba, NemotronH: generate() refuses inputs_embeds
        with pytest.raises(ValueError, match="inputs_embeds"):
            model.generate(**{CACHE_KWARG: cache}, **kwargs)
        assert "inputs_embeds" in str(refusal)
    else:
        assert torch.equal(model.generate(**{CACHE_KWARG: cache}, **kwargs), ref)
        assert cache.last_hit_tokens == [0]
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [48]


def test_padding_in_the_middle_runs_without_reuse(model, cold_model):
    cache = HybridPrefixCache(model)
    ids = random_ids(60, seed=92)
    assert_matches_cold(model, cold_model, cache, ids)
    batch = torch.cat([ids, random_ids(60, seed=93)])
    mask = torch.ones_like(batch)
    mask[1, 20:25] = 0  # not left padding: no exact reuse is possible
    out, logits = greedy(model, batch, cache, attention_mask=mask)
    ref, ref_logits = greedy(cold_model, batch, attention_mask=mask)
    assert torch.equal(out, ref)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    assert cache.last_hit_tokens == [0, 0]
    assert cache.stats.prompt_tokens == 60 + 60 + 55
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [48]


@pytest.mark.parametrize(
    "ids,match",
    [
        (torch.tensor([[5, 6, VOCAB_SIZE, 7]]), f"Token id {VOCAB_SIZE} is outside the model's vocabulary"),
        (torch.tensor([[5, -1, 7]]), "Token id -1 is outside the model's vocabulary"),
        (torch.empty(1, 0, dtype=torch.long), "The prompt is empty"),
        (torch.tensor([[5.0, 6.0, 7.0]]), r"`input_ids` must hold integer token ids .* got a torch.float32 tensor"),
    ],
)
def test_bad_prompts_raise_before_anything_runs(model, cold_model, ids, match):
    cache = HybridPrefixCache(model)
    seen = random_ids(60, seed=94)
    assert_matches_cold(model, cold_model, cache, seen)
    before = entry_digests(cache)
    with pytest.raises(ValueError, match=match):
        model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=4)
    assert entry_digests(cache) == before
    assert_matches_cold(model, cold_model, cache, seen)
    assert cache.last_hit_tokens == [48]


def test_float_input_ids_are_refused_by_restore_and_the_cache_keeps_working():
    model = build_model("jamba")
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(40, seed=96)
    greedy(model, ids, cache, new_tokens=2)
    with pytest.raises(ValueError, match=r"`input_ids` must hold integer token ids .* input_ids.long\(\)"):
        cache.restore(ids.float())
    with pytest.raises(ValueError, match="`input_ids` must hold integer token ids"):
        cache.restore(ids.bool())
    assert cache.restore(ids) == [32]


def test_model_converted_to_another_dtype_is_refused(model, cold_model):
    cache = HybridPrefixCache(model)
    ids = random_ids(60, seed=95)
    assert_matches_cold(model, cold_model, cache, ids)
    model.to(torch.float64)  # and back: float32 -> float64 -> float32 is exact
    with pytest.raises(ValueError, match="The model is torch.float64 but this HybridPrefixCache was built for it in"):
        model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=4)
    model.to(torch.float32)
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [48]


def test_model_moved_to_other_devices_is_refused(model, cold_model, monkeypatch):
    cache = HybridPrefixCache(model)
    ids = random_ids(60, seed=96)
    assert_matches_cold(model, cold_model, cache, ids)
    first = (cache.spec.attention or cache.spec.mamba)[0].layer_idx  # Mamba has no attention layer
    moved_layer = _compat.decoder_layers(model)[first]
    real = _compat.execution_device
    # A CPU-only machine has no second device: report the layer where a `.to("cuda:1")` would have put it.
    monkeypatch.setattr(_compat, "execution_device", lambda m: torch.device("cuda", 1) if m is moved_layer else real(m))
    with pytest.raises(ValueError, match=f"moved to other devices .*{first}: 'cpu -> cuda:1'"):
        model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=4)
    monkeypatch.undo()
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [48]


@needs_cuda
def test_model_moved_to_cuda_is_refused(model, cold_model):
    cache = HybridPrefixCache(model)
    ids = random_ids(60, seed=97)
    assert_matches_cold(model, cold_model, cache, ids)
    model.to("cuda")
    with pytest.raises(ValueError, match="moved to other devices"):
        model.generate(ids.cuda(), **{CACHE_KWARG: cache}, max_new_tokens=4)
    model.to("cpu")
    assert_matches_cold(model, cold_model, cache, ids)


def test_forward_that_raises_stores_nothing_and_the_cache_keeps_working(model, cold_model):
    cache = HybridPrefixCache(model, retention_interval="dense")
    seen = random_ids(60, seed=98)
    assert_matches_cold(model, cold_model, cache, seen)
    before = check_store(cache)
    calls = []

    def fail_on_third_forward(module, args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")

    handle = _compat.decoder_layers(model)[-1].register_forward_pre_hook(fail_on_third_forward)
    longer = torch.cat([seen, random_ids(40, seed=99)], dim=1)
    with pytest.raises(RuntimeError, match="device lost"):
        model.generate(longer, **{CACHE_KWARG: cache}, max_new_tokens=8, do_sample=False)
    handle.remove()
    after = check_store(cache, before)
    assert set(after) >= set(before)  # the prefill was stored (it completed); the failed decode step stored nothing
    assert all(not block.ref_count for block in cache.store.blocks())
    assert_matches_cold(model, cold_model, cache, longer)
    assert cache.last_hit_tokens == [96]


@pytest.mark.parametrize("value", [1000, 0, "2GB", 1.5])
def test_invalid_budget_change_keeps_the_old_one(model, value):
    cache = HybridPrefixCache(model, max_cache_bytes=10**6)
    with pytest.raises(ValueError, match="max_cache_bytes"):
        cache.max_cache_bytes = value
    assert cache.max_cache_bytes == 10**6
    cache.max_cache_bytes = None
    assert cache.max_cache_bytes == DEFAULT_MAX_CACHE_BYTES


def test_invalid_offload(model):
    with pytest.raises(ValueError, match="`offload` must be None .* or 'cpu'"):
        HybridPrefixCache(model, offload="disk")


#: What the refusal of an untested transformers says to do.
_INSTALL = re.escape("pip install 'transformers>=5.23.0,<=5.25.0'")


@pytest.fixture(scope="module")
def jamba():
    """The version check runs before the family matters: one family's model is enough."""
    return build_model("jamba", seed=0)


@pytest.mark.parametrize("version", ["5.26.0", "5.26.0.dev0", "5.25.1", "6.0.0", "5.22.0"])
def test_an_untested_transformers_is_refused_with_the_command_that_installs_a_tested_one(jamba, monkeypatch, version):
    monkeypatch.setattr(_compat, "TRANSFORMERS_VERSION", version)
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(ValueError, match=rf"tested with transformers 5\.23\.0, 5\.24\.0 and 5\.25\.0 \(transformers>="
                                         rf"5\.23\.0,<=5\.25\.0\), and transformers {re.escape(version)} is installed"
                                         rf".* Install a tested version: {_INSTALL}\. To run this one anyway, set "
                                         rf"{ALLOW_UNTESTED_ENV}=1"):
        HybridPrefixCache(jamba)
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "0")
    with pytest.raises(ValueError, match=_INSTALL):
        HybridPrefixCache(jamba)


@pytest.mark.parametrize("version", ["5.23.0", "5.24.0", "5.24.1", "5.25.0"])
def test_the_tested_window_runs_without_a_word(jamba, monkeypatch, version):
    monkeypatch.setattr(_compat, "TRANSFORMERS_VERSION", version)
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HybridPrefixCache(jamba)


def test_an_untested_transformers_runs_when_the_user_opts_in_and_is_warned_once(jamba, monkeypatch):
    monkeypatch.setattr(_compat, "TRANSFORMERS_VERSION", "5.99.0")
    monkeypatch.setattr(_compat, "_warned_versions", set())
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(UserWarning, match=rf"runs on transformers 5\.99\.0, outside its tested window \(transformers>="
                                         rf"5\.23\.0,<=5\.25\.0\), because {ALLOW_UNTESTED_ENV}=1: .*{_INSTALL}"):
        cache = HybridPrefixCache(jamba)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = HybridPrefixCache(jamba)  # once per process
        ids = random_ids(40, seed=5)
        assert_matches_cold(jamba, build_model("jamba", seed=0), cache, ids)
        assert_matches_cold(jamba, build_model("jamba", seed=0), cache, ids)
    assert cache.last_hit_tokens == [32]


def test_a_transformers_without_the_internals_it_hooks_is_refused(jamba, monkeypatch):
    monkeypatch.delattr(GenerationMixin, "_prefill")
    with pytest.raises(ValueError, match=r"internals it hooks into moved: transformers\.generation\.utils\."
                                         r"GenerationMixin\._prefill: missing .*relied on by hf_hybridcache\._compat\."
                                         rf"generation .*Install a tested version: {_INSTALL}"):
        HybridPrefixCache(jamba)


def test_an_opted_in_transformers_without_the_internals_it_hooks_is_still_refused(jamba, monkeypatch):
    monkeypatch.setattr(_compat, "TRANSFORMERS_VERSION", "5.99.0")
    monkeypatch.setattr(_compat, "_warned_versions", set())
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    monkeypatch.delattr(GenerationMixin, "_get_candidate_generator")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"_get_candidate_generator: missing"):
        HybridPrefixCache(jamba)


def test_a_transformers_whose_cache_layers_lack_the_fields_a_restore_sets_is_refused(jamba, monkeypatch):
    """A restore sets the fields of DynamicLayer and LinearAttentionLayer that their lazy_initialization sets; a
    transformers that renamed one is refused up front, naming it, instead of restoring into the wrong field."""
    from transformers.cache_utils import DynamicLayer

    init = DynamicLayer.__init__

    def without_is_initialized(self, *args, **kwargs):
        init(self, *args, **kwargs)
        del self.is_initialized

    monkeypatch.setattr(DynamicLayer, "__init__", without_is_initialized)
    with pytest.raises(ValueError, match=r"DynamicLayer\[fields a restore writes\]: has no is_initialized .*"
                                         r"Install a tested version"):
        HybridPrefixCache(jamba)


def test_a_pad_id_inside_a_prompt_warns_once_and_an_explicit_mask_restores_reuse(caplog):
    """generate() masks every pad_token_id it finds when no attention_mask is given: a chat whose tokens include the
    pad id then runs without reuse. The cache says so once, with the fix; an all-ones mask makes it hit again."""
    model, cold = build_model("jamba", seed=0), build_model("jamba", seed=0)
    cache = HybridPrefixCache(model)
    ids = random_ids(60, seed=94)
    ids[0, 30] = model.generation_config.pad_token_id
    assert_matches_cold(model, cold, cache, ids)
    with caplog.at_level("WARNING", logger="hf_hybridcache"):
        assert_matches_cold(model, cold, cache, ids)
        assert_matches_cold(model, cold, cache, ids)
    assert cache.last_hit_tokens == [0]
    warnings_given = [r for r in caplog.records if "attention_mask=torch.ones_like(input_ids)" in r.getMessage()]
    assert len(warnings_given) == 1
    mask = torch.ones_like(ids)
    assert_matches_cold(model, cold, cache, ids, attention_mask=mask)
    assert_matches_cold(model, cold, cache, ids, attention_mask=mask)
    assert cache.last_hit_tokens == [48]
