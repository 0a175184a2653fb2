"""Single-token state updates of the recurrent mixers (one decode step), in place on the cached states.

A decode step runs each mixer on one token per row: the conv window rolls by one input and the recurrent state takes
one step of its recurrence. transformers' torch fallbacks for these steps (``causal_conv1d_update`` and
``mamba_selective_state_update`` in ``transformers/models/jamba/modeling_jamba.py``, 5.23.0) are written for any
number of tokens and dtypes: a depthwise ``conv1d`` (on CPU a oneDNN convolution whose setup costs about 0.1 ms per
call, far more than its arithmetic) and a chain of dtype conversions around each elementwise op. At decode sizes a
step's time is that per-op overhead, so the fast paths here are the same arithmetic in the fewest torch ops, with no
Python loop over rows or channels and no host-device synchronization:

- :func:`causal_conv1d_update` / :func:`causal_conv1d_update_ref`: the conv window ``[B, C, W]`` rolls in the new
  input and the output is the window's dot product with the weight (the ``causal_conv1d_update`` of Dao's
  ``causal-conv1d`` package, single-token form);
- :func:`selective_state_update` / :func:`selective_state_update_ref`: Mamba-1's selective state update (Gu & Dao,
  "Mamba", 2023; ``selective_state_update`` of ``mamba_ssm/ops/triton/selective_state_update.py``):
  ``dA = exp(dt * A)``, ``h = dA * h + dt * B * x``, ``y = C . h + D * x``, gated by ``silu(z)``;
- :func:`mamba2_state_update` / :func:`mamba2_state_update_ref`: Mamba-2's (Dao & Gu, "Transformers are SSMs",
  2024) per-head form of the same update, a scalar ``A`` and ``dt`` per head and ``B`` / ``C`` shared by the heads of
  a group (``mamba2_selective_state_update`` of ``modeling_bamba.py``, 5.23.0);
- :func:`gated_delta_step`: one token of the gated delta rule (Yang et al., "Gated Delta Networks", ICLR 2025),
  ``S = exp(g) S``, ``S += k (beta (v - k^T S))^T``, ``o = q^T S`` per value head, whose reference is the
  token-by-token :func:`~hf_hybridcache.kernels.recurrent_gated_delta_rule` (transformers' torch path, copied).

Each ``*_ref`` mirrors transformers' torch fallback operation for operation; the fast twin reassociates a product
(``(dt * x) * B`` for ``(dt * B) * x``) and sums the conv window in another order, so the two agree within fp32
round-off (tests/test_state_update.py). :func:`causal_conv1d_update` and :func:`selective_state_update` dispatch:
the reference under the ``"reference"`` backend (:mod:`~hf_hybridcache.kernels.backend`), the fast torch path
otherwise (no Triton twin: one decode token is a handful of elementwise ops, which a GPU runs as a few launches).

Shapes: B rows (requests), C conv channels, W conv width, I channels (``intermediate_size``), N state size; for the
Mamba-2 H heads of P channels in G groups; for the gated delta rule Hk query/key heads, Hv value heads (a multiple of Hk), Dk / Dv their head dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from . import backend
from .gated_delta import l2norm, recurrent_gated_delta_rule


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """One token of a depthwise causal conv: ``causal_conv1d_update`` (``modeling_jamba.py``, transformers 5.23.0),
    copied, for one token.

    Args:
        x: the new conv inputs ``[B, C]``.
        conv_state: the last ``W`` inputs ``[B, C, W]``; updated in place (the oldest input leaves, ``x`` enters).
        weight: ``[C, W]``; bias: ``[C]`` or None; activation: a transformers activation name (``"silu"``) or None.

    Returns:
        ``[B, C]`` in ``x``'s dtype.
    """
    hidden_states = x.unsqueeze(-1)
    state_len = conv_state.shape[-1]
    hidden_states_new = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
    conv_state.copy_(hidden_states_new[:, :, -state_len:])
    out = F.conv1d(hidden_states_new, weight.unsqueeze(1), bias, padding=0, groups=x.shape[1])
    out = out[:, :, -1:]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out[..., 0].to(x.dtype)


def causal_conv1d_update_fast(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """:func:`causal_conv1d_update_ref` as a roll and a dot product (no ``conv1d``); same arguments and result."""
    window = torch.cat([conv_state[..., 1:], x.unsqueeze(-1).to(conv_state.dtype)], dim=-1)
    conv_state.copy_(window)
    out = (window.to(weight.dtype) * weight).sum(-1)
    if bias is not None:
        out = out + bias
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(x.dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """One token of a depthwise causal conv, in place on ``conv_state``: :func:`causal_conv1d_update_fast`, or
    :func:`causal_conv1d_update_ref` under the ``"reference"`` backend (see there for the arguments)."""
    if backend.resolve(x.device) == "reference":
        return causal_conv1d_update_ref(x, conv_state, weight, bias, activation)
    return causal_conv1d_update_fast(x, conv_state, weight, bias, activation)


def selective_state_update_ref(
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
    """One token of Mamba-1's selective scan: ``mamba_selective_state_update`` (``modeling_jamba.py``,
    transformers 5.23.0), copied.

    Args:
        state: the SSM state ``[B, I, N]`` (float32 in every supported model); updated in place.
        x: the conv output ``[B, I]``; dt: the time steps before ``dt_bias`` and softplus ``[B, I]``.
        A: ``[I, N]`` (negative); B, C: ``[B, N]``; D: ``[I]`` or None; z: the gate ``[B, I]`` or None;
        dt_bias: ``[I]`` or None; dt_softplus: pass ``dt + dt_bias`` through softplus.

    Returns:
        ``y`` ``[B, I]`` in ``x``'s dtype: ``(C . h + D * x) * silu(z)`` with ``h`` the updated state.
    """
    input_dtype = x.dtype
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dA = torch.exp(dt.float()[..., None] * A.float()).to(device=state.device)
    dB = dt.float()[..., None] * B.float()[:, None, :]
    dBx = dB * x.float()[..., None]
    ssm_state = state.float() * dA + dBx
    state.copy_(ssm_state.to(state.dtype))
    out = torch.matmul(ssm_state.to(C.dtype), C.unsqueeze(-1)).squeeze(-1)
    if D is not None:
        out = out + x * D
    if z is not None:
        out = out * F.silu(z)
    return out.to(input_dtype)


def selective_state_update_fast(
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
    """:func:`selective_state_update_ref` in place on a float32 ``state``, in the fewest ops; same arguments and
    result."""
    assert state.dtype == torch.float32, f"the SSM state is kept in float32, not {state.dtype}"
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.float()
    dA = torch.exp(dt.unsqueeze(-1) * A)
    state.mul_(dA).addcmul_((dt * x.float()).unsqueeze(-1), B.float().unsqueeze(1))
    out = torch.bmm(state.to(C.dtype), C.unsqueeze(-1)).squeeze(-1)
    if D is not None:
        out = torch.addcmul(out, x, D)
    if z is not None:
        out = out * F.silu(z)
    return out.to(x.dtype)


def selective_state_update(
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
    """Mamba-1's selective state update for one token, in place on ``state``: :func:`selective_state_update_fast`,
    or :func:`selective_state_update_ref` under the ``"reference"`` backend (see there for the arguments)."""
    if backend.resolve(x.device) == "reference" or state.dtype != torch.float32:
        return selective_state_update_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
    return selective_state_update_fast(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)


def gated_delta_step_fast(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of :func:`~hf_hybridcache.kernels.recurrent_gated_delta_rule` with a final state, as two batched
    matrix products per head instead of broadcast-and-sum; ``initial_state`` is left as it was (the new state is a
    new tensor, as upstream's).

    Args:
        query, key: ``[B, 1, Hk, Dk]``; value: ``[B, 1, Hv, Dv]``; g (log decay), beta: ``[B, 1, Hv]``;
        initial_state: ``[B, Hv, Dk, Dv]`` float32; use_qk_l2norm_in_kernel: L2-normalize q and k first.

    Returns:
        ``(out [B, 1, Hv, Dv] in query's dtype, final state [B, Hv, Dk, Dv] float32)``.
    """
    num_k_heads, num_v_heads = key.shape[2], value.shape[2]
    q, k, v = (x[:, 0].float() for x in (query, key, value))
    if num_k_heads != num_v_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=1)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=1)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q, dim=-1, eps=1e-6), l2norm(k, dim=-1, eps=1e-6)
    q = q / (q.shape[-1] ** 0.5)
    state = initial_state.float() * g[:, 0].float().exp()[..., None, None]
    kv_mem = torch.matmul(k.unsqueeze(-2), state).squeeze(-2)  # [B, Hv, Dv]
    delta = (v - kv_mem) * beta[:, 0].float().unsqueeze(-1)
    state.addcmul_(k.unsqueeze(-1), delta.unsqueeze(-2))
    out = torch.matmul(q.unsqueeze(-2), state)  # [B, Hv, 1, Dv]
    return out.transpose(1, 2).to(query.dtype), state


def gated_delta_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule: :func:`gated_delta_step_fast`, or the token-by-token reference under the
    ``"reference"`` backend (see :func:`gated_delta_step_fast` for the arguments and returns)."""
    if backend.resolve(query.device) == "reference":
        out, state, _ = recurrent_gated_delta_rule(query, key, value, g, beta, initial_state, True,
                                                   use_qk_l2norm_in_kernel)
        return out, state
    return gated_delta_step_fast(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel)


def mamba2_state_update_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    z: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token of Mamba-2's scan: ``mamba2_selective_state_update`` (``modeling_bamba.py``, transformers 5.23.0;
    the other Mamba-2 families hold the same function), copied, arguments as upstream passes them.

    Args:
        state: ``[B, H, P, N]`` float32, updated in place; x: ``[B, H, P]``; dt: ``[B, H, P]`` (one value per head,
        expanded over P); A: ``[H, P, N]`` (expanded); B, C: ``[B, G, N]``; D, dt_bias: ``[H, P]`` or None;
        z: ``[B, H, P]`` or None; dt_softplus: pass ``dt + dt_bias`` through softplus.

    Returns:
        ``[B, H, P]`` in ``x``'s dtype.
    """
    batch_size, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1], B.shape[-1]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt[..., None]
    dA = torch.exp(dt.float() * A.float()).to(device=state.device)
    B = B.reshape(batch_size, num_groups, 1, state_size)
    B = B.expand(batch_size, num_groups, num_heads // num_groups, state_size).contiguous()
    B = B.reshape(batch_size, num_heads, 1, state_size)
    dBx = (dt * B * x[..., None]).to(device=state.device)
    ssm_states = state * dA + dBx
    state.copy_(ssm_states.to(state.dtype))
    C = C.reshape(batch_size, num_groups, 1, state_size)
    C = C.expand(batch_size, num_groups, num_heads // num_groups, state_size).contiguous()
    C = C.reshape(batch_size, num_heads, state_size)
    ssm_states = ssm_states.to(device=C.device, dtype=C.dtype)
    out = torch.bmm(ssm_states.view(batch_size * num_heads, head_dim, state_size),
                    C.view(batch_size * num_heads, state_size, 1))
    out = out.view(batch_size, num_heads, head_dim)
    if D is not None:
        out = (out + x * D).to(out.dtype)
    if z is not None:
        out = out * F.silu(z)
    return out.to(x.dtype)


def mamba2_state_update_fast(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    z: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`mamba2_state_update_ref` in place on a float32 ``state`` in the fewest ops (the groups' ``B`` / ``C``
    repeated to the heads once, no copies of the expanded ``A``); same arguments and result."""
    assert state.dtype == torch.float32, f"the SSM state is kept in float32, not {state.dtype}"
    repeats = x.shape[1] // B.shape[1]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.float()
    B = B.float().repeat_interleave(repeats, dim=1)  # [B, H, N]
    C = C.float().repeat_interleave(repeats, dim=1)
    state.mul_(torch.exp(dt.unsqueeze(-1) * A)).addcmul_((dt * x.float()).unsqueeze(-1), B.unsqueeze(2))
    out = torch.matmul(state, C.unsqueeze(-1)).squeeze(-1)  # [B, H, P]
    if D is not None:
        out = torch.addcmul(out, x.float(), D.float())
    if z is not None:
        out = out * F.silu(z)
    return out.to(x.dtype)


def mamba2_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    z: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mamba-2's single-token state update, in place on ``state``: :func:`mamba2_state_update_fast`, or
    :func:`mamba2_state_update_ref` under the ``"reference"`` backend (see there for the arguments)."""
    if backend.resolve(x.device) == "reference" or state.dtype != torch.float32:
        return mamba2_state_update_ref(state, x, dt, A, B, C, D, dt_bias, dt_softplus, z)
    return mamba2_state_update_fast(state, x, dt, A, B, C, D, dt_bias, dt_softplus, z)
