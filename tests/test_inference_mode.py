"""The cache and the engine used under ``torch.inference_mode()`` (as many servers and evaluation harnesses wrap
inference), then outside it: the same tokens as cold runs, and a consistent store.

Before, the cache's first call under inference mode allocated the KV page pool as inference tensors; the next call
outside it could not write a page (``Inplace update to inference tensor outside InferenceMode``), and the block it had
registered before the write stayed without KV, so every later call with that prompt raised ``KeyError``. A manager
started under inference mode made its slots there too, and its loop thread, outside the mode, died at its first
write."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.core import check_store
from hf_hybridcache.toy import build_model

PROMPT = list(range(5, 45))  # 40 tokens: two 16-token blocks stored, and a checkpoint


def cold(family: str, prompt: list[int], new_tokens: int) -> list[int]:
    model = build_model(family, seed=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["jamba", "qwen3_5_text", "zamba2"])
def test_a_cache_first_used_under_inference_mode_serves_calls_outside_it(family):
    model = build_model(family, seed=0)
    cache = HybridPrefixCache(model)
    turns = [PROMPT, PROMPT + [50, 51, 52, 53] * 5, PROMPT + [50, 51, 52, 53] * 5 + [60] * 9, PROMPT + [70] * 20]
    for i, prompt in enumerate(turns):
        inside = i in (0, 3)
        with torch.inference_mode(inside):
            out = model.generate(torch.tensor([prompt]), cache=cache, max_new_tokens=6, do_sample=False,
                                 pad_token_id=0)
        assert out[0, len(prompt):].tolist() == cold(family, prompt, 6), (family, i)
        if i == 1:
            assert cache.last_hit_tokens[0] >= 32
        check_store(cache)


def test_a_manager_started_under_inference_mode_serves():
    model = build_model("jamba", seed=0)
    cache = HybridPrefixCache(model)
    with torch.inference_mode():
        manager = cache.init_continuous_batching(GenerationConfig(max_new_tokens=6, do_sample=False,
                                                                  eos_token_id=-1))
        manager.start()
    try:
        result = manager.get_result(request_id=manager.add_request(PROMPT), timeout=120)
    finally:
        manager.stop()
    assert result.error is None and result.generated_tokens == cold("jamba", PROMPT, 6)
    check_store(cache)
