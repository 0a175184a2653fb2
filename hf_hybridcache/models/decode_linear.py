"""Decode steps' linear layers and eager experts through :func:`~hf_hybridcache.kernels.decode_linear.decode_linear`.

:func:`install` routes, on one model instance, the forward of

- every ``nn.Linear`` whose weight :func:`~hf_hybridcache.kernels.decode_linear.qualifies` at one token (a projection
  from the hidden size up: MLP gate and up projections, the LM head; a toy model's small layers are left alone), and
- every experts module whose eager forward is transformers' common loop over the hit experts (the forward of
  ``JambaExperts``, ``Qwen3_5MoeExperts``, ``Qwen3NextExperts`` and kin, compared by source; stored as 3D
  ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``), set to the eager, ``grouped_mm`` or ``batched_mm``
  implementation (``batched_mm`` copies the hit experts' weights per token; ``grouped_mm`` on CPU is a loop too),

so that inside this package's forwards (the engine's steps, ``generate()`` over a ``HybridPrefixCache``), without
grad, at most :data:`~hf_hybridcache.kernels.decode_linear.MAX_ROWS` tokens in float32 on CPU, they run the batched
form; everywhere else (another cache or none, prefill, bf16, CUDA, training) transformers' own forward, unchanged.
The experts' decode loop is the eager one, op for op, with the gate and up projections batched: the same experts in
the same order, the same ``index_add_`` into zeros.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Iterator

import torch

from .. import _compat
from ..kernels.decode_linear import MAX_ROWS, decode_linear, weight_qualifies

#: The intra-op thread count a decode forward under :func:`decode_threads` gives back to its wide weights' reads.
_WIDE_THREADS: contextvars.ContextVar[int | None] = contextvars.ContextVar("hf_hybridcache_wide_threads", default=None)


@contextlib.contextmanager
def decode_threads(model: torch.nn.Module, num_tokens: int) -> Iterator[None]:
    """Run a decode forward of ``num_tokens`` tokens (at most
    :data:`~hf_hybridcache.kernels.decode_linear.MAX_ROWS`) of a float32 CPU model on one intra-op thread, its wide
    weights' reads (:func:`wide_threads`) on all of them.

    A decode step is a few hundred small ops (norms, the mixers' state updates, the router, attention over one query);
    with ``OMP_WAIT_POLICY=PASSIVE`` every one of them that torch parallelizes wakes the sleeping threads, which costs
    more than the op: an ``exp`` of 8,192 values takes 65-90 us on two threads, 5-11 us on one. The weight reads,
    bound by memory bandwidth, keep every thread. The thread count changes no result of these ops (each output
    element is computed by one thread either way); float32 only, so reduced precision stays bit-identical to stock.
    Deterministic mode's products run under :func:`wide_threads` too, at the thread count of its prefills and of its
    row-invariance probe."""
    threads = torch.get_num_threads()
    if (threads == 1 or num_tokens > MAX_ROWS or _WIDE_THREADS.get() is not None
            or getattr(model, "dtype", None) != torch.float32 or getattr(model, "device", None) is None
            or model.device.type != "cpu"):
        yield
        return
    token = _WIDE_THREADS.set(threads)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _WIDE_THREADS.reset(token)


@contextlib.contextmanager
def wide_threads() -> Iterator[None]:
    """All the threads :func:`decode_threads` took away, for one wide weight's read (no change outside it)."""
    threads = _WIDE_THREADS.get()
    if threads is None:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(1)


def _in_decode(hidden_states: torch.Tensor) -> bool:
    return (_compat.in_package_forward() and not torch.is_grad_enabled() and hidden_states.dtype == torch.float32
            and hidden_states.device.type == "cpu" and hidden_states.numel() <= MAX_ROWS * hidden_states.shape[-1])


def _linear_forward(module: torch.nn.Linear, original, hidden_states: torch.Tensor) -> torch.Tensor:
    if _in_decode(hidden_states):
        with wide_threads():
            return decode_linear(hidden_states, module.weight, module.bias)
    return original(hidden_states)


#: The experts implementations of transformers the decode loop stands in for: the same sum over the hit experts
#: (``grouped_mm``, the default of models built from a config, and ``batched_mm`` run it as other kernels).
_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


@functools.cache
def _eager_template() -> str:
    from transformers.models.jamba.modeling_jamba import JambaExperts

    return inspect.getsource(JambaExperts.forward.__wrapped__)


def _is_common_eager(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an experts module whose eager forward is the common loop (compared by source) over 3D
    weights without bias, transposition or post-expert norm, set to one of :data:`_IMPLEMENTATIONS`."""
    forward = getattr(type(module).forward, "__wrapped__", None)
    config = getattr(module, "config", None)
    if forward is None or getattr(config, "_experts_implementation", None) not in _IMPLEMENTATIONS:
        return False
    layout = (getattr(module, "has_gate", False), getattr(module, "has_bias", True),
              getattr(module, "is_transposed", True), getattr(module, "is_concatenated", False),
              getattr(module, "has_post_expert_norm", True))
    weights = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if layout != (True, False, False, True, False) or not all(isinstance(w, torch.Tensor) and w.dim() == 3
                                                              for w in weights):
        return False
    try:
        return inspect.getsource(forward) == _eager_template()
    except (OSError, TypeError):
        return False


def _experts_forward(module, original, hidden_states, top_k_index, top_k_weights):
    """transformers' eager experts loop (``JambaExperts.forward``) with the gate and up projections batched."""
    if not _in_decode(hidden_states) or module.config._experts_implementation not in _IMPLEMENTATIONS:
        return original(hidden_states, top_k_index, top_k_weights)
    if hidden_states.shape[0] == 1:
        with wide_threads():
            return _one_token_experts(module, hidden_states, top_k_index, top_k_weights)
    final_hidden_states = torch.zeros_like(hidden_states)
    expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=module.num_experts + 1).permute(2, 1, 0)
    for expert_idx in sorted(set(top_k_index.flatten().tolist())):  # the hit experts, ascending, as nonzero() gives
        if expert_idx == module.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        with wide_threads():
            current_hidden_states = _expert_mlp(module, expert_idx, current_state)
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states


def _expert_mlp(module, expert_idx: int, states: torch.Tensor) -> torch.Tensor:
    """One expert's gated MLP on ``states`` ``[n, H]`` as the eager loop computes it, its gate and up projection
    batched (:func:`~hf_hybridcache.kernels.decode_linear.decode_linear`); returns ``[n, H]``."""
    gate, up = decode_linear(states, module.gate_up_proj[expert_idx]).chunk(2, dim=-1)
    return torch.nn.functional.linear(module.act_fn(gate) * up, module.down_proj[expert_idx])


def install(model: torch.nn.Module) -> int:
    """Route the linear layers and eager experts of ``model`` whose weights (an expert's gate and up projection)
    :func:`~hf_hybridcache.kernels.decode_linear.weight_qualifies` (idempotent); returns how many modules were routed
    now. A module accelerate offloads (weights on the meta device) or one already patched is left alone; dtype and
    device are checked at each call."""
    routed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is torch.nn.Linear and isinstance(weight, torch.Tensor):
            if weight.device.type != "meta" and weight_qualifies(tuple(weight.shape)):
                routed += _compat.patch_instance_forward(module, _linear_forward)
        elif (_is_common_eager(module) and module.gate_up_proj.device.type != "meta"
              and weight_qualifies(tuple(module.gate_up_proj.shape[1:]))):
            routed += _compat.patch_instance_forward(module, _experts_forward)
    return routed


def _one_token_experts(module, hidden_states, top_k_index, top_k_weights):
    """The eager loop for one token: its experts in ascending order, each contribution added to the sum so far (as
    ``index_add_`` into zeros adds it: bit for bit the same), without the one-hot mask, ``where`` and ``index_add_``
    (a scatter that costs 0.3 ms on two threads for 128 values, where waking the second thread is most of it)."""
    experts = top_k_index[0].tolist()
    final_hidden_states = None
    for k in sorted(range(len(experts)), key=experts.__getitem__):
        expert_idx = experts[k]
        if expert_idx == module.num_experts:
            continue
        current_hidden_states = _expert_mlp(module, expert_idx, hidden_states) * top_k_weights[0, k, None]
        current_hidden_states = current_hidden_states.to(hidden_states.dtype)
        final_hidden_states = (current_hidden_states if final_hidden_states is None
                               else final_hidden_states + current_hidden_states)
    return torch.zeros_like(hidden_states) if final_hidden_states is None else final_hidden_states
