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
