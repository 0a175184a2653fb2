"""deterministic=True on a Mamba wide enough that its float32 products take ``invariant_linear``'s oneDNN form
(kernels/batch_invariant.py, ``product_form``): the engine's tokens and logprobs for 1, 3 and 8 concurrent requests
equal each request alone in generate(), and a hit equals a cold run, bit for bit, at two intra-op threads (the toy's
products are all small enough for the MKL form; tests/test_deterministic.py holds those).

Power: with the row-invariant linear switched off (``mamba1_deterministic._OFF = {"linear"}``, ``F.linear`` in its
place), or with oneDNN's product run without the row tile, the engine's logprobs differ from generate()'s (and the
mode's probe refuses the untiled product).
"""

import pytest
import torch
from engine_scenarios import ids
from transformers import ContinuousBatchingConfig, GenerationConfig

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.kernels import batch_invariant
from hf_hybridcache.kernels.batch_invariant import product_form
from hf_hybridcache.models import deterministic, deterministic_linear, mamba1_deterministic
from hf_hybridcache.toy import build_model

GREEDY = dict(do_sample=False, pad_token_id=0)
#: in_proj [2048, 512], out_proj [512, 1024] and the LM head [1024, 512] reach ONEDNN_MIN_ELEMENTS; two layers.
WIDE = dict(hidden_size=512, intermediate_size=1024, vocab_size=1024, num_hidden_layers=2)
BASE = ids(40, seed=4700)
PROMPTS = [BASE[:20] + ids(5, seed=4701)] + [ids(n, seed=4710 + n) for n in (1, 9, 17, 30, 6, 12, 23)]
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def cold_model():
    model = build_model("mamba", seed=0, **WIDE)
    HybridPrefixCache(model, deterministic=True)  # claims the mode once; each reference builds its own cache
    return model


def _alone(model, prompt):
    """Greedy generate() of ``prompt`` alone over a fresh deterministic cache: tokens and each one's logprob."""
    cache = HybridPrefixCache(model, deterministic=True, retention_interval="dense")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=NEW_TOKENS,
                             output_logits=True, return_dict_in_generate=True, **GREEDY)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.softmax(s[0].float(), -1)[t].log().item() for s, t in zip(out.logits, tokens)]


def _engine_matches_alone(cold_model, prompts) -> bool:
    model = build_model("mamba", seed=0, **WIDE)
    _cache = HybridPrefixCache(model, deterministic=True, retention_interval="dense")  # noqa: F841 (serves the engine)
    outputs = model.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=NEW_TOKENS, **GREEDY),
                                   continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=48,
                                                                                       return_logprobs=True))
    for i, prompt in enumerate(prompts):
        output = outputs[f"req_{i}"]
        assert output.error is None, output.error
        if (output.generated_tokens, list(output.logprobs)) != _alone(cold_model, prompt):
            return False
    return True


def test_the_wide_model_runs_the_onednn_product(cold_model):
    mixer = cold_model.backbone.layers[0].mixer
    weights = (mixer.in_proj.weight, mixer.out_proj.weight, cold_model.lm_head.weight)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: every product is the MKL form tests/test_deterministic.py covers")
    assert [product_form(w) for w in weights] == ["onednn"] * 3
    assert product_form(mixer.x_proj.weight) == "blas"


def test_engine_requests_equal_generate_alone_in_any_batch(cold_model):
    torch.set_num_threads(2)  # restored by conftest's fixture
    for prompts in (PROMPTS[:1], PROMPTS[2:5], PROMPTS):
        assert _engine_matches_alone(cold_model, prompts), f"{len(prompts)} requests"


def test_a_hit_equals_cold(cold_model):
    torch.set_num_threads(2)
    cache = HybridPrefixCache(cold_model, deterministic=True, retention_interval="dense")
    prompt = BASE + ids(6, seed=4702)
    with torch.no_grad():
        cold_model.generate(torch.tensor([BASE]), past_key_values=cache, max_new_tokens=1, **GREEDY)
        out = cold_model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=NEW_TOKENS,
                                  output_logits=True, return_dict_in_generate=True, **GREEDY)
    assert cache.last_hit_tokens == [32]
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.softmax(s[0].float(), -1)[t].log().item() for s, t in zip(out.logits, tokens)]
    assert (tokens, logprobs) == _alone(cold_model, prompt)


def test_power_with_the_invariant_linear_off_the_engine_differs(cold_model, monkeypatch):
    torch.set_num_threads(2)
    monkeypatch.setattr(mamba1_deterministic, "_OFF", {"linear"})
    assert not _engine_matches_alone(cold_model, PROMPTS)


def test_power_the_onednn_product_without_the_row_tile_is_refused_and_differs(cold_model, monkeypatch):
    """oneDNN's product on the rows as they come (one row through its matrix-vector kernel): the mode's probe refuses
    the model, and with the probe bypassed the engine's logprobs move off generate()'s (the small weights keep the
    tiled MKL product). The tile, not the library, holds the guarantee."""
    torch.set_num_threads(2)
    tiled = batch_invariant.invariant_linear

    def untiled_onednn(x, weight, bias=None):
        if product_form(weight) != "onednn":
            return tiled(x, weight, bias)
        rows = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias, "none", [], "")
        return rows.reshape(*x.shape[:-1], weight.shape[0])

    monkeypatch.setattr(batch_invariant, "invariant_linear", untiled_onednn)  # what the probes run
    monkeypatch.setattr(deterministic_linear, "invariant_linear", untiled_onednn)  # what the mixers and LM head run
    monkeypatch.setattr(batch_invariant, "_CHECKED", set())
    with pytest.raises(ValueError, match=r"product \('onednn'\) of a \[2048, 512\] .* at \[1\] rows"):
        HybridPrefixCache(build_model("mamba", seed=0, **WIDE), deterministic=True)
    monkeypatch.setattr(deterministic, "check_row_invariance", lambda weight, bias=None: None)
    assert not _engine_matches_alone(cold_model, PROMPTS)
