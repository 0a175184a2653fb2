"""Stored entries belong to the weights that computed them: changed weights, PEFT adapters loaded, switched or
disabled never serve another weights state's entries, and coming back to a state finds its entries again."""

import copy
import logging

import pytest
import torch
import transformers
from conftest import assert_matches_cold, random_ids
from packaging.version import Version
from transformers.integrations import peft as transformers_peft

from hf_hybridcache import HybridPrefixCache, _compat
from hf_hybridcache.toy import build_model

peft = pytest.importorskip("peft", reason="needs peft: pip install -e '.[dev]'")
_NEEDED_PEFT = getattr(transformers_peft, "MIN_PEFT_VERSION", "0")
needs_peft_integration = pytest.mark.skipif(
    Version(peft.__version__) < Version(_NEEDED_PEFT),
    reason=f"needs peft >= {_NEEDED_PEFT} (transformers {transformers.__version__}'s adapter API; peft "
    f"{peft.__version__} is installed): pip install 'peft>={_NEEDED_PEFT}' once published, or transformers 5.23",
)


@pytest.fixture
def cold_model(family):
    """A cold model of this test's own: the tests change its weights and adapters (the shared one must not)."""
    return build_model(family, seed=0)


LORA_TARGETS = ["in_proj", "q_proj", "v_proj"]  # PEFT refuses out_proj and conv1d on Mamba models


def _run(model, cold_model, cache, ids, expected_hit):
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
    assert cache.last_hit_tokens == [expected_hit]


def test_weights_edited_in_place_are_a_new_namespace_and_restoring_them_hits_again(model, cold_model, caplog):
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(40, seed=470)
    original = copy.deepcopy(model.state_dict())
    _run(model, cold_model, cache, ids, 0)
    _run(model, cold_model, cache, ids, 32)
    with torch.no_grad():
        for m in (model, cold_model):
            for param in _compat.decoder_layers(m)[0].parameters():
                param.mul_(1.25)
    with caplog.at_level(logging.WARNING, logger="hf_hybridcache"):
        _run(model, cold_model, cache, ids, 0)  # the old entries were computed under other weights
    assert "weights or adapters changed" in caplog.text
    _run(model, cold_model, cache, ids, 32)
    for m in (model, cold_model):
        m.load_state_dict(original)
    _run(model, cold_model, cache, ids, 32)  # the original weights' entries are served again


def _add_lora(models, name, seed):
    for m in models:
        torch.manual_seed(seed)  # the same adapter weights in both models
        config = peft.LoraConfig(r=4, target_modules=LORA_TARGETS, init_lora_weights=False)
        m.add_adapter(config, adapter_name=name)


@needs_peft_integration
# Two adapters on one model are this test's point; peft warns on the second add_adapter that several adapters will be
# loaded.
@pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute in the model:UserWarning")
def test_adapters_never_share_entries_and_switching_back_hits(model, cold_model):
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(40, seed=471)
    _run(model, cold_model, cache, ids, 0)
    _add_lora((model, cold_model), "a", seed=1)
    _add_lora((model, cold_model), "b", seed=2)
    for name, expected_hit in (("a", 0), ("b", 0), ("a", 32), ("b", 32)):
        for m in (model, cold_model):
            m.set_adapter(name)
        _run(model, cold_model, cache, ids, expected_hit)
    for m in (model, cold_model):
        m.disable_adapters()
    _run(model, cold_model, cache, ids, 0)  # the base weights with the adapters loaded: a state of its own
    _run(model, cold_model, cache, ids, 32)
    for m in (model, cold_model):
        m.enable_adapters()
        m.set_adapter("a")
    _run(model, cold_model, cache, ids, 32)


@needs_peft_integration
def test_a_loaded_adapter_is_a_new_namespace(model, cold_model, tmp_path):
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(40, seed=472)
    _run(model, cold_model, cache, ids, 0)
    _run(model, cold_model, cache, ids, 32)
    donor = copy.deepcopy(cold_model)
    _add_lora((donor,), "saved", seed=3)
    donor.save_pretrained(tmp_path, selected_adapters=["saved"])
    for m in (model, cold_model):
        m.load_adapter(str(tmp_path), adapter_name="loaded")  # adapter_model.safetensors + adapter_config.json
    _run(model, cold_model, cache, ids, 0)
    _run(model, cold_model, cache, ids, 32)
