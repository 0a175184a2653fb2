"""Mamba-1's selective scan with one arithmetic for a token, however it arrives (issue 46, an ingredient of
deterministic mode; not used by any forward yet).

The package's Mamba-1 paths compute a token three ways: the chunked scan of a float32 prefill
(:func:`~hf_hybridcache.kernels.selective_scan_chunked`, whose sums depend on where the call's chunk grid starts),
transformers' token loop for a bf16 / fp16 prefill (:func:`~hf_hybridcache.kernels.selective_scan_ref`, which rounds
the state to the input dtype before the ``C`` product) and the decode step
(:func:`~hf_hybridcache.kernels.state_update.selective_state_update`, which does not). So the same token's output
moves with the path: by 1.1e-2 in bf16 and 9.5e-7 in float32 between a prefill and a decode step, and by float32
round-off with the offset a prefill starts at (``benchmarks/batch_invariance.py``, table 4). Batch-invariant inference
(Thinking Machines Lab, "Defeating Nondeterminism in LLM Inference", 2025) asks for the same: one reduction order
per output, whatever the batch and the split.

Here a prefill *is* a sequence of decode steps: :func:`selective_scan_invariant` runs :func:`selective_step_invariant`
once per token on contiguous token-major slices, the very call a decode step makes, so a token's output and state are
the same bits whether it came in a prefill (at any offset, in any split of the prompt) or a decode step. Each step is
row-invariant as well, since nothing in it sums across rows or depends on the row count:

- the ``C`` contraction is an elementwise product summed over the ``N`` states (``bmm``'s float32 result for a row
  depends on how many rows share it on this CPU);
- the activations are built from ``exp``, ``log1p`` and IEEE arithmetic (``F.silu`` and ``F.softplus`` give an
  element other bits in the scalar tail of a vectorized loop than in its body, so their results move with the element's
  offset in the tensor, i.e. with the row count; ``exp`` and ``log1p`` agree in both);
- the state is float32 throughout (no rounding to the input dtype); the output is rounded to ``u``'s dtype once.

Cost: one step of a few elementwise ops per token instead of a chunked scan, about the cost of transformers' token
loop (the bf16 prefill path already), several times the chunked float32 scan (table 6 of the benchmark).

Shapes: B rows, I channels (``intermediate_size``), T tokens, N state size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .scan_steps import check_emit_positions

#: ``F.softplus``'s default threshold: above it softplus(x) is x.
SOFTPLUS_THRESHOLD = 20.0


def softplus_invariant(x: torch.Tensor) -> torch.Tensor:
    """``F.softplus(x)`` (beta 1, threshold 20) as ``log1p(exp(x))``, whose bits do not depend on the element's offset
    in the tensor. ``x`` any float dtype and shape; returns the same."""
    return torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x)))


def silu_invariant(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(x)`` as ``x / (1 + exp(-x))``, whose bits do not depend on the element's offset in the tensor. ``x``
    any float dtype and shape; returns the same."""
    return x / (1 + torch.exp(-x))


def selective_step_invariant(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
) -> torch.Tensor:
    """One token of Mamba-1's selective scan (Gu & Dao, "Mamba", 2023), in place on ``state``:
    ``h = exp(dt A) h + (dt x) B``, ``y = (sum_n h C + D x) * silu(z)``, with ``dt = softplus(dt + dt_bias)``; the same
    arguments as :func:`~hf_hybridcache.kernels.state_update.selective_state_update`, computed in an order that makes
    a row's result independent of the other rows and of how the token arrived.

    Args:
        state: ``[B, I, N]`` float32, updated in place.
        x: the conv output ``[B, I]``; dt: the time steps before ``dt_bias`` and softplus ``[B, I]``; z: the gate
            ``[B, I]`` or None. Any float dtype (one for all three).
        A: ``[I, N]`` float32 (negative); B, C: ``[B, N]``; D, dt_bias: ``[I]`` or None.
        dt_softplus: pass ``dt + dt_bias`` through softplus.

    Returns:
        ``y`` ``[B, I]`` in ``x``'s dtype.

    Raises:
        ValueError: ``state`` is not float32.
    """
    if state.dtype != torch.float32:
        raise ValueError(f"The SSM state must be float32 for the invariant step; got {state.dtype}.")
    dt = dt.contiguous().float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = softplus_invariant(dt)
    xf = x.contiguous().float()
    state.mul_(torch.exp(dt.unsqueeze(-1) * A.float()))
    state.add_((dt * xf).unsqueeze(-1) * B.contiguous().float().unsqueeze(1))
    y = (state * C.contiguous().float().unsqueeze(1)).sum(-1)
    if D is not None:
        y = y + xf * D.float()
    if z is not None:
        y = y * silu_invariant(z.contiguous().float())
    return y.to(x.dtype)


def selective_scan_invariant(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    emit_positions: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Selective scan as one :func:`selective_step_invariant` per token: the same arguments and errors as
    :func:`~hf_hybridcache.kernels.selective_scan`, equal to it within the input dtype's round-off (``y`` in ``u``'s
    dtype, where the reference promotes it with ``D``'s), and equal bit for bit to running the tokens as decode steps,
    one call per token or in any split.

    Args:
        u: inputs ``[B, I, T]``; delta: time steps before bias / softplus ``[B, I, T]``; z: gate ``[B, I, T]`` or
            None; B, C: ``[B, N, T]``; A: ``[I, N]`` float32; D, delta_bias: ``[I]`` or None.
        initial_state: ``[B, I, N]`` (any float dtype; float32 is exact) or None for a zero state.
        emit_positions: strictly increasing token counts in ``[1, T]``; the state after each is returned.

    Returns:
        ``(y [B, I, T] in u's dtype, final state [B, I, N] float32, [state [B, I, N] float32 per emit position])``;
        the emitted states are new tensors.

    Raises:
        ValueError: ``emit_positions`` out of range or not strictly increasing.
    """
    batch, channels, seq_len = u.shape
    emit = set(check_emit_positions(emit_positions, seq_len))
    if initial_state is None:
        state = torch.zeros(batch, channels, A.shape[-1], dtype=torch.float32, device=u.device)
    else:
        state = initial_state.float().clone()
    # Token-major copies, so each step reads contiguous [B, I] / [B, N] slices, as a decode step does.
    u_t, dt_t = u.permute(2, 0, 1).contiguous(), delta.permute(2, 0, 1).contiguous()
    z_t = None if z is None else z.permute(2, 0, 1).contiguous()
    B_t, C_t = B.permute(2, 0, 1).contiguous(), C.permute(2, 0, 1).contiguous()
    outputs, emitted = [], []
    for t in range(seq_len):
        outputs.append(selective_step_invariant(state, u_t[t], dt_t[t], A, B_t[t], C_t[t], D,
                                                None if z_t is None else z_t[t], delta_bias, delta_softplus))
        if t + 1 in emit:
            emitted.append(state.clone())
    return torch.stack(outputs, dim=-1), state, emitted
