"""Mamba-2 families (Zamba2, Falcon-H1, ..., Mamba-2): the chunk scan with state emission, the patched mixers, block
sizes against the chunk size, unaligned forwards; and a power check for every family (bf16 and save/load:
test_families.py)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import MAMBA2_FAMILIES, assert_matches_cold, assert_restored_states_match, random_ids
from transformers import DynamicCache

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache._compat.continuous_batching import cache_parameter
from hf_hybridcache.kernels import mamba2_chunk_scan_ref, mamba2_recurrent_ref
from hf_hybridcache.toy import build_model

CHUNK_SIZE_KEY = {
    "zamba2": "chunk_size",
    "falcon_h1": "mamba_chunk_size",
    "bamba": "mamba_chunk_size",
    "granitemoehybrid": "mamba_chunk_size",
    "nemotron_h": "chunk_size",
    "mamba2": "chunk_size",
}
MIXER_CLASS = {
    "zamba2": "Zamba2MambaMixer",
    "falcon_h1": "FalconH1Mixer",
    "bamba": "BambaMixer",
    "granitemoehybrid": "GraniteMoeHybridMambaLayer",
    "nemotron_h": "NemotronHMamba2Mixer",
    "mamba2": "Mamba2Mixer",
}


def scan_inputs(seq_len, heads=4, head_dim=3, groups=2, state=5, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(batch, seq_len, heads, head_dim, generator=g),
        dt=torch.randn(batch, seq_len, heads, generator=g),
        A=-torch.rand(heads, generator=g) * 0.5,
        B=torch.randn(batch, seq_len, groups, state, generator=g),
        C=torch.randn(batch, seq_len, groups, state, generator=g),
        D=torch.randn(heads, generator=g),
        dt_bias=torch.randn(heads, generator=g),
        dt_softplus=True,
        initial_state=torch.randn(batch, heads, head_dim, state, generator=g),
    )


@pytest.mark.parametrize(
    "seq_len,chunk_size,positions",
    [
        (37, 8, (1, 5, 8, 16, 21, 37)),  # aligned and unaligned, the last token, a padded last chunk
        (24, 8, (8, 16, 24)),  # only chunk boundaries
        (13, 32, (4, 12)),  # one chunk longer than the sequence
        (9, 1, (3, 9)),  # chunks of one token
    ],
    ids=["mixed", "aligned", "chunk>T", "chunk=1"],
)
@pytest.mark.parametrize("from_state", [False, True], ids=["zero-state", "initial-state"])
def test_chunk_scan_matches_the_recurrence(seq_len, chunk_size, positions, from_state):
    inputs = scan_inputs(seq_len)
    if not from_state:
        inputs["initial_state"] = None
    y, final, emitted = mamba2_chunk_scan_ref(chunk_size=chunk_size, emit_positions=positions, **inputs)
    ref_y, ref_final, ref_emitted = mamba2_recurrent_ref(emit_positions=positions, **inputs)
    assert y.dtype == final.dtype == torch.float32 and len(emitted) == len(positions)
    torch.testing.assert_close(y, ref_y, rtol=0, atol=1e-4)
    torch.testing.assert_close(final, ref_final, rtol=0, atol=1e-5)
    for state, ref_state in zip(emitted, ref_emitted):
        torch.testing.assert_close(state, ref_state, rtol=0, atol=1e-5)


def test_chunk_scan_is_bit_identical_to_the_transformers_torch_path():
    from transformers.models.zamba2 import modeling_zamba2

    inputs = scan_inputs(29)
    y, final, _ = mamba2_chunk_scan_ref(chunk_size=8, emit_positions=(5, 16), **inputs)
    x, dt, A, B, C = (inputs.pop(name) for name in ("x", "dt", "A", "B", "C"))
    inputs["initial_states"] = inputs.pop("initial_state")
    ref_y, ref_final = modeling_zamba2.mamba2_chunk_scan(x, dt, A, B, C, 8, return_final_states=True, **inputs)
    assert torch.equal(y, ref_y) and torch.equal(final, ref_final)


class _RecordingCache(DynamicCache):
    """A DynamicCache that asks the patched mixers for states after ``positions`` tokens of a forward."""

    def __init__(self, config, positions):
        super().__init__(config=config)
        self.positions = positions
        self.captured = {}

    def checkpoint_positions(self, seq_len):
        return self.positions

    def capture_states(self, layer_idx, positions, states):
        self.captured = dict(zip(positions, states))


@pytest.mark.parametrize(
    "family,overrides",
    [(family, {}) for family in MAMBA2_FAMILIES] + [("falcon_h1", {"mamba_rms_norm": True})],
    ids=MAMBA2_FAMILIES + ["falcon_h1-rms-norm"],
)
def test_patched_mixer_is_bit_identical_and_emits_the_cold_states(family, overrides):
    model = build_model(family, **overrides)
    HybridPrefixCache(model)  # patches the mixers of this instance
    mixer = next(m for m in model.modules() if type(m).__name__ == MIXER_CLASS[family])
    original = type(mixer).forward
    kw = cache_parameter(original)  # cache_params in 5.23, cache in 5.24
    hidden = torch.randn(1, 53, model.config.hidden_size, generator=torch.Generator().manual_seed(71))
    positions = (3, 12, 27, 39)
    recording = _RecordingCache(model.config, positions)
    plain = DynamicCache(config=model.config)
    with torch.no_grad():
        for cache in (recording, plain):  # a prefix of 13 tokens first, so the second forward starts from a state
            original(mixer, hidden[:, :13], **{kw: cache})
        out = mixer(hidden[:, 13:], **{kw: recording})
        ref = original(mixer, hidden[:, 13:], **{kw: plain})
    assert torch.equal(out, ref)
    live, ref_layer = recording.layers[mixer.layer_idx], plain.layers[mixer.layer_idx]
    assert torch.equal(live.recurrent_states[0], ref_layer.recurrent_states[0])
    assert torch.equal(live.conv_states[0], ref_layer.conv_states[0])
    assert sorted(recording.captured) == list(positions)
    for t, (conv, ssm) in recording.captured.items():
        cold = DynamicCache(config=model.config)
        with torch.no_grad():
            original(mixer, hidden[:, : 13 + t], **{kw: cold})
        torch.testing.assert_close(conv, cold.layers[mixer.layer_idx].conv_states[0], rtol=0, atol=0)
        torch.testing.assert_close(ssm, cold.layers[mixer.layer_idx].recurrent_states[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_long_memory_init_reaches_every_mixer(family, model):
    mixers = [m for m in model.modules() if type(m).__name__ == MIXER_CLASS[family]]
    assert mixers
    for mixer in mixers:
        assert torch.all(mixer.A_log == -3.0)
        torch.testing.assert_close(F.softplus(mixer.dt_bias), torch.full_like(mixer.dt_bias, 0.2), rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
@pytest.mark.parametrize("block_size", [4, 12, 16, 24], ids=["divides", "smaller-not-dividing", "equal", "larger-not-multiple"])
def test_block_size_against_the_chunk_size(family, block_size):
    """Chunk size 16; checkpoints at every block boundary, restored states and outputs equal a cold run."""
    overrides = {CHUNK_SIZE_KEY[family]: 16}
    model, cold_model = build_model(family, **overrides), build_model(family, **overrides)
    cache = HybridPrefixCache(model, block_size=block_size, retention_interval="dense")
    trunk = random_ids(50, seed=72)
    assert_matches_cold(model, cold_model, cache, torch.cat([trunk, random_ids(9, seed=73)], dim=1), new_tokens=4)
    second = torch.cat([trunk, random_ids(7, seed=74)], dim=1)
    expected_hit = 50 // block_size * block_size
    assert_restored_states_match(cache, cold_model, second, expected_hit)
    assert_matches_cold(model, cold_model, cache, second, new_tokens=4)
    assert cache.last_hit_tokens == [expected_hit]


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_forward_starting_at_an_unaligned_position(family, model, cold_model):
    """Two direct forwards (0-37, 37-90) over the cache: the second starts from a state, off every block and chunk
    boundary, and must still leave exact checkpoints at 48, 64 and 80."""
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(90, seed=75)
    with torch.no_grad():
        model(ids[:, :37], **{CACHE_KWARG: cache}, use_cache=True)
        model(ids[:, 37:], **{CACHE_KWARG: cache}, use_cache=True, position_ids=torch.arange(37, 90)[None])
    second = torch.cat([ids, random_ids(6, seed=76)], dim=1)
    assert_restored_states_match(cache, cold_model, second, 80)
    for boundary in (48, 64):
        assert_restored_states_match(cache, cold_model, second[:, : boundary + 1], boundary)
    assert_matches_cold(model, cold_model, cache, second)
    assert cache.last_hit_tokens == [80]


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_checkpoint_chunk_size_256_runs_in_cpu_chunks_and_matches_cold_runs(family):
    """Checkpoints ship ``chunk_size`` 256; on CPU a float32 prefill over the cache runs the package's scan in chunks
    of at most 64 (8-token prompts of the 130M Mamba-2 shape took 4x less time): a 150-token prompt (three CPU chunks,
    one upstream chunk), its reply and a hit after it equal cold runs at upstream's 256."""
    overrides = {CHUNK_SIZE_KEY[family]: 256}
    model, cold_model = build_model(family, **overrides), build_model(family, **overrides)
    cache = HybridPrefixCache(model)
    trunk = random_ids(150, seed=77)
    assert_matches_cold(model, cold_model, cache, trunk, new_tokens=4)
    second = torch.cat([trunk, random_ids(9, seed=78)], dim=1)
    assert_matches_cold(model, cold_model, cache, second, new_tokens=4)
    assert cache.last_hit_tokens == [144]
