"""Mamba-1 selective scan over a few tokens: a verified draft (the last token and ``k`` drafts) or a short chunk.

:func:`~hf_hybridcache.kernels.selective_scan_chunked` pays a fixed cost per call (token-major copies of its four
inputs, work buffers, three passes and a copy of every emitted state) that a scan of a few tokens does not amortize:
at the toy Jamba's shape (``I = 512``, ``N = 16``) a 5-token verify scan took 200 us against 20-40 us of arithmetic.
:func:`selective_scan_few` runs the recurrence token by token instead, each token the two in-place ops of a decode
step's :func:`~hf_hybridcache.kernels.state_update.selective_state_update_fast` (``h = h * exp(dt A)``, then
``h += (dt x) B``), into one ``[T, B, I, N]`` buffer whose slices are the emitted states (no copies), and contracts
all states with ``C`` in one batched product. A verify step's states are therefore computed by the ops plain decode
steps over the same inputs run (equal up to the last bit a vectorized ``exp`` may round differently at another
memory layout); against the reference (:func:`~hf_hybridcache.kernels.selective_scan_ref`) it agrees within fp32
round-off, as the chunked scan does (tests/test_mamba1_few.py).

Shapes: B batch, I channels (``intermediate_size``), T tokens, N state size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .scan_steps import check_emit_positions, gate, time_steps

#: Tokens up to which :func:`~hf_hybridcache.kernels.selective_scan` takes :func:`selective_scan_few` on CPU in
#: float32 (a verified draft of up to 7 drafts; a longer chunk amortizes the chunked scan's fixed cost).
FEW_SCAN_TOKENS = 8


def selective_scan_few(
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
    """Token-by-token selective scan in the decode step's arithmetic; same arguments, results and errors as
    :func:`~hf_hybridcache.kernels.selective_scan_ref` (``u``, ``delta``, ``z`` ``[B, I, T]``; ``A`` ``[I, N]``;
    ``B``, ``C`` ``[B, N, T]``; ``initial_state`` ``[B, I, N]`` or None for zeros). Returns ``y`` ``[B, I, T]`` in
    ``u``'s dtype, the final state ``[B, I, N]`` float32 (a tensor of its own, which the caller may update in place)
    and the states after each of ``emit_positions`` tokens (contiguous ``[B, I, N]`` float32 views of one buffer that
    nothing else writes)."""
    batch, channels, seq_len = u.shape
    positions = check_emit_positions(emit_positions, seq_len)
    dt = time_steps(delta, delta_bias, delta_softplus).float().permute(2, 0, 1)  # [T, B, I]
    decay = torch.exp(dt.unsqueeze(-1) * A)  # [T, B, I, N]
    dt_x = (dt * u.float().permute(2, 0, 1)).unsqueeze(-1)  # [T, B, I, 1]
    B_t = B.float().permute(2, 0, 1).unsqueeze(2)  # [T, B, 1, N]
    states = torch.empty(seq_len, batch, channels, A.shape[-1], dtype=torch.float32, device=u.device)
    state = initial_state.float() if initial_state is not None else states.new_zeros(states.shape[1:])
    for t in range(seq_len):
        state = torch.mul(state, decay[t], out=states[t])
        state.addcmul_(dt_x[t], B_t[t])
    y = torch.matmul(states, C.float().permute(2, 0, 1).unsqueeze(-1))[..., 0]  # [T, B, I]
    y = y.permute(1, 2, 0).to(u.dtype)
    return gate(y, u, D, z), states[-1].clone(), [states[t - 1] for t in positions]
