"""The fixed-tile linear of deterministic mode (hf_hybridcache/kernels/batch_invariant.py, issue 46): a row's result is
the same bits whatever rows share the product, where it sits among them and whatever they hold; the probe that makes
the mode fail closed finds no failure here and does find ``F.linear``'s (the power of both: switched off, i.e. with
``F.linear`` in place of the tiled product, the same checks fail in float32 on this CPU)."""

import pytest
import torch
import torch.nn.functional as F

from hf_hybridcache.kernels import batch_invariant as bi

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: [N, K]: the third with odd widths; the last large enough for the oneDNN product in float32 (product_form).
SHAPES = [(512, 128), (1024, 256), (96, 1000), (2048, 256)]
LARGE = (2048, 256)
ROW_COUNTS = [*range(1, 18), 31, 64, 100]


def _setup(shape, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, k = shape
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    x = torch.randn(max(ROW_COUNTS), k, generator=g).to(dtype)
    return x, weight, b


def _variant_rows(linear, x, weight, b) -> list[int]:
    """Row counts at which some row of ``linear(x[:m])`` differs from the same row computed alone."""
    alone = torch.cat([linear(x[i : i + 1], weight, b) for i in range(x.shape[0])])
    return [m for m in ROW_COUNTS if not torch.equal(linear(x[:m], weight, b), alone[:m])]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_is_the_same_bits_at_every_row_count(dtype, shape, bias):
    x, weight, b = _setup(shape, dtype, bias)
    assert _variant_rows(bi.invariant_linear, x, weight, b) == []
    torch.testing.assert_close(bi.invariant_linear(x, weight, b), F.linear(x, weight, b))  # dtype's tolerance


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_is_the_same_bits_wherever_it_sits_and_whatever_its_neighbours(dtype):
    x, weight, b = _setup((512, 128), dtype, True, seed=1)
    alone = bi.invariant_linear(x[:1], weight, b)[0]
    g = torch.Generator().manual_seed(2)
    for num_rows in (2, 4, 7, 8, 13):
        for position in range(num_rows):
            batch = (torch.randn(num_rows, 128, generator=g) * 10).to(dtype)
            batch[position] = x[0]
            assert torch.equal(bi.invariant_linear(batch, weight, b)[position], alone), (num_rows, position)


def test_leading_dims_are_kept():
    x, weight, b = _setup((64, 32), torch.float32, True)
    out = bi.invariant_linear(x[:6].view(2, 3, 32), weight, b)
    assert out.shape == (2, 3, 64)
    assert torch.equal(out.view(6, 64), bi.invariant_linear(x[:6], weight, b))


@pytest.mark.parametrize("shape", [(512, 128), LARGE], ids=str)
def test_power_f_linear_is_not_row_invariant_in_float32_here(shape):
    """What the fixed tile fixes: the same check as above with ``F.linear`` finds rows that differ (measured on this
    project's CPU, torch 2.13 with MKL: 1-3, 5-7 and 9-11 rows), for a weight of either product form."""
    x, weight, b = _setup(shape, torch.float32, False)
    variant = _variant_rows(F.linear, x, weight, b)
    if not variant:
        pytest.skip("F.linear is row-invariant in float32 with this torch build; nothing for the tile to fix here")
    assert 1 not in variant  # every row alone is the reference here, so 1 row trivially agrees
    assert set(variant) & {2, 3, 5}, variant


def test_the_product_is_chosen_by_the_weight_alone():
    """Large float32 CPU weights run oneDNN's product, every other weight ``F.linear``'s; rows play no part."""
    expected_large = "onednn" if bi._onednn_available() else "blas"
    assert bi.product_form(torch.zeros(LARGE)) == expected_large
    assert bi.product_form(torch.zeros(bi.ONEDNN_MIN_ELEMENTS // 256 - 1, 256)) == "blas"
    assert bi.product_form(torch.zeros(LARGE, dtype=torch.bfloat16)) == "blas"
    assert bi.product_form(torch.zeros(LARGE, dtype=torch.float16)) == "blas"
    with bi.mkl_only():  # the benchmark's comparison: the mode as it was before the oneDNN form
        assert bi.product_form(torch.zeros(LARGE)) == "blas"
    assert bi.product_form(torch.zeros(LARGE)) == expected_large


def _onednn_unpadded(x, weight, b):
    return torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), weight, b, "none", [], "")


@pytest.mark.skipif(not bi._onednn_available(), reason="this torch has no oneDNN linear")
def test_power_the_onednn_product_needs_the_row_tile():
    """oneDNN's product run on the rows as they come (no zero rows appended) sums a row alone in another order than
    among others (its matrix-vector kernel at 1 row, measured on this CPU), and the probe refuses it; padded to the
    tile it passes (the tests above)."""
    x, weight, b = _setup(LARGE, torch.float32, True)
    assert bi.product_form(weight) == "onednn"
    assert _variant_rows(_onednn_unpadded, x, weight, b) != []
    assert 1 in bi.row_invariance_failures(weight, b, linear=_onednn_unpadded)
    assert bi.row_invariance_failures(weight, b) == []


def test_under_autograd_the_product_gives_the_same_bits_and_gradients():
    """A forward that records a graph (a model called without ``torch.no_grad()``) gives the bits of an inference one;
    the gradients are ``F.linear``'s within float32 round-off."""
    x, weight, b = _setup(LARGE, torch.float32, True)
    x, weight, b = x[:5], weight.requires_grad_(), b.requires_grad_()
    with torch.no_grad():
        expected = bi.invariant_linear(x, weight, b)
    x = x.clone().requires_grad_()
    out = bi.invariant_linear(x, weight, b)
    assert out.requires_grad and torch.equal(out.detach(), expected)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    got = torch.autograd.grad(out, (x, weight, b), grad)
    want = torch.autograd.grad(F.linear(x, weight, b), (x, weight, b), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.skipif(not bi._onednn_available(), reason="this torch has no oneDNN linear")
def test_the_onednn_product_packs_a_weight_once_and_again_after_a_write():
    """oneDNN's product runs on the weight packed once (``packed_weight``), the same packed tensor on the next call; an
    in-place write to the weight packs it again (its version moved), so the product follows the weight; a freed
    weight's packed copy goes with it."""
    import gc

    x, weight, b = _setup(LARGE, torch.float32, True)
    first = bi.invariant_linear(x[:3], weight, b)
    packed = bi.packed_weight(weight)
    assert bi.packed_weight(weight) is packed and _packed_keys(weight)
    torch.testing.assert_close(first, F.linear(x[:3], weight, b))
    with torch.no_grad():
        weight.mul_(2)
    assert bi.packed_weight(weight) is not packed
    torch.testing.assert_close(bi.invariant_linear(x[:3], weight, b), F.linear(x[:3], weight, b))
    keys = _packed_keys(weight)
    del weight, packed
    gc.collect()
    assert keys and not keys & bi._PACKED.keys()


def _packed_keys(base: torch.Tensor) -> set:
    return {key for key in bi._PACKED if key[0] == id(base)}


@pytest.mark.skipif(not bi._onednn_available(), reason="this torch has no oneDNN linear")
def test_an_experts_slice_is_packed_once_per_expert_and_again_after_a_write():
    """One expert's ``[N, K]`` slice of a ``[E, N, K]`` parameter is a new view at each call: its packed copy is kept
    under the parameter (one per expert, each the product of its own slice) and packed again after a write to the
    parameter."""
    experts = torch.nn.Parameter(torch.randn(3, *LARGE, generator=torch.Generator().manual_seed(5)) / LARGE[1] ** 0.5)
    x = torch.randn(4, LARGE[1], generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        packed = [bi.packed_weight(experts[e]) for e in range(3)]
        assert all(bi.packed_weight(experts[e]) is packed[e] for e in range(3))
        assert len(_packed_keys(experts)) == 3
        for e in range(3):
            torch.testing.assert_close(bi.invariant_linear(x, experts[e]), F.linear(x, experts[e]))
        experts.mul_(2)
        assert bi.packed_weight(experts[1]) is not packed[1]
        torch.testing.assert_close(bi.invariant_linear(x, experts[1]), F.linear(x, experts[1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_probe_passes_here_and_is_cached(dtype, monkeypatch):
    _, weight, b = _setup((256, 64), dtype, True)
    assert bi.row_invariance_failures(weight, b) == []
    bi.check_row_invariance(weight, b)
    monkeypatch.setattr(bi, "row_invariance_failures", lambda *a, **k: pytest.fail("probed twice"))
    bi.check_row_invariance(weight, b)


def test_power_the_probe_fails_closed_on_a_row_variant_product(monkeypatch):
    """The probe finds ``F.linear``'s float32 differences, and :func:`check_row_invariance` refuses such a weight."""
    _, weight, _ = _setup((512, 128), torch.float32, False)
    failures = bi.row_invariance_failures(weight, linear=F.linear)
    if not failures:
        pytest.skip("F.linear is row-invariant in float32 with this torch build; nothing for the probe to find")
    assert set(failures) <= set(range(1, 13)) | set(bi.PROBE_ROWS)
    monkeypatch.setattr(bi, "row_invariance_failures", lambda w, b=None: failures)
    with pytest.raises(RuntimeError, match=r"\[512, 128\] torch.float32 weight on cpu .* not row-invariant"):
        bi.check_row_invariance(torch.zeros(512, 128), torch.zeros(512))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_thread_probe_passes_here_and_fails_closed_on_a_thread_variant_product(dtype, monkeypatch):
    """A small product gives the same bits on one thread and on two here; a product that does not is refused."""
    torch.set_num_threads(2)  # the suite runs on one; restored by conftest's fixture
    _, weight, b = _setup((256, 64), dtype, True)
    bi.check_thread_invariance(weight, b)
    monkeypatch.setattr(bi, "_THREAD_CHECKED", set())
    monkeypatch.setattr(bi, "invariant_linear", lambda x, w, bias=None: torch.full(
        (x.shape[0], w.shape[0]), float(torch.get_num_threads()), dtype=w.dtype))
    with pytest.raises(RuntimeError, match=r"differently on 1 thread than on 2"):
        bi.check_thread_invariance(weight, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_transposed_view_gives_the_rows_of_its_contiguous_copy(dtype):
    """A mixer's ``x.transpose(1, 2)`` of one row reshapes to a column-major view ``[T, K]``; its product must be the
    bits of the same rows stored contiguously (float16 on this CPU took another kernel for it: 4 rows of a
    ``[64, 128]`` weight differed before the rows were made contiguous)."""
    _, weight, b = _setup((64, 128), dtype, False)
    view = torch.randn(128, 4, generator=torch.Generator().manual_seed(3)).to(dtype).t()
    assert not view.is_contiguous()
    assert torch.equal(bi.invariant_linear(view, weight, b), bi.invariant_linear(view.contiguous(), weight, b))


#: Half-precision weights small enough that torch's CPU matmul sums a product of few rows with its naive kernel.
SMALL_HALF = [(16, 64), (1, 128), (8, 20), (48, 16)]


@pytest.mark.parametrize("shape", SMALL_HALF, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_small_half_precision_product_is_row_invariant_on_the_cancellation_probe(dtype, shape):
    """Regression: a ``[16, 64]`` bf16 product summed 1-4 rows with torch's naive kernel and 5 or more with oneDNN's,
    so Qwen3.5's v_proj moved a decode row's value by a bf16 ulp among 9 engine requests against it alone
    (tests/test_deterministic_sampling.py). Random rows did not show it; the cancellation probe does."""
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    x, probe = bi.cancellation_probe(weight, 256)
    full = bi.invariant_linear(x, probe)
    assert [m for m in range(1, 65) if not torch.equal(bi.invariant_linear(x[:m], probe), full[:m])] == []
    assert bi.row_invariance_failures(weight) == []
    assert bi.min_rows(weight) * shape[0] * shape[1] > bi.HALF_NAIVE_PRODUCT


def test_power_the_cancellation_probe_sees_the_naive_bf16_kernel():
    """Without the half-precision floor, F.linear's small bf16 product differs at 1-4 rows for a [16, 64] weight; the
    probe sees it where random rows against a random weight do not."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 64, generator=g).to(torch.bfloat16)
    failures = bi.row_invariance_failures(weight, linear=F.linear)
    assert {1, 2, 3, 4} <= set(failures)
    x = torch.randn(256, 64, generator=g).to(torch.bfloat16)
    full = F.linear(x, weight)
    assert [m for m in (1, 2, 3, 4) if not torch.equal(F.linear(x[:m], weight), full[:m])] == []


def test_the_probe_has_power_in_float32_too():
    """The probe finds MKL's float32 kernels without the tile (1-3 rows here on one thread) and none with it."""
    weight = torch.randn(104, 64, generator=torch.Generator().manual_seed(0))
    assert {1, 2, 3} <= set(bi.row_invariance_failures(weight, linear=F.linear))
    assert bi.row_invariance_failures(weight) == []
