"""Linear layers at a few tokens on CPU: the weight read at memory bandwidth.

At one to a few rows ``F.linear(x [M, K], weight [N, K])`` is a matrix-vector product whose time is reading the
weight. On CPU, torch 2.13 (MKL) runs it at a third of the machine's bandwidth or less when the weight's rows are
short (``K`` of a few hundred to a few thousand): measured on this project's 2-core CPU, ``[28672, 128]`` (a Jamba
expert's gate and up projections, 14.7 MB) takes 2.3-2.5 ms, a 65,536-token LM head of width 128 5.8 ms. The same
products as one batched matmul over ``GROUPS`` slices of the weight's rows (``torch.bmm``, no copy of the weight)
run at 0.6-0.8 ms and 1.7 ms: ``benchmarks/decode_linear.py`` prints the table. llama.cpp's ``ggml_mul_mat`` reads
such weights at full bandwidth, which is most of its lead on a single stream of a model of ~100M+ parameters (issue
35).

Each output element is the same dot product of ``K`` terms, summed by another kernel: the result equals
``F.linear``'s within float32 round-off, not bit for bit, so the package uses it only in float32 (bf16 replies are
held to stock's decode token for token) and only inside its own forwards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Slices of the weight's rows one batched matmul runs over (2-8 measured alike; 4 at or near the best everywhere).
GROUPS = 4
#: The most rows of ``x`` (tokens in the step) the batched form is used for; above, ``F.linear``'s matrix product.
MAX_ROWS = 8
#: Weights smaller than this many elements (2 MiB in float32) stay on ``F.linear``: at two threads the batched form's
#: thread start-up (~0.1 ms) outweighs what it saves on a smaller read.
MIN_ELEMENTS = 1 << 19


def weight_qualifies(shape: tuple[int, ...]) -> bool:
    """Whether a weight of ``shape`` ``[N, K]`` is read faster by the batched form: at least :data:`MIN_ELEMENTS`
    elements, ``N >= K`` (a weight of long rows, ``K`` far above ``N``, is read at bandwidth by ``F.linear`` already)
    and ``N`` a multiple of :data:`GROUPS`."""
    return len(shape) == 2 and shape[0] * shape[1] >= MIN_ELEMENTS and shape[0] >= shape[1] and shape[0] % GROUPS == 0


def qualifies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`decode_linear` runs the batched form for ``x`` ``[..., K]`` and ``weight`` ``[N, K]``: float32 CPU
    tensors, at most :data:`MAX_ROWS` rows, a contiguous weight of a shape :func:`weight_qualifies` takes."""
    return (
        x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
        and weight.device.type == "cpu" and weight.is_contiguous() and x.numel() <= MAX_ROWS * x.shape[-1]
        and weight_qualifies(tuple(weight.shape))
    )


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x`` ``[..., K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]``; returns
    ``[..., N]``, float32), as a batched matmul over :data:`GROUPS` slices of ``weight``'s rows where
    :func:`qualifies` says so, else ``F.linear`` itself."""
    if not qualifies(x, weight):
        return F.linear(x, weight, bias)
    n, k = weight.shape
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    # [G, N/G, K] @ [G, K, M] -> [G, N/G, M] -> [M, N]
    out = torch.bmm(weight.view(GROUPS, n // GROUPS, k), rows.t().unsqueeze(0).expand(GROUPS, k, m))
    out = out.permute(2, 0, 1).reshape(m, n)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


def decode_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: ``F.linear`` (what :func:`decode_linear` must equal within float32 round-off)."""
    return F.linear(x, weight, bias)
