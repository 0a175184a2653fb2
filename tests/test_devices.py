"""Models spread by accelerate (device_map, layers offloaded to host memory or disk) and offload="cpu": outputs equal
cold runs, and every stored entry sits on the device its layer computes on (or in host memory when offloaded)."""

import pytest
import torch
from accelerate import dispatch_model, infer_auto_device_map
from accelerate.utils import compute_module_sizes
from conftest import FAMILIES, assert_matches_cold, needs_cuda, random_ids
from transformers import AutoModelForCausalLM

from hf_hybridcache import HybridPrefixCache, _compat
from hf_hybridcache.config import split_state_key
from hf_hybridcache.core import check_store
from hf_hybridcache.toy import build_model

CUDA = torch.cuda.is_available()


def _device_map(model, layer_device):
    """Every top-level module of ``model`` on "cpu", decoder layer ``i`` on ``layer_device(i)`` (the decoder is
    ``model.model``, Mamba's ``model.backbone``)."""
    prefix, base = model.base_model_prefix, model.base_model
    device_map = {f"{prefix}.{name}": "cpu" for name, _ in base.named_children() if name != "layers"}
    device_map.update({f"{prefix}.{name}": "cpu" for name, _ in base.named_parameters(recurse=False)})  # ZAYA
    device_map.update({f"{prefix}.layers.{i}": layer_device(i) for i in range(len(base.layers))})
    device_map.update({name: "cpu" for name, _ in model.named_children() if name != prefix})
    return device_map


def _load_dispatched(model, tmp_path, layer_device):
    model.save_pretrained(tmp_path / "model")
    return AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map=_device_map(model, layer_device), offload_folder=tmp_path / "offload"
    ).eval()


def assert_entries_on_layer_devices(cache, offloaded=False):
    """Every stored tensor is on its layer's execution device (host memory with offload="cpu")."""
    store, layers = cache.store, _compat.decoder_layers(cache.model)
    for block in store.blocks():
        for idx, kv in block.kv.items():
            for t in kv:
                assert t.device == (torch.device("cpu") if offloaded else _compat.execution_device(layers[idx]))
    for block in store.blocks():
        for key, states in (block.checkpoint or {}).items():
            idx = split_state_key(key)[0]
            for t in states:
                assert t.device == (torch.device("cpu") if offloaded else _compat.execution_device(layers[idx]))
                assert t.is_pinned() == (offloaded and _compat.execution_device(layers[idx]).type == "cuda")


def _two_turns(model, cold_model, cache, seed):
    """A prompt, then a longer one sharing it; returns the second call's hit."""
    ids = random_ids(70, seed=seed)
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=6)
    longer = torch.cat([ids, random_ids(20, seed=seed + 1)], dim=1)
    assert_matches_cold(model, cold_model, cache, longer, new_tokens=6)
    return cache.last_hit_tokens


# ZAYA's model holds parameters of its own, which a device_map must name; accelerate then warns that those names are
# no submodules, and places them as asked.
@pytest.mark.filterwarnings("ignore:The following device_map keys do not match any submodules:UserWarning")
@pytest.mark.parametrize("family", FAMILIES)
def test_layers_offloaded_to_disk_match_cold_runs(model, cold_model, tmp_path):
    dispatched = _load_dispatched(model, tmp_path, lambda i: "disk" if i % 2 else "cpu")
    assert any(p.device.type == "meta" for p in dispatched.parameters())  # really offloaded
    cache = HybridPrefixCache(dispatched, retention_interval="dense")
    assert _two_turns(dispatched, cold_model, cache, seed=600) == [64]
    assert_entries_on_layer_devices(cache)
    check_store(cache)


@pytest.mark.parametrize("family", ["jamba", "zamba2"])
@pytest.mark.parametrize("cache_first", [False, True])
def test_infer_auto_device_map_and_dispatch_model(model, cold_model, tmp_path, cache_first):
    """A device map from accelerate's memory budget (later layers to disk); the cache may be built before or after
    dispatching (accelerate then wraps the patched mixers)."""
    budget = int(compute_module_sizes(model)[""] * 0.9)
    device_map = infer_auto_device_map(
        model, max_memory={"cpu": budget}, no_split_module_classes=model._no_split_modules
    )
    assert {"cpu", "disk"} <= set(device_map.values())
    cache = HybridPrefixCache(model, retention_interval="dense") if cache_first else None
    dispatch_model(model, device_map, offload_dir=str(tmp_path / "offload"))
    cache = cache or HybridPrefixCache(model, retention_interval="dense")
    assert _two_turns(model, cold_model, cache, seed=610) == [64]
    assert_entries_on_layer_devices(cache)


@pytest.mark.parametrize("family", ["jamba", "zamba2"])
def test_saved_cache_loads_into_an_offloaded_model(family, model, cold_model, tmp_path):
    """The weights fingerprint reads offloaded weights from accelerate's maps, so the same checkpoint loaded with a
    device_map accepts the file."""
    cache = HybridPrefixCache(model)
    ids = random_ids(70, seed=620)
    assert_matches_cold(model, cold_model, cache, ids)
    cache.save(tmp_path / "cache.safetensors")
    dispatched = _load_dispatched(model, tmp_path, lambda i: "disk" if i % 2 else "cpu")
    loaded = HybridPrefixCache.load(tmp_path / "cache.safetensors", dispatched)
    assert_matches_cold(dispatched, cold_model, loaded, ids)
    assert loaded.last_hit_tokens == [64]
    other_weights = _load_dispatched(build_model(family, seed=3), tmp_path / "other", lambda i: "disk")
    with pytest.raises(ValueError, match="other weights"):
        HybridPrefixCache.load(tmp_path / "cache.safetensors", other_weights)


@pytest.mark.parametrize("family", ["jamba", "zamba2"])
def test_offload_cpu_keeps_entries_in_host_memory(family, model):
    device = "cuda" if CUDA else "cpu"
    model.to(device)
    cold_model = build_model(family, seed=0).to(device)
    cache = HybridPrefixCache(model, retention_interval="dense", offload="cpu")
    ids = random_ids(70, seed=630).to(device)
    before = None
    for extra in (0, 20):
        longer = torch.cat([ids, random_ids(extra, seed=631).to(device)], dim=1)
        assert_matches_cold(model, cold_model, cache, longer, new_tokens=6)
        before = check_store(cache, before)  # restores copied, decode never wrote a stored entry
    assert cache.last_hit_tokens == [64]
    assert_entries_on_layer_devices(cache, offloaded=True)


@needs_cuda
@pytest.mark.parametrize("family", ["jamba", "zamba2"])
def test_layers_split_between_cuda_and_cpu(model, cold_model, tmp_path):
    dispatched = _load_dispatched(model, tmp_path, lambda i: 0 if i % 2 else "cpu")
    cache = HybridPrefixCache(dispatched, retention_interval="dense")
    assert {d.type for d in cache.layer_devices.values()} == {"cpu", "cuda"}
    assert _two_turns(dispatched, cold_model, cache, seed=640) == [64]
    assert_entries_on_layer_devices(cache)
