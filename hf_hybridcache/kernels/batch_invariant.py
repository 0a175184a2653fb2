"""A linear layer whose result for a row does not depend on how many rows share the product (issue 46, the first
ingredient of deterministic mode).

A matrix product's library picks its kernel, and with it the order in which each output's ``K`` terms are summed,
from the shape of the call. On this project's CPU (torch 2.13, MKL) ``F.linear`` in float32 sums a row one way at
1-3, 5-7 and 9-11 rows (a matrix-vector kernel at 1 row, edge kernels below 12) and another way at 4, 8 and 12 or more
rows, so a request's logits move by float32 round-off with the number of requests in its decode step
(``benchmarks/batch_invariance.py`` prints the table; bf16 and fp16 went through one kernel at every row count
measured). Batch-invariant inference (Thinking Machines Lab, "Defeating Nondeterminism in LLM Inference", 2025;
their ``batch_invariant_ops``, the kernels behind vLLM's and SGLang's batch-invariant modes) fixes the reduction order
by fixing the kernel's tile shape. Here the same idea is reached from above with the libraries' own kernels: every
call gets a row count that is a multiple of :data:`ROW_TILE` (zero rows appended), a count at which every row is
summed in one order, by one of two products chosen per weight (:func:`product_form`, never per call):

- ``"onednn"``: oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, the op torch's own compiler emits for a CPU
  linear) for float32 CPU weights of at least :data:`ONEDNN_MIN_ELEMENTS` elements, on the weight packed once in
  oneDNN's blocked layout (:func:`packed_weight`; on the plain weight it reorders it on every call, about half a
  decode step's product time). Measured on this CPU it sums a row one way at every row count from 2 to 1024 and on
  one thread as on two (1 row alone is a matrix-vector kernel, hence the tile), packed or not, and packed it reads a
  weight at 4 rows in about the time of the default's 1-row matrix-vector read;
- ``"blas"``: ``F.linear`` (MKL in float32, oneDNN in bf16 / fp16) for every other weight: a small float32 weight
  (below the threshold oneDNN's per-call set-up costs more than it saves), any bf16 / fp16 one, a torch without
  oneDNN.

Whether a product really is row-invariant for a weight is measured, not assumed: :func:`check_row_invariance` runs
it at :data:`PROBE_ROWS` rows and raises where any row differs, so a mode built on this fails closed on another BLAS,
another torch or another device instead of silently losing its guarantee.

Cost on the 2-core CPU against plain ``F.linear`` (``benchmarks/batch_invariance.py``, table 5; a ``[4096, 1024]``
weight): float32 2.0x at 1 row (the 4-row product against MKL's matrix-vector one; MKL's 4-row product was 3.0x),
0.42x at 8 rows and 0.40x at 64 (on the plain weight, before :func:`packed_weight`; packed, the 4-row product of the
100M Qwen3.5 shape's weights took 0.55-0.98x the 1-row ``F.linear`` on one thread in one run); a small float32
weight's single row pays MKL's 4-row product; bf16 within noise.

Shapes: ``x`` ``[..., K]`` (M rows in all), ``weight`` ``[N, K]``, ``bias`` ``[N]``; any float dtype and device that
``F.linear`` takes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F

#: Rows of every product :func:`invariant_linear` runs are a multiple of this. 4 is the smallest count at which MKL's
#: float32 product summed every row as it does at 64 rows (measured: 1-3, 5-7 and 9-11 rows differ, every multiple
#: of 4 agrees), and a 4-row product costs less than an 8-row one at decode sizes.
ROW_TILE = 4
#: A bfloat16 / float16 product of at most this many multiply-adds (``M * N * K``) is summed by another kernel than a
#: larger one: torch's CPU ``mkldnn_bf16_gemm`` / ``mkldnn_fp16_gemm`` (``aten/src/ATen/native/mkldnn/Matmul.cpp``)
#: decline a product they judge small, and a naive gemm sums it in another order. Measured on this CPU with torch 2.13
#: (:func:`cancellation_probe`): a ``[16, 64]`` bf16 weight sums a row one way at 1-4
#: rows and another at 5 or more, a ``[1, 128]`` one at 1-32 rows and 33 or more, the boundary at ``16 ** 3`` in every
#: shape tried. So a half-precision product gets at least :func:`min_rows` rows.
HALF_NAIVE_PRODUCT = 16**3
#: Float32 CPU weights of at least this many elements (2 MiB) run oneDNN's product (:func:`product_form`); below it,
#: measured on this CPU, oneDNN's per-call set-up (~0.03 ms) outweighs the faster read.
ONEDNN_MIN_ELEMENTS = 1 << 19
#: Row counts :func:`check_row_invariance` compares (each a multiple of :data:`ROW_TILE`): a decode step of one to a
#: few requests, odd tile counts, and prefill-chunk sizes.
PROBE_ROWS = (4, 8, 12, 16, 28, 64, 256)


def _onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


_ONEDNN = _onednn_available()


def product_form(weight: torch.Tensor) -> str:
    """The product :func:`invariant_linear` runs for ``weight`` ``[N, K]``: ``"onednn"`` for a float32 CPU weight of at
    least :data:`ONEDNN_MIN_ELEMENTS` elements where this torch has oneDNN's linear, else ``"blas"`` (``F.linear``).
    A function of the weight alone, so every call on it, at any row count, runs one product."""
    if (_ONEDNN and weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.numel() >= ONEDNN_MIN_ELEMENTS):
        return "onednn"
    return "blas"


def min_rows(weight: torch.Tensor) -> int:
    """The fewest rows :func:`invariant_linear` runs ``weight`` ``[N, K]`` at: :data:`ROW_TILE`, or for a bfloat16 /
    float16 weight the smallest multiple of it past :data:`HALF_NAIVE_PRODUCT` multiply-adds."""
    if weight.dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 2:
        return ROW_TILE
    rows = HALF_NAIVE_PRODUCT // max(weight.shape[0] * weight.shape[1], 1) + 1
    return max(ROW_TILE, -(-rows // ROW_TILE) * ROW_TILE)


@contextlib.contextmanager
def mkl_only() -> Iterator[None]:
    """Inside, every weight's form is ``"blas"`` (the mode's products before the oneDNN form): for
    ``benchmarks/deterministic_cost.py``'s comparison only. A large float32 weight's rows get other bits inside than
    outside, so never serve a request across its edge."""
    global _ONEDNN
    saved, _ONEDNN = _ONEDNN, False
    try:
        yield
    finally:
        _ONEDNN = saved


class _OneDnnLinear(torch.autograd.Function):
    """oneDNN's linear (which has no autograd formula of its own) with the plain products as its backward, so a forward
    under autograd gives the bits of one without it."""

    @staticmethod
    def forward(ctx, rows, weight, bias):
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(rows, packed_weight(weight), bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ rows, grad.sum(0) if ctx.has_bias else None


#: (``id`` of the weight's base tensor, the weight's data pointer, shape and strides) -> (a weak reference to the base,
#: the version counter when packed, the packed weight): :func:`packed_weight`'s store, an entry dropped when its base is
#: freed. A view (one expert's ``gate_up_proj[e]``, a new tensor at each call) is keyed by its base and place in it.
_PACKED: dict[tuple, tuple[weakref.ref, int, torch.Tensor]] = {}


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` (float32, CPU) in oneDNN's blocked layout for a :data:`ROW_TILE`-row product
    (``torch.ops.mkldnn._reorder_linear_weight``, what torch's compiler does to a frozen linear's weight), packed once
    and kept while ``weight`` (for a view such as one expert's slice of a ``[E, N, K]`` parameter, its base) lives and
    is unchanged (an in-place write bumps the version counter a view shares with its base and packs it again; another
    data pointer, shape or stride is another entry). A product on the plain weight reorders it on every call: measured
    on this CPU that doubled a decode step's 4-row products (``[2048, 768]`` 0.25 ms against 0.10 ms packed, the
    ``[32768, 768]`` LM head 11.5 ms against 6.1, about the 1-row matrix-vector read). The cost is memory: a second
    copy of every float32 weight of :data:`ONEDNN_MIN_ELEMENTS` elements or more. Row-invariance is probed on the
    packed product like any other (:func:`check_row_invariance`, :func:`check_thread_invariance`)."""
    base = weight if weight._base is None else weight._base
    key = (id(base), weight.data_ptr(), tuple(weight.shape), weight.stride())
    entry = _PACKED.get(key)
    if entry is not None and entry[0]() is base and entry[1] == weight._version:
        return entry[2]
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROW_TILE)
    if entry is None or entry[0]() is not base:
        weakref.finalize(base, _PACKED.pop, key, None)
    _PACKED[key] = (weakref.ref(base), weight._version, packed)
    return packed


def _onednn_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (rows, weight, bias)):
        return _OneDnnLinear.apply(rows, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(rows, packed_weight(weight), bias, "none", [], "")


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` run on ``x``'s rows padded with zero rows to a multiple of :data:`ROW_TILE` (and
    to at least :func:`min_rows`, so that a small half-precision product never takes the naive kernel), by
    :func:`product_form`'s product for ``weight``, so that a row's result is the same bits whatever other rows share
    the call, wherever :func:`check_row_invariance` passes for ``weight``.

    Args:
        x: ``[..., K]``, the dtype and device of ``weight``.
        weight: ``[N, K]``; bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in ``x``'s dtype, equal to ``F.linear``'s result within its round-off (bitwise where the form is
        ``"blas"`` and ``F.linear`` already runs a multiple of :data:`ROW_TILE` rows).

    Raises:
        RuntimeError: as ``F.linear`` does for mismatched shapes, dtypes or devices.
    """
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # a column-major view took another kernel in float16 here
    num_rows = rows.shape[0]
    pad_rows = max(-num_rows % ROW_TILE, min_rows(weight) - num_rows)
    if pad_rows:
        rows = torch.cat([rows, rows.new_zeros(pad_rows, rows.shape[1])])
    if (product_form(weight) == "onednn" and rows.dtype == weight.dtype and rows.device == weight.device
            and rows.shape[1] == weight.shape[1] and (bias is None or bias.dtype == weight.dtype)):
        out = _onednn_linear(rows, weight, bias)
    else:  # F.linear also raises the documented errors for mismatched inputs
        out = F.linear(rows, weight, bias)
    if pad_rows:
        out = out[:num_rows]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def cancellation_probe(weight: torch.Tensor, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[rows, K]`` and a weight of ``weight``'s shape, dtype, device and strides whose products reveal a
    change of summation order in any dtype: each row meets a pair of weight columns ``c, c + 1`` that are negatives of
    each other at ``+-4096``, with ``4096`` in both, so every output sums ``+2**24`` and ``-2**24`` around small
    ``+-1`` terms. The exact sum is small (finite in float16), while a float32 accumulator that adds a ``1`` while
    ``2**24`` is pending loses it, so where the ``1``s fall between the pair in the summation order decides the result.
    Random rows against the model's weight rarely show an order change in bfloat16, whose rounding of the float32
    accumulator hides it (a ``[16, 64]`` bf16 product changed kernels at 5 rows and moved 1 output of 16 on a real
    decode row, 0 of 65,536 random ones)."""
    num_out, depth = weight.shape
    gen = torch.Generator().manual_seed(seed)
    probe = (torch.randint(0, 2, (num_out, depth), generator=gen).float() * 2 - 1)
    pairs = torch.arange(0, depth // 2 - depth // 2 % 2, 2)  # columns (2p, 2p + 1) of the first half
    x = torch.randint(-1, 2, (rows, depth), generator=gen).float()
    if len(pairs):
        signs = torch.randint(0, 2, (num_out, len(pairs)), generator=gen).float() * 2 - 1
        probe[:, pairs], probe[:, pairs + 1] = signs * 4096, -signs * 4096
        x[:, : depth // 2] = 0
        chosen = pairs[torch.randint(0, len(pairs), (rows, 2), generator=gen)]
        x[torch.arange(rows)[:, None], chosen] = 4096.0
        x[torch.arange(rows)[:, None], chosen + 1] = 4096.0
    laid_out = torch.empty_strided(weight.shape, weight.stride(), dtype=weight.dtype, device=weight.device)
    return x.to(weight.dtype).to(weight.device), laid_out.copy_(probe)


def row_invariance_failures(weight: torch.Tensor, bias: torch.Tensor | None = None, linear=None,
                            seed: int = 0) -> list[int]:
    """The row counts of :data:`PROBE_ROWS` (and every count from 1 to ``min_rows(weight) * 3``) at which ``linear``
    gives some row other bits than the same row in a product of ``max(PROBE_ROWS)`` rows, for ``weight`` with random
    rows or for the :func:`cancellation_probe` of its layout; empty where it is row-invariant.

    Args:
        weight: ``[N, K]``; bias: ``[N]`` or None; linear: the product to probe (None: :func:`invariant_linear`;
            ``F.linear`` shows what the library does without the fixed tile); seed: the seed of the random rows
            (drawn in float32 on the CPU, then moved to ``weight``'s dtype and device).

    Returns:
        The failing row counts, ascending.
    """
    linear = invariant_linear if linear is None else linear
    gen = torch.Generator().manual_seed(seed)
    rows = max(PROBE_ROWS)
    random_rows = torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype).to(weight.device)
    cases = [(random_rows, weight), cancellation_probe(weight, rows, seed)]
    counts = sorted(set(PROBE_ROWS) | set(range(1, min_rows(weight) * 3 + 1)))
    failures = set()
    for x, w in cases:
        full = linear(x, w, bias)
        failures.update(m for m in counts if not torch.equal(linear(x[:m], w, bias), full[:m]))
    return sorted(failures)


_CHECKED: set[tuple] = set()


def check_row_invariance(weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Raise unless :func:`invariant_linear` is row-invariant for ``weight`` here (probed once per weight shape,
    dtype, device, bias presence and :func:`product_form` in a process, with :func:`row_invariance_failures`).

    Raises:
        RuntimeError: some row count gave a row other bits; names the shape, dtype, device and counts.
    """
    key = (tuple(weight.shape), weight.dtype, str(weight.device), bias is not None, product_form(weight))
    if key in _CHECKED:
        return
    failures = row_invariance_failures(weight, bias)
    if failures:
        raise RuntimeError(
            f"The linear product ({product_form(weight)!r}) of a {list(weight.shape)} {weight.dtype} weight on "
            f"{weight.device} (torch {torch.__version__}) sums a row differently at {failures} rows than at "
            f"{max(PROBE_ROWS)}: this library's kernels are not row-invariant at a fixed row tile, so deterministic "
            "results cannot be guaranteed here."
        )
    _CHECKED.add(key)


_THREAD_CHECKED: set[tuple] = set()


def check_thread_invariance(weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Raise unless :func:`invariant_linear` gives ``weight``'s product the same bits on one intra-op thread as on
    ``torch.get_num_threads()`` (probed once per weight shape, dtype, device, bias presence, form and thread count, at
    :data:`PROBE_ROWS` rows). A caller that runs a small product on one thread in one path (a decode step) and on all
    of them in another (a prefill) needs it.

    Raises:
        RuntimeError: some row count gave other bits on one thread; names the shape, dtype, device and counts.
    """
    threads = torch.get_num_threads()
    key = (tuple(weight.shape), weight.dtype, str(weight.device), bias is not None, product_form(weight), threads)
    if key in _THREAD_CHECKED or threads == 1:
        return
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(max(PROBE_ROWS), weight.shape[1], generator=gen).to(weight.dtype).to(weight.device)
    cases = [(x, weight), cancellation_probe(weight, max(PROBE_ROWS), seed=1)]
    wide = [{m: invariant_linear(x[:m], w, bias) for m in PROBE_ROWS} for x, w in cases]
    torch.set_num_threads(1)
    try:
        failures = sorted({m for (x, w), outs in zip(cases, wide) for m in PROBE_ROWS
                           if not torch.equal(invariant_linear(x[:m], w, bias), outs[m])})
    finally:
        torch.set_num_threads(threads)
    if failures:
        raise RuntimeError(
            f"The linear product ({product_form(weight)!r}) of a {list(weight.shape)} {weight.dtype} weight on "
            f"{weight.device} (torch {torch.__version__}) sums a row differently on 1 thread than on {threads} at "
            f"{failures} rows, so deterministic results cannot be guaranteed here."
        )
    _THREAD_CHECKED.add(key)
