"""The weights identity reads every element: sparse edits (a few embedding rows, one row of one projection, one bias
element, a LoRA merged into one module) never serve entries of the old weights through the live cache, a saved file
or the shared tier, on every family; writes through ``param.data``; what the per-request check reads."""

import copy
import warnings

import pytest
import torch
from conftest import FAMILIES, greedy, random_ids
from safetensors import safe_open
from safetensors.torch import save_file

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache, _compat
from hf_hybridcache.core import weights
from hf_hybridcache.core.weights import RUN_ELEMENTS, tensor_digest
from hf_hybridcache.toy import build_model

peft = pytest.importorskip("peft")
NEW_TOKENS = 4


def _delta(*shape, seed=7):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.5


def _decoder_tensors(model, keep):
    """``(name, tensor)`` of the decoder layers' parameters for which ``keep(name, tensor)``, in module order."""
    return [(f"{i}.{n}", p) for i, layer in enumerate(_compat.decoder_layers(model))
            for n, p in layer.named_parameters() if keep(n, p)]


def _tallest_projection(model):
    """The decoder's linear projection with the most rows (the first such): its rows are wider apart than the 64
    samples the old fingerprint read."""
    linears = [(name, m) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and ".layers." in name]
    return max(linears, key=lambda item: item[1].out_features)


def edit_embedding_rows(model, ids):
    """Retrain three prompt tokens' embedding rows (a fine-tune of a few added or special tokens); rows between the
    64 evenly spaced elements the old fingerprint read."""
    emb = model.get_input_embeddings().weight
    emb.index_add_(0, ids[0, 8:11], _delta(3, emb.shape[1]))


def edit_one_projection_row(model, ids):
    weight = _tallest_projection(model)[1].weight
    weight[1] += _delta(weight.shape[1])


def edit_one_bias_element(model, ids):
    """Element 1 of the decoder's largest bias; of its largest norm weight in families without biases."""
    candidates = _decoder_tensors(model, lambda n, p: n.endswith("bias")) or _decoder_tensors(
        model, lambda n, p: "norm" in n)
    _, tensor = max(candidates, key=lambda item: item[1].numel())
    tensor.view(-1)[1] += 1.0


def merge_lora_into_one_module(model, ids):
    """A LoRA adapter on one projection, merged into its weight (peft writes it through ``weight.data``)."""
    torch.manual_seed(11)  # the same adapter for every copy of the model
    config = peft.LoraConfig(r=4, target_modules=[_tallest_projection(model)[0]], init_lora_weights=False)
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        assert peft.get_peft_model(model, config).merge_and_unload() is model


SPARSE_EDITS = [edit_embedding_rows, edit_one_projection_row, edit_one_bias_element, merge_lora_into_one_module]
def _served(model, cache, ids, expected, hit):
    seq, logits = greedy(model, ids, cache, NEW_TOKENS)
    assert cache.last_hit_tokens == [hit]
    assert torch.equal(seq, expected[0]), f"tokens differ from a cold run of the edited model (hit {hit})"
    torch.testing.assert_close(logits, expected[1], rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_sparse_edits_never_serve_old_entries(family, server, tmp_path):
    """Each edit in turn: before it, the live cache, a file and the tier all hold a hit for the prompt (the test has
    power); after it, each of them misses and the outputs equal a cold run of the edited model."""
    live, reference, fresh = (build_model(family, seed=0) for _ in range(3))
    ids = random_ids(40, seed=480)
    server.client().flushall()
    cache = HybridPrefixCache(live, retention_interval="dense", remote=server.url)
    expected = greedy(reference, ids, None, NEW_TOKENS)
    _served(live, cache, ids, expected, 0)
    for edit in SPARSE_EDITS:
        path = tmp_path / f"before_{edit.__name__}.safetensors"
        cache.save(path)
        assert cache.restore(ids) == [32], "the live cache holds the prompt"
        cache.reset()
        assert HybridPrefixCache.load(path, fresh).restore(ids) == [32], "the file holds the prompt"
        assert cache.remote.flush(30)
        probe = HybridPrefixCache(fresh, remote=server.url)
        assert probe.restore(ids) == [32] and probe.stats.remote_hit_tokens == 32, "the tier holds the prompt"
        probe.remote.close()

        with torch.no_grad():
            for m in (live, reference, fresh):
                edit(m, ids)
        before, expected = expected, greedy(reference, ids, None, NEW_TOKENS)
        assert (expected[1] - before[1]).abs().max() > 1e-2, f"{edit.__name__} must change the outputs"

        with pytest.raises(ValueError, match="other weights"):
            HybridPrefixCache.load(path, live)
        other = HybridPrefixCache(fresh, remote=server.url)  # a new process with the edited weights
        _served(fresh, other, ids, expected, 0)
        assert other.stats.remote_hit_tokens == 0
        other.remote.close()
        server.client().flushall()  # what the edited weights published there would be served to the live cache
        _served(live, cache, ids, expected, 0)
    cache.remote.close()


def test_dense_writes_through_data_are_seen_and_save_reads_sparse_ones(tmp_path):
    """The per-request samples see a write through ``.data`` that changes every element of a tensor (as peft's merge
    does); a sparse one is read by ``save()``, which computes the identity again (the file names the new weights)."""
    model, reference = build_model("jamba", seed=0), build_model("jamba", seed=0)
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(40, seed=481)
    for expected_hit in (0, 32):
        _served(model, cache, ids, greedy(reference, ids, None, NEW_TOKENS), expected_hit)
    for m in (model, reference):
        _compat.decoder_layers(m)[0].mamba.in_proj.weight.data.mul_(1.25)
    _served(model, cache, ids, greedy(reference, ids, None, NEW_TOKENS), 0)

    cache.save(tmp_path / "before.safetensors")
    for m in (model, reference):
        m.get_input_embeddings().weight.data[ids[0, 2]] += 0.5  # a row between the per-request samples
    expected = greedy(reference, ids, None, NEW_TOKENS)
    cache.save(tmp_path / "after.safetensors")
    with pytest.raises(ValueError, match="other weights"):
        HybridPrefixCache.load(tmp_path / "before.safetensors", reference)
    HybridPrefixCache.load(tmp_path / "after.safetensors", reference)
    _served(model, cache, ids, expected, 0)  # requests root in the weights save() read
    _served(model, cache, ids, expected, 32)


def test_clear_reads_sparse_writes_through_data_so_the_tier_serves_no_old_entries(server):
    """``clear()``, the remedy the README gives after a write through ``.data``, computes the identity again: the
    entries the old weights published to the tier stay unreachable."""
    server.client().flushall()
    model, reference = build_model("jamba", seed=0), build_model("jamba", seed=0)
    cache = HybridPrefixCache(model, retention_interval="dense", remote=server.url)
    ids = random_ids(40, seed=481)
    _served(model, cache, ids, greedy(reference, ids, None, NEW_TOKENS), 0)
    assert cache.remote.flush(30)
    for m in (model, reference):
        m.get_input_embeddings().weight.data[ids[0, 2]] += 0.5  # a row between the per-request samples
    cache.clear()
    _served(model, cache, ids, greedy(reference, ids, None, NEW_TOKENS), 0)
    assert cache.stats.remote_hit_tokens == 0
    cache.remote.close()


def test_rescaled_adapter_is_a_weights_state_of_its_own():
    """``rescale_adapter_scale`` changes LoRA outputs through a Python float alone (no tensor changes)."""
    from peft.helpers import rescale_adapter_scale

    lora = []
    for _ in range(2):
        torch.manual_seed(12)
        config = peft.LoraConfig(r=4, target_modules=["in_proj"], init_lora_weights=False)
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            lora.append(peft.get_peft_model(build_model("jamba", seed=0), config))
    (model, reference), ids = lora, random_ids(40, seed=482)
    cache = HybridPrefixCache(model.base_model.model, retention_interval="dense")
    expected = greedy(reference, ids, None, NEW_TOKENS)
    _served(model, cache, ids, expected, 0)
    with rescale_adapter_scale(model, 2.0), rescale_adapter_scale(reference, 2.0):
        doubled = greedy(reference, ids, None, NEW_TOKENS)
        assert (doubled[1] - expected[1]).abs().max() > 1e-2
        _served(model, cache, ids, doubled, 0)
    _served(model, cache, ids, expected, 32)  # back to the original scale: its entries again


@pytest.mark.parametrize("family", FAMILIES)
def test_requests_with_unchanged_weights_do_not_read_them_again(family, model, monkeypatch):
    """No parameter or buffer changes during a forward (a rotary or routing buffer replaced per call would make every
    request read every weight)."""
    cache = HybridPrefixCache(model)
    reads = []
    monkeypatch.setattr(weights, "weights_identity", lambda m: reads.append(m) or "")
    for _ in range(2):
        model.generate(random_ids(40, seed=483), **{CACHE_KWARG: cache}, max_new_tokens=3, do_sample=False)
    assert reads == [] and cache.last_hit_tokens == [32]


def test_offloaded_weights_are_read_from_accelerate_maps(tmp_path):
    """A sparse edit of weights that accelerate offloaded to disk is part of the identity."""
    from transformers import AutoModelForCausalLM

    model = build_model("jamba", seed=0)
    cache = HybridPrefixCache(model)
    cache.save(tmp_path / "cache.safetensors")
    with torch.no_grad():
        edit_one_projection_row(model, None)
    model.save_pretrained(tmp_path / "edited")
    device_map = {"model.embed_tokens": "cpu", "model.layers": "disk", "model.final_layernorm": "cpu", "lm_head": "cpu"}
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "edited", device_map=device_map,
                                                     offload_folder=tmp_path / "offload")
    assert _tallest_projection(offloaded)[1].weight.device.type == "meta"
    with pytest.raises(ValueError, match="other weights"):
        HybridPrefixCache.load(tmp_path / "cache.safetensors", offloaded)


@pytest.mark.parametrize("old_format", ["hf_hybridcache/2", "hf_hybridcache/3"])
def test_files_named_by_the_sampled_fingerprint_are_refused(old_format, tmp_path):
    model = build_model("jamba", seed=0)
    cache = HybridPrefixCache(model)
    model.generate(random_ids(40, seed=484), **{CACHE_KWARG: cache}, max_new_tokens=3, do_sample=False)
    cache.save(tmp_path / "new.safetensors")
    with safe_open(tmp_path / "new.safetensors", framework="pt") as f:
        metadata, tensors = {**f.metadata(), "format": old_format}, {n: f.get_tensor(n) for n in f.keys()}
    save_file(tensors, tmp_path / "old.safetensors", metadata=metadata)
    with pytest.raises(ValueError, match="64 sampled values per parameter, which misses sparse edits"):
        HybridPrefixCache.load(tmp_path / "old.safetensors", model)


# ---------------------------------------------------------------------- the digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.bool])
def test_digest_sees_any_single_element_and_is_the_run_sums(dtype):
    n = 2 * RUN_ELEMENTS + 5
    t = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    bits = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    table = [int(m) % 2**64 for m in weights._multipliers(torch.device("cpu"))]
    expected = [sum(int(x) * table[j] for j, x in enumerate(bits[s : s + RUN_ELEMENTS].tolist())) % 2**64
                for s in range(0, n, RUN_ELEMENTS)]
    assert tensor_digest(t) == b"".join(v.to_bytes(8, "little") for v in expected)
    for position in (0, RUN_ELEMENTS - 1, RUN_ELEMENTS, n - 1):
        edited = t.clone()
        edited[position] = ~edited[position] if dtype == torch.bool else edited[position] + 1
        assert tensor_digest(edited) != tensor_digest(t), position


def test_digest_does_not_depend_on_layout_or_step(monkeypatch):
    t = torch.randn(300, 1000, generator=torch.Generator().manual_seed(2))
    digest = tensor_digest(t)
    assert tensor_digest(t.t().contiguous().t()) == digest  # a strided copy of the same values
    monkeypatch.setattr(weights, "_RUNS_PER_STEP", {"cpu": 1})
    assert tensor_digest(t) == digest
    swapped = t.clone()
    swapped[[3, 250]] = swapped[[250, 3]]  # two rows trade places
    assert tensor_digest(swapped) != digest


def test_identity_names_every_tensor_and_reads_tied_ones_once(monkeypatch):
    model = build_model("lfm2", seed=0)  # tied embeddings
    names = [name for name, _, _ in _compat.weight_tensors(model)]
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    assert any(name.endswith("inv_freq") for name in names)
    read = []
    original = weights.tensor_digest
    monkeypatch.setattr(weights, "tensor_digest", lambda t: read.append(t) or original(t))
    identity = weights.weights_identity(model)
    assert len(read) == len({id(p) for p in model.parameters()} | {id(b) for b in model.buffers()})
    monkeypatch.undo()
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(b for n, b in other.named_buffers() if n.endswith("inv_freq"))[0] += 1e-6
    assert weights.weights_identity(other) != identity == weights.weights_identity(copy.deepcopy(model))
