"""The patched mixers against transformers' own (unpatched) mixer forward, on a fresh prompt with a fresh cache.

One Mamba mixer per family is patched by ``HybridPrefixCache(model)`` and run inside a model forward; the input it
receives is replayed through the class's ``forward`` (transformers' code, never patched) over a fresh ``DynamicCache``.
Outputs, the resulting live conv/SSM states and the checkpoints emitted inside the forward are compared. Bit-identity
is asserted wherever the two paths run the same operations; the exceptions are stated at ``_tolerance``.
"""

import inspect
from dataclasses import dataclass

import pytest
import torch
from conftest import MAMBA1_FAMILIES, MAMBA2_FAMILIES, random_ids
from transformers import DynamicCache

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.kernels import use_backend
from hf_hybridcache.toy import build_model

MIXER_CLASS = {
    "jamba": "JambaMambaMixer",
    "zamba": "ZambaMambaMixer",
    "zamba2": "Zamba2MambaMixer",
    "falcon_h1": "FalconH1Mixer",
    "bamba": "BambaMixer",
    "granitemoehybrid": "GraniteMoeHybridMambaLayer",
    "nemotron_h": "NemotronHMamba2Mixer",
    "mamba": "MambaMixer",
    "falcon_mamba": "FalconMambaMixer",
    "mamba2": "Mamba2Mixer",
}
#: (test id, family, config overrides): every family, and Falcon-H1's other gate (gated RMS norm instead of silu).
_VARIANTS = [(family, family, {}) for family in MAMBA1_FAMILIES + MAMBA2_FAMILIES] + [
    ("falcon_h1-rms-norm", "falcon_h1", {"mamba_rms_norm": True})
]
VARIANTS = [pytest.param(family, overrides, id=name) for name, family, overrides in _VARIANTS]
BLOCK_SIZE = 16
#: With ``retention_interval="dense"`` a 53-token prompt wants checkpoints after 16, 32 and 48 tokens, so the patched
#: mixers run their own code (the state-emitting scan); an 11-token prompt reaches no block boundary, so they hand the
#: call to transformers' forward unchanged.
CHECKPOINTING_TOKENS, SHORT_TOKENS = 53, 11
EMIT_POSITIONS = (16, 32, 48)
#: Mamba-1's CPU scan (``selective_scan_chunked``) reassociates the recurrence (at most 3e-7 measured on these
#: models); a Mamba-2 state emitted inside a chunk is summed in another order than upstream's (at most 1e-8 measured).
FP32_ROUNDOFF = dict(rtol=0, atol=1e-5)
EXACT = dict(rtol=0, atol=0)


@dataclass
class PatchedRun:
    mixer: torch.nn.Module
    config: object
    hidden: torch.Tensor  # the mixer's input [1, T, hidden] as the model computed it (before any perturbation)
    kwargs: dict  # the other keyword arguments the decoder layer passed (attention mask, ...), cache excluded
    out: torch.Tensor
    conv: torch.Tensor
    ssm: torch.Tensor
    captured: dict  # {t: (conv state, SSM state) the mixer emitted after t tokens}


def _run_patched(family, overrides, seq_len, backend="auto", perturb=0.0) -> PatchedRun:
    """A model forward over a fresh prompt with a fresh HybridPrefixCache; records the first mixer's call. ``perturb``
    is added to the mixer's input at the first token (after recording the unperturbed input)."""
    model = build_model(family, **overrides)
    cache = HybridPrefixCache(model, block_size=BLOCK_SIZE, retention_interval="dense")
    mixer = next(m for m in model.modules() if type(m).__name__ == MIXER_CLASS[family])
    record, captured = {}, {}

    def before(module, args, kwargs):
        by_name = "hidden_states" in kwargs
        hidden = kwargs["hidden_states"] if by_name else args[0]
        record["hidden"] = hidden.clone()
        record["kwargs"] = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "cache_params", "cache")}
        perturbed = hidden.clone()
        perturbed[:, 0] += perturb
        if by_name:
            return args, {**kwargs, "hidden_states": perturbed}
        return (perturbed, *args[1:]), kwargs

    def after(module, args, kwargs, output):
        record["out"] = output

    original_capture = cache.capture_states

    def spy_capture(layer_idx, positions, states):
        if layer_idx == mixer.layer_idx:
            captured.update(zip(positions, states))
        original_capture(layer_idx, positions, states)

    cache.capture_states = spy_capture
    mixer.register_forward_pre_hook(before, with_kwargs=True)
    mixer.register_forward_hook(after, with_kwargs=True)
    with torch.no_grad(), use_backend(backend):
        model(random_ids(seq_len, seed=90), **{CACHE_KWARG: cache}, use_cache=True)
    live = cache.layers[mixer.layer_idx]
    conv, ssm = live.conv_states[0], live.recurrent_states[0]
    return PatchedRun(mixer, model.config, record["hidden"], record["kwargs"], record["out"], conv, ssm, captured)


def _run_upstream(run: PatchedRun, seq_len: int | None = None):
    """transformers' own forward of the same mixer module on the first ``seq_len`` tokens of the recorded input, over
    a fresh DynamicCache: (output, conv state, SSM state)."""
    forward = type(run.mixer).forward
    assert forward.__module__.startswith("transformers.models."), f"{forward.__module__} is not upstream code"
    hidden = run.hidden if seq_len is None else run.hidden[:, :seq_len]
    cache = DynamicCache(config=run.config)
    cache_kwarg = "cache" if "cache" in inspect.signature(forward).parameters else "cache_params"  # 5.24 / 5.23
    with torch.no_grad():
        out = forward(run.mixer, hidden, **{cache_kwarg: cache}, **run.kwargs)
    layer = cache.layers[run.mixer.layer_idx]
    return out, layer.conv_states[0], layer.recurrent_states[0]


def _tolerance(family, seq_len, backend):
    """Bit-identical except Mamba-1's fast CPU scan: the Mamba-2 families run ``mamba2_chunk_scan_ref``, which mirrors
    transformers' ``mamba2_chunk_scan`` operation for operation, and the Mamba-1 reference backend mirrors
    ``mamba_selective_scan``'s loop; with no checkpoint wanted the Mamba-2 mixers call transformers' forward itself,
    and the Mamba-1 mixers run the fast scan too in float32 on CPU (models/mamba1._scan_wanted_fresh: upstream's
    scan there is its token loop or associative scan; tests/test_fresh_scan.py)."""
    if family in MAMBA1_FAMILIES and backend == "auto":
        return FP32_ROUNDOFF
    return EXACT


def _assert_matches_upstream(run: PatchedRun, tolerance: dict) -> None:
    out, conv, ssm = _run_upstream(run)
    torch.testing.assert_close(run.out, out, **tolerance)
    torch.testing.assert_close(run.conv, conv, **EXACT)  # raw conv inputs, copied: exact on every path
    torch.testing.assert_close(run.ssm, ssm, **tolerance)


CASES = [
    pytest.param(family, overrides, seq_len, backend, id=f"{name}-{label}")
    for name, family, overrides in _VARIANTS
    for seq_len, backend, label in [
        (SHORT_TOKENS, "auto", "no-checkpoint"),
        (CHECKPOINTING_TOKENS, "auto", "checkpoints"),
        (CHECKPOINTING_TOKENS, "reference", "checkpoints-reference-kernels"),
    ]
]


@pytest.mark.parametrize("family,overrides,seq_len,backend", CASES)
def test_patched_mixer_equals_upstream_on_a_fresh_prompt(family, overrides, seq_len, backend):
    run = _run_patched(family, overrides, seq_len, backend)
    assert sorted(run.captured) == ([] if seq_len == SHORT_TOKENS else list(EMIT_POSITIONS))
    _assert_matches_upstream(run, _tolerance(family, seq_len, backend))


@pytest.mark.parametrize("backend", ["auto", "reference"], ids=["default-kernels", "reference-kernels"])
@pytest.mark.parametrize("family,overrides", VARIANTS)
def test_emitted_checkpoints_equal_upstream_on_the_prefix(family, overrides, backend):
    """The state emitted after t tokens equals transformers' state after a fresh forward of those t tokens alone."""
    run = _run_patched(family, overrides, CHECKPOINTING_TOKENS, backend)
    # Against a forward of t tokens alone, not bit for bit: the input projection of t rows and of the whole prompt may
    # round differently (a GEMM can block by its row count: bit for bit on some CPUs, up to 6e-8 apart on AMD EPYC's),
    # the fast Mamba-1 scan reassociates, and the Mamba-2 state inside a chunk is the chunk-start state decayed plus the
    # chunk's first tokens, another summation order than upstream's scan of the shorter prompt (see FP32_ROUNDOFF).
    for t in EMIT_POSITIONS:
        conv, ssm = run.captured[t]
        _, ref_conv, ref_ssm = _run_upstream(run, t)
        torch.testing.assert_close(conv, ref_conv, **FP32_ROUNDOFF)
        torch.testing.assert_close(ssm, ref_ssm, **FP32_ROUNDOFF)


@pytest.mark.parametrize("family,overrides", VARIANTS)
def test_comparison_fails_on_a_perturbed_input(family, overrides):
    """Power: a patched mixer fed 0.1 more at its first token fails the comparison, in its output and in the final
    SSM state (the long-memory init carries the first token to the end: the state moves by 9e-4 or more, ~100x the
    fp32 tolerance)."""
    run = _run_patched(family, overrides, CHECKPOINTING_TOKENS, perturb=0.1)
    tolerance = _tolerance(family, CHECKPOINTING_TOKENS, "auto")
    out, _, ssm = _run_upstream(run)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(run.out, out, **tolerance)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(run.ssm, ssm, **tolerance)
