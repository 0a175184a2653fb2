"""A fresh Mamba-1 prefill that stores no checkpoint (the engine's first chunk of a long prompt; a prompt shorter than
a block) runs the package's scan in float32 on CPU over the package's caches, and upstream's forward elsewhere.

Found by profiling the engine's cold prefill of a 1,024-token prompt (issue 35): its first 512-token chunk ran
upstream's associative scan (243 ms for the toy Jamba's 6 mixers), its second the package's (88 ms).
Power: with ``_scan_wanted_fresh`` answering False the first test fails (0 calls in the first chunk)."""

import pytest
import torch
from conftest import random_ids
from engine_scenarios import alone, config

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.engine import EngineLimits
from hf_hybridcache.models import jamba, zamba
from hf_hybridcache.toy import build_model


def _count(monkeypatch, module):
    calls = []
    original = module.selective_scan

    def counted(*args, **kwargs):
        calls.append(kwargs.get("initial_state") is None)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "selective_scan", counted)
    return calls


def test_the_engines_first_chunk_runs_the_package_scan_and_equals_cold(monkeypatch):
    model, cold = build_model("jamba"), build_model("jamba")
    calls = _count(monkeypatch, jamba)
    cache = HybridPrefixCache(model, block_size=16)
    prompt = random_ids(70, seed=4)[0].tolist()
    manager = cache.init_continuous_batching(config(max_new_tokens=6), limits=EngineLimits(max_batch_tokens=32))
    manager.start()
    try:
        manager.add_request(prompt, request_id="r", max_new_tokens=6)
        out = manager.get_result("r", timeout=120)
    finally:
        manager.stop()
    assert out.generated_tokens == alone(cold, prompt, 6)
    assert sum(calls) == 3  # the first 32-token chunk of each of the 3 Mamba mixers started from zeros


@pytest.mark.parametrize("family, module", [("jamba", jamba), ("zamba", zamba)])
def test_a_short_fresh_prompt_runs_the_package_scan_in_float32_only(monkeypatch, family, module):
    ids = random_ids(9, seed=8)  # shorter than a block: no checkpoint inside it
    for dtype, expected in ((torch.float32, True), (torch.bfloat16, False)):
        model = build_model(family, dtype=dtype)
        calls = _count(monkeypatch, module)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, do_sample=False, **{CACHE_KWARG: HybridPrefixCache(model)})
            model.generate(ids, max_new_tokens=2, do_sample=False)  # no cache: upstream's forward
        assert (len(calls) > 0 and all(calls)) if expected else calls == []  # fresh: from zeros
