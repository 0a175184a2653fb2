"""cache.save / HybridPrefixCache.load: safetensors + JSON, identity checks, refusal of damaged files without losing
anything in memory."""

import hashlib
import json
import os
import struct

import pytest
import torch
from conftest import assert_matches_cold, assert_restored_states_match, random_ids
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import hf_hybridcache
from hf_hybridcache import HybridPrefixCache, _compat
from hf_hybridcache.core import atomic_file, check_store, entry_digests
from hf_hybridcache.toy import build_model

# Kimi Linear: an MLA layer stores keys and values of two widths (two tensors per layer in the file).
pytestmark = pytest.mark.parametrize("family", ["jamba", "zamba2", "kimi_linear", "mamba"])  # mamba: no KV at all


@pytest.fixture
def warm(model, cold_model, tmp_path):
    """A cache holding two prompts' entries (dense checkpoints), saved to a file."""
    cache = HybridPrefixCache(model, retention_interval="dense")
    for seed in (300, 301):
        assert_matches_cold(model, cold_model, cache, random_ids(70, seed=seed), new_tokens=4)
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    return cache, path


def test_round_trip_restores_identical_entries_and_hashes(warm, family, cold_model):
    cache, path = warm
    fresh = build_model(family, seed=0)  # another instance with the same weights, as after a restart
    loaded = HybridPrefixCache.load(path, fresh)
    assert entry_digests(loaded) == entry_digests(cache)
    check_store(loaded)
    assert loaded.block_size == cache.block_size and loaded.options == cache.options
    assert loaded.stored_bytes == cache.stored_bytes
    ids = torch.cat([random_ids(70, seed=300), random_ids(9, seed=302)], dim=1)
    assert_restored_states_match(loaded, cold_model, ids, expected_hit=64)
    assert_matches_cold(fresh, cold_model, loaded, ids)
    assert loaded.last_hit_tokens == [64]


def test_file_is_safetensors_with_json_metadata(warm):
    cache, path = warm
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
    meta = json.loads(header["__metadata__"]["meta"])
    assert header["__metadata__"]["format"] == "hf_hybridcache/4"
    versions = {"hf_hybridcache": hf_hybridcache.__version__, "transformers": _compat.TRANSFORMERS_VERSION}
    assert meta["versions"] == versions
    assert meta["seed"] == cache.seed.hex()
    assert len(meta["blocks"]) == cache.stats.kv_blocks and len(meta["checkpoints"]) == cache.stats.checkpoints
    with safe_open(path, framework="pt") as f:
        names = set(f.keys())
    assert names == {f"{kind}.{a.layer_idx}" for a in cache.spec.attention for kind in ("keys", "values")} | {
        f"{kind}.{m.layer_idx}" for m in cache.spec.mamba for kind in ("conv", "ssm")
    }


def test_model_reloaded_with_from_pretrained_accepts_the_file(warm, model, cold_model, tmp_path):
    _, path = warm
    model.save_pretrained(tmp_path / "model")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    loaded = HybridPrefixCache.load(path, reloaded)
    assert_matches_cold(reloaded, cold_model, loaded, random_ids(70, seed=301))
    assert loaded.last_hit_tokens == [64]


def test_empty_cache_round_trip(model, tmp_path):
    cache = HybridPrefixCache(model)
    cache.save(tmp_path / "empty.safetensors")
    loaded = HybridPrefixCache.load(tmp_path / "empty.safetensors", model)
    assert loaded.stats.kv_blocks == 0 and loaded.stored_bytes == 0


def test_salted_entries_and_seed_survive(model, cold_model, tmp_path):
    cache = HybridPrefixCache(model)
    ids = random_ids(50, seed=310)
    assert_matches_cold(model, cold_model, cache.with_salt("tenant-a"), ids)
    cache.save(tmp_path / "c.safetensors")
    loaded = HybridPrefixCache.load(tmp_path / "c.safetensors", model)
    assert loaded.root_hash == cache.root_hash  # same seed, same hashes
    for view, hit in [(loaded.with_salt("tenant-b"), 0), (loaded, 0), (loaded.with_salt("tenant-a"), 48)]:
        assert_matches_cold(model, cold_model, view, ids)
        assert view.last_hit_tokens == [hit]


def test_smaller_budget_keeps_the_most_recent_entries(model, cold_model, tmp_path):
    cache = HybridPrefixCache(model)
    old, recent = random_ids(70, seed=320), random_ids(70, seed=321)
    for ids in (old, recent):
        assert_matches_cold(model, cold_model, cache, ids)
    cache.save(tmp_path / "c.safetensors")
    budget = cache.stored_bytes // 2 + cache.spec.kv_block_bytes
    loaded = HybridPrefixCache.load(tmp_path / "c.safetensors", model, max_cache_bytes=budget)
    check_store(loaded)
    assert loaded.max_cache_bytes == budget and loaded.stored_bytes <= budget
    for ids, hit in [(recent, 64), (old, 0)]:
        assert_matches_cold(model, cold_model, loaded, ids)
        assert loaded.last_hit_tokens == [hit]


def _refused_and_nothing_lost(path, cache, cold_model, match, load_with=None):
    """Loading ``path`` (for ``load_with``, default the cache's model) raises ValueError(match); ``cache`` still holds
    and serves its entries."""
    before = entry_digests(cache)
    with pytest.raises(ValueError, match=match):
        HybridPrefixCache.load(path, load_with or cache.model)
    assert entry_digests(cache) == before
    assert_matches_cold(cache.model, cold_model, cache, random_ids(70, seed=300), new_tokens=4)
    assert cache.last_hit_tokens == [64]


@pytest.mark.parametrize("keep", [0.0, 0.5, 0.999])
def test_truncated_file_is_refused(warm, model, cold_model, tmp_path, keep):
    cache, path = warm
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: int(len(data) * keep)])
    _refused_and_nothing_lost(cut, cache, cold_model, "truncated or corrupted")


@pytest.mark.parametrize("where", ["tensor data", "metadata", "last byte"])
def test_corrupted_file_is_refused(warm, model, cold_model, tmp_path, where):
    cache, path = warm
    data = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", data[:8])[0]
    offset = {
        "tensor data": 8 + header_len + 100,
        "metadata": data.index(b"blocks") + 20,  # inside the JSON document (a token id or a hash)
        "last byte": len(data) - 1,
    }[where]
    data[offset] ^= 0x01
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    _refused_and_nothing_lost(bad, cache, cold_model, "corrupted")


def test_other_files_are_refused(warm, model, cold_model, tmp_path):
    cache, _ = warm
    model.save_pretrained(tmp_path / "model")  # a safetensors file, but weights
    _refused_and_nothing_lost(tmp_path / "model" / "model.safetensors", cache, cold_model, "format")
    noise = tmp_path / "noise.bin"
    noise.write_bytes(os.urandom(4096))
    _refused_and_nothing_lost(noise, cache, cold_model, "truncated or corrupted")
    with pytest.raises(FileNotFoundError, match="cache.save"):
        HybridPrefixCache.load(tmp_path / "missing.safetensors", model)


def test_other_model_is_refused(warm, family, model, cold_model):
    cache, path = warm
    cases = [
        (build_model(family, seed=0, dtype=torch.bfloat16), "in torch.float32, not this .* in torch.bfloat16"),
        (build_model(family, seed=0, hidden_size=96), "another config .*hidden_size: saved 64, now 96"),
        (build_model(family, seed=1), "same config but other weights"),
        (build_model("falcon_h1" if family != "falcon_h1" else "jamba", seed=0), "saved for a .*ForCausalLM"),
    ]
    for other, match in cases:
        _refused_and_nothing_lost(path, cache, cold_model, match, load_with=other)


@pytest.mark.parametrize("package", ["transformers", "hf_hybridcache"])
def test_other_versions_are_refused(warm, model, cold_model, monkeypatch, package):
    cache, path = warm
    if package == "transformers":
        monkeypatch.setattr(_compat, "TRANSFORMERS_VERSION", "9.9.9")
    else:
        monkeypatch.setattr(hf_hybridcache._version, "__version__", "9.9.9")
    _refused_and_nothing_lost(path, cache, cold_model, f"saved with {package} .* but 9.9.9 is running")


def test_failed_save_keeps_the_previous_file(warm, monkeypatch):
    cache, path = warm
    before = path.read_bytes()

    def failing_save_file(tensors, filename, metadata):
        with open(filename, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(atomic_file, "save_file", failing_save_file)
    with pytest.raises(OSError, match=f"cannot be saved to {str(path)!r}: disk full"):
        cache.save(path)
    assert path.read_bytes() == before
    assert os.listdir(path.parent) == [path.name]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs a folder that takes no new files (Linux's /proc)")
def test_a_folder_that_takes_no_files_names_the_path_given_and_the_cache_stays_usable(warm, model, cold_model):
    # save("/proc/x.safetensors") raised safetensors' raw SafetensorError naming its temp file "/proc/.tmpXXXX".
    cache, path = warm
    with pytest.raises(OSError, match=r"cannot be saved to '/proc/x\.safetensors': No such file") as caught:
        cache.save("/proc/x.safetensors")
    assert ".tmp" not in str(caught.value)
    assert_matches_cold(model, cold_model, cache, random_ids(70, seed=300), new_tokens=4)
    assert cache.last_hit_tokens == [64]
    cache.save(path)
    assert entry_digests(HybridPrefixCache.load(path, model)) == entry_digests(cache)


def _rewrite(path, out, edit_meta):
    """Copy the cache file at ``path`` to ``out`` with ``edit_meta(meta text) -> text`` applied and its checksum
    recomputed (what a tampered file or a bug in another writer looks like)."""
    with safe_open(path, framework="pt", device="cpu") as f:
        metadata, tensors = dict(f.metadata()), {name: f.get_tensor(name) for name in f.keys()}
    metadata["meta"] = edit_meta(metadata["meta"])
    metadata["meta_sha256"] = hashlib.sha256(metadata["meta"].encode()).hexdigest()
    save_file(tensors, out, metadata=metadata)


def test_deeply_nested_metadata_is_a_clear_error(warm, model, cold_model, tmp_path):
    # json.loads raised RecursionError instead of the promised ValueError.
    cache, path = warm
    bad = tmp_path / "nested.safetensors"
    _rewrite(path, bad, lambda text: "[" * 100_000 + "]" * 100_000)
    _refused_and_nothing_lost(bad, cache, cold_model, "not usable JSON")


def test_a_stored_block_with_the_same_hash_but_other_tokens_runs_as_a_miss(warm, model, cold_model, tmp_path):
    # A root block's tokens changed in the file with its hash kept (a collision, or a tampered file): storing the
    # real block beside it failed with an AssertionError. Lookups re-compare tokens and miss; nothing is stored there.
    cache, path = warm
    ids, other = random_ids(70, seed=300), random_ids(70, seed=301)

    def change_first_block(text):
        meta = json.loads(text)
        block = next(b for b in meta["blocks"] if b[0] == -1 and b[1] == ids[0, :16].tolist())
        block[1] = [6 + (t + 1) % 200 for t in block[1]]
        return json.dumps(meta, sort_keys=True)

    tampered = tmp_path / "tampered.safetensors"
    _rewrite(path, tampered, change_first_block)
    loaded = HybridPrefixCache.load(tampered, model)
    for _ in range(2):
        assert_matches_cold(model, cold_model, loaded, ids, new_tokens=4)
        assert loaded.last_hit_tokens == [0]
    assert_matches_cold(model, cold_model, loaded, other, new_tokens=4)
    assert loaded.last_hit_tokens == [64]
    check_store(loaded)


def test_save_to_a_directory_or_a_missing_folder_is_a_clear_error(warm, model, cold_model, tmp_path):
    # save() into a missing folder named a temp file in its error, and save("/some/dir") renamed over the directory.
    cache, _ = warm
    with pytest.raises(ValueError, match="is a directory"):
        cache.save(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        cache.save(tmp_path / "missing" / "cache.safetensors")
    assert tmp_path.is_dir() and not (tmp_path / "missing").exists()
    cache.save(tmp_path / "ok.safetensors")
    assert HybridPrefixCache.load(tmp_path / "ok.safetensors", model).stats.kv_blocks == cache.stats.kv_blocks
