"""transformers' "falling back ... install mamba_ssm" notices are dropped only where the package's own scan stands in
for the kernel they name, and one line of the package's says which path runs what.

Each case runs in a fresh interpreter: transformers logs each notice once per process, so what an earlier test ran
would decide what a later one sees.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Builds a model with a cache (which installs the filter), then runs the phases named on the command line, each
#: after a marker line on stderr: "stock" generates with another model of the family and no cache, "cached" twice
#: with the cache (the second call replays its tail from the restored state).
SCRIPT = """
import sys, torch
from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.toy import build_model
family, phases = sys.argv[1], sys.argv[2:]
ids = torch.randint(6, 200, (1, 40), generator=torch.Generator().manual_seed(0))
patched = build_model(family)
cache = HybridPrefixCache(patched)
for phase in phases:
    print(f"--- {phase}", file=sys.stderr, flush=True)
    for _ in range(2 if phase == "cached" else 1):
        model, kwargs = (patched, {CACHE_KWARG: cache}) if phase == "cached" else (build_model(family), {})
        model.generate(ids, max_new_tokens=3, **kwargs)
"""
STAND_INS = ("selective_scan_fn", "mamba_chunk_scan_combined", "causal_conv1d_fn")
needs_fallbacks = pytest.mark.skipif(
    importlib.util.find_spec("mamba_ssm") is not None or importlib.util.find_spec("causal_conv1d") is not None,
    reason="needs transformers' fallback notices, which the installed mamba-ssm / causal-conv1d silence: run without",
)


def _notice(kernel: str) -> str:
    return f"`{kernel}` is falling back to its reference PyTorch implementation"


def _run(family: str, *phases: str) -> dict[str, str]:
    """stderr of SCRIPT, split at the markers: ``{"construction": ..., phase: ...}``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, family, *phases], capture_output=True, text=True, env=env,
                          timeout=600, check=True)
    parts = done.stderr.split("--- ")
    return {"construction": parts[0], **{part.split("\n", 1)[0]: part.split("\n", 1)[1] for part in parts[1:]}}


@needs_fallbacks
@pytest.mark.parametrize(
    "family,model_class,phases",
    [
        # Jamba's cached calls never reach the stand-in kernels, so a model without the cache run afterwards is the
        # first to: it must show their notices (the filter acts inside the patched model's forwards only).
        ("jamba", "JambaForCausalLM", ("cached", "stock")),
        # Zamba2's second call replays from the restored state without a checkpoint, through upstream's own path.
        ("zamba2", "Zamba2ForCausalLM", ("cached",)),
    ],
)
def test_fallback_notices_are_dropped_where_the_package_scan_stands_in_and_one_line_says_what_runs(
    family, model_class, phases
):
    out = _run(family, *phases)
    line = f"hf_hybridcache: {model_class} on cpu: prefills that store checkpoints"
    assert out["construction"].count(line) == 1, out["construction"]
    assert "`pip install mamba-ssm causal-conv1d` speeds up those" in out["construction"]
    assert [k for k in STAND_INS if _notice(k) in out["cached"]] == [], out["cached"]
    # float32 decode steps over the cache run the package's fused single-token update (kernels/state_update.py), so
    # upstream's recurrent step and its notices never run there; the line says so.
    assert "float32 decode steps run hf_hybridcache's fused single-token update" in out["construction"]
    assert _notice("selective_state_update") not in out["cached"], out["cached"]
    assert _notice("causal_conv1d_update") not in out["cached"], out["cached"]
    if "stock" in phases:  # without the cache upstream's kernels run, and their notices are true and stay
        assert _notice("selective_scan_fn") in out["stock"] and _notice("causal_conv1d_fn") in out["stock"]
        assert _notice("selective_state_update") in out["stock"] and _notice("causal_conv1d_update") in out["stock"]


def _swap_in_a_hub_kernel(module, name: str | None = None) -> None:
    """What ``kernels.kernelize`` leaves behind when it swaps a Hub kernel in (``kernels/_internals/layer/layer.py``,
    ``_replace_forward``): the replaced forward and the repository it came from, on the mixer's wrapper of module
    function ``name`` or, without ``name``, on the mixer itself."""
    from types import MethodType

    target = module if name is None else vars(module)["_kernel_funcs"][name]

    def hub_forward(self, *args, **kwargs):
        raise AssertionError("the swapped-in kernel ran")

    target.forward = MethodType(hub_forward, target)
    vars(target)["_kernel_repo"] = "kernels-community/example"


@pytest.mark.skipif(importlib.util.find_spec("kernels") is None, reason="needs the kernels package (transformers "
                    ">= 5.25 installs it): pip install kernels")
@pytest.mark.parametrize("family,mixer,function", [
    ("jamba", "JambaMambaMixer", "mamba_scan_forward"),
    ("zamba2", "Zamba2MambaMixer", "causal_conv1d_forward"),
    ("qwen3_5_text", "Qwen3_5GatedDeltaNet", None),
])
def test_hub_kernels_handed_the_cache_are_refused_by_name_and_reset_kernels_lifts_it(family, mixer, function):
    """transformers 5.25's ``from_pretrained`` kernelizes by default; a Hub kernel that is handed the cache keeps the
    recurrent state its own way, so the cache refuses the model (naming the kernel and ``use_kernels=False``) and
    patches nothing; after transformers' ``model.reset_kernels()`` the same model is served, equal to a cold run."""
    from conftest import assert_matches_cold, random_ids

    from hf_hybridcache import HybridPrefixCache
    from hf_hybridcache.toy import build_model

    model, cold_model = build_model(family, seed=0), build_model(family, seed=0)
    modules = [m for m in model.modules() if type(m).__name__ == mixer]
    if not hasattr(model, "reset_kernels") or (function and function not in vars(modules[0]).get("_kernel_funcs", {})):
        pytest.skip("needs transformers >= 5.25 (a mixer's cache-handling code is kernelizable there): run it with 5.25")
    _swap_in_a_hub_kernel(modules[-1], function)
    expected = f"{mixer}{'.' + function if function else ''} (kernels-community/example)"
    with pytest.raises(ValueError, match=r"use_kernels=False") as refused:
        HybridPrefixCache(model)
    assert expected in str(refused.value)
    assert getattr(model, "_hf_hybridcache_hooks", None) is None and "forward" not in vars(modules[0])
    model.reset_kernels()
    cache = HybridPrefixCache(model)
    ids = random_ids(50, seed=5)
    for expected_hit in (0, 48):
        assert_matches_cold(model, cold_model, cache, ids)
        assert cache.last_hit_tokens == [expected_hit]
