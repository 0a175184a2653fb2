"""Decode steps' linear layers and experts as batched matmuls (hf_hybridcache/kernels/decode_linear.py,
hf_hybridcache/models/decode_linear.py): the kernel against ``F.linear``, the routing (inside the package's float32
CPU decode forwards only), the experts' decode loop against transformers' own forward, and a Jamba whose MLP and
experts are wide enough to be routed decoding with the cache (generate and the engine) as a cold run does.

Power (each checked by hand when this test was written): grouping the weight's rows in another order than the output
(``permute(2, 1, 0)``) fails the kernel, routing and exactness tests; an experts loop that skips the routing weights
fails the experts test and the generate / engine ones; a one-token loop that keeps only the last expert fails the
one-token test; routing outside the package's forwards fails
``test_outside_the_package_forward_nothing_changes``."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import random_ids
from engine_scenarios import alone, config

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache, _compat
from hf_hybridcache.kernels import decode_linear as kernel
from hf_hybridcache.models import decode_linear
from hf_hybridcache.toy import build_model

FP32 = {"rtol": 1e-5, "atol": 1e-5}
# A Jamba whose dense MLP ([8192, 64]: 2 MiB) and experts' gate and up projections ([16384, 64]) are routed.
WIDE = dict(intermediate_size=8192, num_experts=2, num_experts_per_tok=1)


@pytest.mark.parametrize("shape", [(1, 128), (3, 128), (8, 64), (1, 1, 256), (2, 1, 128)], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_batched_form_equals_f_linear(shape, bias):
    g = torch.Generator().manual_seed(sum(shape))
    k = shape[-1]
    weight = torch.randn(8192, k, generator=g)
    b = torch.randn(8192, generator=g) if bias else None
    x = torch.randn(*shape, generator=g)
    assert kernel.qualifies(x, weight)
    out = kernel.decode_linear(x, weight, b)
    assert out.shape == (*shape[:-1], 8192)
    torch.testing.assert_close(out, kernel.decode_linear_ref(x, weight, b), **FP32)


@pytest.mark.parametrize("case", ["rows", "bf16", "small", "long-rows", "strided"])
def test_what_does_not_qualify_runs_f_linear_itself(case):
    g = torch.Generator().manual_seed(7)
    x, weight = torch.randn(1, 128, generator=g), torch.randn(8192, 128, generator=g)
    if case == "rows":
        x = torch.randn(kernel.MAX_ROWS + 1, 128, generator=g)
    elif case == "bf16":
        x, weight = x.bfloat16(), weight.bfloat16()
    elif case == "small":
        weight = weight[:1024].clone()
    elif case == "long-rows":
        x, weight = torch.randn(1, 8192, generator=g), weight.t().contiguous()
    else:
        weight = torch.randn(128, 8192, generator=g).t()
    assert not kernel.qualifies(x, weight)
    assert torch.equal(kernel.decode_linear(x, weight), F.linear(x, weight))


@pytest.fixture(scope="module")
def wide():
    """(model with its cache built, an unpatched copy of the same weights)."""
    model = build_model("jamba", **WIDE)
    stock = copy.deepcopy(model)
    HybridPrefixCache(model)
    return model, stock


def _routed(model) -> list[str]:
    return [name for name, module in model.named_modules()
            if getattr(module, "_hf_hybridcache_forward_impl", None) in (decode_linear._linear_forward,
                                                                       decode_linear._experts_forward)]


def test_the_wide_layers_are_routed_and_the_small_ones_are_not(wide):
    model, _ = wide
    routed = _routed(model)
    assert sorted(name.split(".")[-1] for name in routed) == ["experts", "experts", "gate_proj", "gate_proj",
                                                             "up_proj", "up_proj"]
    assert decode_linear.install(model) == 0  # idempotent
    assert _routed(build_model("jamba")) == []  # nothing built from the toy config is routed
    assert _routed(copy.deepcopy(model)) == routed


def test_outside_the_package_forward_nothing_changes(wide):
    model, stock = wide
    ids = random_ids(1, seed=3)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, stock(ids).logits)


def test_the_experts_decode_loop_equals_transformers_forward(wide):
    model, _ = wide
    experts = [m for m in model.modules() if type(m).__name__ == "JambaExperts"][0]
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 64, generator=g)
    index = torch.tensor([[1], [0], [1]])
    weights = torch.rand(3, 1, generator=g)
    with torch.no_grad():
        expected = experts._hf_hybridcache_original_forward(hidden, index, weights)
        with _compat.package_forward():
            routed = experts(hidden, index, weights)
    torch.testing.assert_close(routed, expected, **FP32)
    assert not torch.equal(routed, torch.zeros_like(routed))


def test_one_tokens_experts_equal_transformers_forward(wide):
    """The one-token path (no mask, no index_add_): every expert of the top-k, in ascending order, weighted."""
    model, _ = wide
    experts = [m for m in model.modules() if type(m).__name__ == "JambaExperts"][0]
    hidden = torch.randn(1, 64, generator=torch.Generator().manual_seed(6))
    for index, weights in (([[1, 0]], [[0.7, 0.2]]), ([[0, 1]], [[0.4, 0.9]]), ([[1]], [[1.3]])):
        index, weights = torch.tensor(index), torch.tensor(weights)
        with torch.no_grad():
            expected = experts._hf_hybridcache_original_forward(hidden, index, weights)
            with _compat.package_forward():
                routed = experts(hidden, index, weights)
        torch.testing.assert_close(routed, expected, **FP32)


def _counting(monkeypatch):
    calls = []
    original = decode_linear.decode_linear

    def counted(x, weight, bias=None):
        calls.append(kernel.qualifies(x, weight))
        return original(x, weight, bias)

    monkeypatch.setattr(decode_linear, "decode_linear", counted)
    return calls


def test_generate_with_the_cache_runs_the_batched_form_and_equals_stock(wide, monkeypatch):
    model, stock = wide
    calls = _counting(monkeypatch)
    ids = random_ids(40, seed=11)
    kwargs = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = stock.generate(ids, **kwargs)
        assert calls == []
        out = model.generate(ids, **kwargs, **{CACHE_KWARG: HybridPrefixCache(model)})
    assert sum(calls) >= 11 * 4  # every decode step: two MLPs' gate and up, two experts' gate_up
    assert torch.equal(out.sequences, expected.sequences)
    for ours, theirs in zip(out.scores, expected.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_the_engine_decodes_as_cold_runs(wide, monkeypatch):
    model, stock = wide
    calls = _counting(monkeypatch)
    prompts = [random_ids(n, seed=20 + n)[0].tolist() for n in (9, 23, 40)]
    cache = HybridPrefixCache(model)  # noqa: F841 (kept alive: the engine is the cache's)
    outputs = model.generate_batch(prompts, generation_config=config(max_new_tokens=8))
    for i, prompt in enumerate(prompts):
        assert outputs[f"req_{i}"].generated_tokens == alone(stock, prompt, 8)
    assert sum(calls) > 0


def test_bf16_decodes_through_transformers_own_linears(monkeypatch):
    model = build_model("jamba", dtype=torch.bfloat16, **WIDE)
    calls = _counting(monkeypatch)
    with torch.no_grad():
        model.generate(random_ids(20, seed=2), max_new_tokens=4, do_sample=False,
                       **{CACHE_KWARG: HybridPrefixCache(model)})
    assert len(_routed(model)) == 6 and calls == []  # routed, and each call went to transformers' forward


def test_the_benchmark_runs(capsys):
    from benchmarks import decode_linear as bench

    rows = bench.main(["--threads", "1", "--rows", "1", "--repeats", "1", "--megabytes", "1"])
    assert len(rows) == len(bench.SHAPES) and all(r["linear_ms"] > 0 and r["batched_ms"] > 0 for r in rows)
    assert [r["routed"] for r in rows][:3] == [True, False, True]
    assert "speed-up" in capsys.readouterr().out


def test_engine_decode_steps_run_small_ops_on_one_thread_and_wide_reads_on_all(wide, monkeypatch):
    """decode_threads: inside an engine decode step the mixers see one intra-op thread, the wide weights' reads all of
    them, and the count is given back after the step."""
    model, stock = wide
    seen = {"small": set(), "wide": set()}
    original = decode_linear.decode_linear

    def counted(x, weight, bias=None):
        seen["wide"].add(torch.get_num_threads())
        return original(x, weight, bias)

    monkeypatch.setattr(decode_linear, "decode_linear", counted)
    mixer = [m for m in model.modules() if type(m).__name__ == "JambaMambaMixer"][0]
    hook = mixer.register_forward_pre_hook(
        lambda module, args, kwargs: seen["small"].add((args or (kwargs["hidden_states"],))[0].shape[1] == 1
                                                       and torch.get_num_threads()), with_kwargs=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cache = HybridPrefixCache(model)  # noqa: F841 (kept alive: the engine is the cache's)
        prompt = random_ids(30, seed=41)[0].tolist()
        out = model.generate_batch([prompt], generation_config=config(max_new_tokens=5))["req_0"]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
        hook.remove()
    assert out.generated_tokens == alone(stock, prompt, 5)
    assert seen["wide"] == {2} and 1 in seen["small"] and 2 not in seen["small"]
