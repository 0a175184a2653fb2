import collections
import os

import pytest
import torch

# Without a GPU the Triton kernel tests run in Triton's interpreter. Triton reads TRITON_INTERPRET when it is first
# imported, and transformers' import of torch._dynamo imports it, so it is set here before anything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import DynamicCache

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache._compat import cache_kwarg
from hf_hybridcache.models.refused import REFUSED
from hf_hybridcache.toy import TINY_CONFIGS, VOCAB_SIZE, build_model

import speculation_runs

NEW_TOKENS = 16

# Tiny models gain nothing from intra-op threads, and on a shared CPU the OpenMP workers' spin-waits make the suite
# several times slower (measured: 14 s single-threaded against 59-380 s with two threads for one family's suite).
torch.set_num_threads(1)
_SUITE_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _process_globals_do_not_leak():
    """Restore the torch process globals a test may change (a benchmark's ``main()`` sets its ``--threads``).

    Bit-equality between a long prefill and a short one holds at one intra-op thread; a thread count leaked by one
    test made a later test in the same worker fail (the conv-window test of five families, depending on xdist's order).
    """
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    yield
    torch.set_num_threads(_SUITE_THREADS)
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)

#: Families with a Mamba-1 mixer, whose multi-token continuation restarts from a zero state in transformers 5.23.
MAMBA1_FAMILIES = ["jamba", "zamba", "mamba", "falcon_mamba"]
#: Families with a Mamba-2 mixer, which continue from the cached state in 5.23 but cannot emit interior states.
MAMBA2_FAMILIES = ["zamba2", "falcon_h1", "bamba", "granitemoehybrid", "nemotron_h", "mamba2"]
#: The pure state-space models: no attention layer, a stored block holds no KV (its checkpoint is the whole state).
PURE_SSM_FAMILIES = ["mamba", "falcon_mamba", "mamba2"]
#: Gated delta net families: upstream mixers run unchanged, the routed kernel hands over the recurrent states.
GDN_FAMILIES = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini"]
#: KDA families (decay per key channel; Ling's bounded gate) with MLA attention layers: keys and values of two widths.
KDA_FAMILIES = ["kimi_linear", "bailing_hybrid"]
#: Short-conv families: a checkpoint is the conv window alone (no recurrent state).
SHORT_CONV_FAMILIES = [f for f in ["lfm2", "lfm2_moe", "lfm3", "inkling_text", "inkling2_text"] if f not in REFUSED]
#: Compressed convolutional attention (ZAYA): a q|k conv window and a one-token delayed value per attention layer.
CCA_FAMILIES = ["zaya"]
LINEAR_FAMILIES = GDN_FAMILIES + KDA_FAMILIES + SHORT_CONV_FAMILIES + CCA_FAMILIES
#: Families with sliding-window attention layers.
SLIDING_FAMILIES = [f for f in ["lfm3", "inkling_text", "inkling2_text", "zaya", "lara_mini"] if f not in REFUSED]
#: Every supported family runs the whole exactness suite (families refused on the installed transformers are left out:
#: their refusal is tested in test_linear_families.py).
FAMILIES = [f for f in MAMBA1_FAMILIES + MAMBA2_FAMILIES + LINEAR_FAMILIES if f not in REFUSED]

#: Inkling 2 Loop (``inkling2_loop_text``, its wrapper ``inkling2_loop``) is new in transformers 5.24: its tiny configs
#: exist where the installed transformers has it, and its tests skip elsewhere with this reason.
NEEDS_INKLING2_LOOP = ("needs transformers >= 5.24 (Inkling 2 Loop is new there): run it with a newer release of the "
                       "tested window (hf_hybridcache/_compat/versions.py), as CI does")
needs_inkling2_loop = pytest.mark.skipif("inkling2_loop_text" not in TINY_CONFIGS, reason=NEEDS_INKLING2_LOOP)


def and_inkling2_loop(families: list[str], loop: str = "inkling2_loop_text") -> list:
    """``families`` and Inkling 2 Loop's ``loop`` family (the text model or its wrapper ``inkling2_loop``), the latter
    skipped with :data:`NEEDS_INKLING2_LOOP` on a transformers without it."""
    return [f for f in families if f != loop] + [pytest.param(loop, marks=needs_inkling2_loop)]


_COLD_MODELS: dict[str, torch.nn.Module] = {}

#: Test modules that go through code that differs between transformers versions: generate()'s cache keyword and
#: loop, each family's modeling code under the patched mixers, the continuous-batching API the engine implements, the
#: adapter API, the version check, the hook points. CI runs the whole suite on the newest release of the tested window
#: (hf_hybridcache/_compat/versions.py) and these (``pytest -m transformers_version``) on each older one too; the
#: others test the store, its policies, kernels, files, the remote tier, the layout and the demo, which read nothing
#: of transformers that differs (their scenarios run on the newest release only). Every test module is in one of the
#: two sets (test_ci_split.py checks it).
VERSION_SPECIFIC_MODULES = {
    "test_batches", "test_continuation", "test_decode_linear", "test_deterministic", "test_deterministic_conv", "test_deterministic_conv2", "test_deterministic_conv3", "test_deterministic_gdn", "test_deterministic_gdn2", "test_deterministic_inkling2", "test_deterministic_kda", "test_deterministic_hybrid", "test_deterministic_inkling_moe", "test_deterministic_linear", "test_deterministic_m2hybrid", "test_deterministic_mamba2", "test_deterministic_sampling", "test_deterministic_serve", "test_deterministic_zaya", "test_fresh_scan", "test_greedy_argmax", "test_devices", "test_engine_faults", "test_engine_families",
    "test_engine_generation_fields", "test_engine_isolation", "test_engine_reentry", "test_engine_scoring",
    "test_drafter_faults", "test_engine_mtp", "test_engine_serving", "test_engine_speculative",
    "test_engine_vision",
    "test_errors", "test_examples", "test_families", "test_generate_features", "test_hit_in_place", "test_hook_points", "test_inference_mode",
    "test_loop_families", "test_post_training",
    "test_kernel_notices", "test_linear_families", "test_mamba2", "test_quickstart", "test_readme",
    "test_reduced_precision", "test_serve", "test_serve_completions", "test_serve_images", "test_serve_speculative",
    "test_serve_startup", "test_serve_text",
    "test_closed_schemas", "test_sliding", "test_speculative", "test_split_kv", "test_structured",
    "test_structured_engine",
    "test_state_update", "test_tool_auto", "test_tool_strict", "test_upstream_mixers", "test_vision", "test_weights",
}
VERSION_INDEPENDENT_MODULES = {
    "test_attention_invariant", "test_batch_invariant", "test_benchmarks", "test_block_pool", "test_ci_split", "test_conv_invariant", "test_kda_invariant", "test_zaya_invariant",
    "test_entry_layout", "test_exactness", "test_explain", "test_mamba1_invariant", "test_mamba2_invariant",
    "test_fuzz", "test_gated_delta", "test_gated_delta_invariant", "test_grouped_query_sdpa", "test_hashing", "test_isolation", "test_kda",
    "test_kernels", "test_mamba1_few", "test_kernels_triton", "test_layout", "test_lm_eval", "test_pages", "test_persistence",
    "test_policy", "test_power", "test_randomized", "test_regressions", "test_remote", "test_remote_trust",
    "test_remote_units", "test_retry_budget", "test_scale_out", "test_serve_lifecycle", "test_sizing", "test_space",
    "test_threads", "test_tier_failover", "test_version_window", "test_vs_llama_cpp", "test_weights_identity",
    "test_weights_in_flight",
}


#: Families new in a transformers release after the oldest supported one: where the installed transformers lacks one,
#: it has no tiny config, and every test of it (whatever list parametrizes it) skips with this reason.
NEEDS_NEWER_TRANSFORMERS = {
    "lara_mini": "needs transformers >= 5.24 (Lara Mini is new there): run it with a newer release of the tested "
                 "window (hf_hybridcache/_compat/versions.py), as CI does",
    "inkling2_loop_text": "needs transformers >= 5.24 (Inkling 2 Loop is new there): run it with a newer release of "
                          "the tested window (hf_hybridcache/_compat/versions.py), as CI does",
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "needs_attention_layers: a test of stored KV, not collected for PURE_SSM_FAMILIES (they store none)"
    )
    config.addinivalue_line(
        "markers", "plain_only(reason): a test of speculation_runs.SPECULATION_MODULES that runs without speculation "
        "only (bf16, or it never reaches the engine): the reason says which"
    )


def pytest_generate_tests(metafunc):
    speculation_runs.parametrize(metafunc)


@pytest.fixture(scope="module")
def speculation(request):
    """``plain`` or ``spec``: the run of an engine or server exactness test (tests/speculation_runs.py); with ``spec``
    managers and servers speculate by default. Module-scoped fixtures that build a manager or a server ask for it."""
    run = getattr(request, "param", "plain")
    if run == "plain":
        yield run
        return
    with pytest.MonkeyPatch.context() as monkeypatch:
        speculation_runs.switch_on(monkeypatch)
        yield run


@pytest.fixture(autouse=True)
def _speculation_counted(request, speculation):
    """Puts a ``spec`` test's verify steps, drafted and kept tokens into its report (the run's summary adds them)."""
    before = speculation_runs.counted()
    yield
    if speculation == "spec":
        counts = tuple(after - b for after, b in zip(speculation_runs.counted(), before))
        request.node.user_properties.append(("speculation", counts))


def pytest_runtest_logreport(report):
    speculation_runs.SUMMARY.add(report)


def pytest_sessionfinish(session, exitstatus):
    """A run whose speculation runs kept no draft, or every one, fails (both paths must have run)."""
    if speculation_runs.SUMMARY.problem() and not hasattr(session.config, "workerinput"):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config, items):
    """Mark the tests of :data:`VERSION_SPECIFIC_MODULES` ``transformers_version``; skip the tests of a family of
    :data:`NEEDS_NEWER_TRANSFORMERS` that the installed transformers lacks; leave out the ``needs_attention_layers``
    tests of the families without attention layers, and the speculation runs of the families a module does not run
    with speculation (tests/speculation_runs.py's ``SPEC_FAMILIES``, empty today)."""
    kept, left_out = [], []
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in VERSION_SPECIFIC_MODULES:
            item.add_marker(pytest.mark.transformers_version)
        family = getattr(item, "callspec", None) and item.callspec.params.get("family")
        if family in NEEDS_NEWER_TRANSFORMERS and family not in TINY_CONFIGS:
            item.add_marker(pytest.mark.skip(reason=NEEDS_NEWER_TRANSFORMERS[family]))
        no_kv = family in PURE_SSM_FAMILIES and item.get_closest_marker("needs_attention_layers") is not None
        (left_out if no_kv or speculation_runs.left_out(item) else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept

#: Every skip reason says what it needs and how to provide it; the run's summary line counts skips per reason.
NEEDS_CUDA = "needs a CUDA device: run the suite on a machine with one"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line at the end of the run that counts the skipped tests by reason (each reason says how to run them), and
    the speculation runs' counts (tests/speculation_runs.py)."""
    for line in speculation_runs.SUMMARY.lines():
        terminalreporter.write_line(line)
    problem = speculation_runs.SUMMARY.problem()
    if problem:
        terminalreporter.write_line(f"FAILED {problem}", red=True)
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = collections.Counter(_skip_reason(report) for report in skipped)
    counted = "; ".join(f"{count} x {reason}" for reason, count in reasons.most_common())
    terminalreporter.write_line(f"{len(skipped)} skipped, by reason: {counted}")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.fixture(scope="module")
def server():
    """A redis-server on a free loopback port for one test module (the remote tier's tests; skipped, or failed in CI,
    without ``redis-server``)."""
    from redis_server import RedisServer, require_redis

    require_redis()
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def cold_model(family):
    """An unpatched model (long-memory init): the reference every cached run is compared with."""
    if family not in _COLD_MODELS:
        _COLD_MODELS[family] = build_model(family, seed=0)
    return _COLD_MODELS[family]


@pytest.fixture
def model(family):
    """A fresh model with the same weights as ``cold_model``, to be patched by a cache."""
    return build_model(family, seed=0)


def random_ids(length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, VOCAB_SIZE, (1, length), generator=g)


def greedy(model, ids, cache=None, new_tokens=NEW_TOKENS, **kwargs):
    """Greedy generation returning (sequences, first-step logits [B, V])."""
    kw = {} if cache is None else {CACHE_KWARG: cache}
    out = model.generate(
        ids,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kw,
        **kwargs,
    )
    return out.sequences, out.logits[0]


def assert_matches_cold(model, cold_model, cache, ids, new_tokens=NEW_TOKENS, **kwargs):
    """Generate with the cache and without it; tokens must be identical and first-step logits within 1e-4."""
    seq, logits = greedy(model, ids, cache, new_tokens, **kwargs)
    ref_seq, ref_logits = greedy(cold_model, ids, None, new_tokens, **kwargs)
    assert torch.equal(seq, ref_seq), f"tokens differ from the cold run (hit {cache.last_hit_tokens})"
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    return seq


def cold_states(cold_model, ids, upto: int):
    """Conv/SSM states and KV of a cold forward over ids[:, :upto]: {layer_idx: tensors}."""
    cache = DynamicCache(config=cold_model.config)
    with torch.no_grad():
        cold_model(ids[:, :upto], **{cache_kwarg(cold_model): cache}, use_cache=True)
    return cache


#: Families whose restored KV differs from a cold run at P by more than 1e-5 through upstream's own round-off: the
#: unpatched Inkling 2 forwards over 16 and over 17 tokens give values 1.2e-5 apart at layer 3 (a stored block comes
#: from the longer forward, bit for bit). Inkling 2 Loop's ten layer passes add up more: its unpatched forwards over
#: 288 and over 320 tokens give values 2.3e-5 apart at layer 5, and a restore at 288 differed by 5.4e-5.
KV_ATOL = {"inkling2_text": 5e-5, "inkling2_loop_text": 1e-4}
#: Families whose restored conv windows differ from a cold run at P by more than 1e-5 through upstream's own round-off:
#: Inkling 2 Loop's post-attention windows, ten layer passes deep, were 1.3e-5 apart on values near 1.7 (7.8e-6
#: relative) when the stored window came from a 96-token forward and the cold one from a 64-token forward.
#: Inkling 2's windows stored in deterministic mode (whose forms round otherwise than upstream's) were 1.7e-5 apart from
#: an unpatched cold forward's on values near 0.2 at layer 3.
CONV_ATOL = {"inkling2_text": 5e-5, "inkling2_loop_text": 5e-5}


def assert_restored_states_match(cache: HybridPrefixCache, cold_model, ids, expected_hit: int):
    """Run the cache's own lookup + restore for ids and compare the live layers with a cold run at P."""
    kv_atol = KV_ATOL.get(cold_model.config.model_type, 1e-5)
    conv_atol = CONV_ATOL.get(cold_model.config.model_type, 1e-5)
    cache.restore(ids)
    try:
        assert cache.last_hit_tokens == [expected_hit]
        ref = cold_states(cold_model, ids, expected_hit)
        for m in cache.spec.mamba:
            live, cold = cache.layers[m.layer_idx], ref.layers[m.layer_idx]
            i = m.state_idx
            torch.testing.assert_close(live.conv_states[i], cold.conv_states[i], rtol=0, atol=conv_atol)
            if hasattr(cold, "cumulative_length_linear"):  # transformers 5.25: a linear layer counts its tokens
                assert int(live.cumulative_length_linear) == int(cold.cumulative_length_linear) == expected_hit
            if cold.recurrent_states[i] is None:  # a short conv keeps no recurrent state
                assert live.recurrent_states[i] is None
                continue
            torch.testing.assert_close(live.recurrent_states[i], cold.recurrent_states[i], rtol=0, atol=1e-5)
            assert live.recurrent_states[i].dtype == cold.recurrent_states[i].dtype
        for a in cache.spec.attention:
            live, cold = cache.layers[a.layer_idx], ref.layers[a.layer_idx]
            torch.testing.assert_close(live.keys, cold.keys, rtol=0, atol=kv_atol)
            torch.testing.assert_close(live.values, cold.values, rtol=0, atol=kv_atol)
            assert live.get_seq_length() == cold.get_seq_length() == expected_hit  # a sliding layer counts them all
    finally:
        cache.reset()
