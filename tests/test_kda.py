"""The emitting Kimi Delta Attention (Kimi-Linear; Bailing-Hybrid and GLM-5-Next with their bounded gate) against
transformers' torch path (bit-identical outputs and final state) and against the token-by-token recurrence."""

import inspect

import pytest
import torch
import torch.nn.functional as F
from delta_rule_checks import (
    emitted_states_match_the_recurrence,
    emitted_states_match_upstream_on_the_prefix,
    steps_leave_their_inputs_and_emitted_states_alone,
    steps_match_the_recurrence,
    steps_tolerance_detects_a_state_off_by_one_token,
)
from transformers.models.kimi_linear import modeling_kimi_linear

from hf_hybridcache._compat.modeling import python_function
from hf_hybridcache.kernels import (
    chunk_gated_delta_rule,
    chunk_kimi_delta_attention,
    kimi_delta_steps,
    recurrent_kimi_delta_attention,
)

# The upstream torch functions, without the hub/FLA dispatch wrapper (which would pick FLA's kernels if installed).
UPSTREAM_CHUNK = inspect.unwrap(modeling_kimi_linear.chunk_kimi_delta_attention)
UPSTREAM_RECURRENT = inspect.unwrap(modeling_kimi_linear.recurrent_kimi_delta_attention)

# fp32 round-off of unit-scale states (measured: <= 2.9e-6 between the chunked and the token-by-token state).
FP32 = {"rtol": 1e-5, "atol": 1e-5}
POSITIONS = [1, 17, 63, 64, 65, 100, 128, 130]
#: ``kda_lower_bound`` / ``linear_lower_bound`` default of Bailing-Hybrid and GLM-5-Next.
LOWER_BOUND = -5.0

CASES = {
    # (batch, seq_len, heads, k_dim, v_dim)
    "ragged-T": (2, 150, 2, 16, 8),
    "two-chunks-exact": (1, 128, 3, 8, 16),
}


def kda_inputs(batch, seq_len, heads, k_dim, v_dim, *, gate="softplus", seed=0, dtype=torch.float32):
    """Random ``(query, key, value, g, beta)`` in ``dtype`` and a unit-scale float32 initial state. ``g`` is Kimi's
    ``-exp(A_log) * softplus(x)`` or, for ``gate="bounded"``, the safe gate ``LOWER_BOUND * sigmoid(exp(A_log) x)``
    of Bailing-Hybrid / GLM-5-Next (per-token decays down to exp(-5), so a chunk's decay underflows float32)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    gate_input, decay_rate = randn(batch, seq_len, heads, k_dim), randn(1, 1, heads, 1).exp()
    if gate == "bounded":
        g = LOWER_BOUND * torch.sigmoid(decay_rate * gate_input)
    else:
        g = -decay_rate * F.softplus(gate_input)
    args = (
        randn(batch, seq_len, heads, k_dim),
        randn(batch, seq_len, heads, k_dim),
        randn(batch, seq_len, heads, v_dim),
        g,
        torch.rand(batch, seq_len, heads, generator=gen),
    )
    return tuple(x.to(dtype) for x in args), randn(batch, heads, k_dim, v_dim)


def valid(positions, seq_len):
    return [t for t in positions if t <= seq_len]


@pytest.mark.parametrize("gate", ["softplus", "bounded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_size", [64, 8])
@pytest.mark.parametrize("from_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_chunk_is_bit_identical_to_upstream(case, from_state, chunk_size, dtype, gate):
    """Outputs and final state equal transformers' ``chunk_kimi_delta_attention`` exactly, emission or not."""
    args, h0 = kda_inputs(*case, gate=gate, dtype=dtype)
    kwargs = {
        "chunk_size": chunk_size,
        "initial_state": h0 if from_state else None,
        "output_final_state": True,
        "use_qk_l2norm_in_kernel": True,
    }
    out_ref, final_ref = UPSTREAM_CHUNK(*args, **kwargs)
    out, final, emitted = chunk_kimi_delta_attention(*args, **kwargs, emit_positions=valid(POSITIONS, case[1]))
    assert out.dtype == dtype and final.dtype == torch.float32
    assert torch.equal(out, out_ref) and torch.equal(final, final_ref)
    assert len(emitted) == len(valid(POSITIONS, case[1]))


def test_chunk_without_final_state_and_without_l2norm_is_bit_identical():
    args, h0 = kda_inputs(2, 37, 2, 16, 16, seed=1)
    args = (args[0] / 4, args[1] / 4, *args[2:])  # |k| ~ 1, so that the delta rule stays stable without the l2 norm
    out_ref, final_ref = UPSTREAM_CHUNK(*args, initial_state=h0)
    out, final, emitted = chunk_kimi_delta_attention(*args, initial_state=h0)
    assert final is final_ref is None and emitted == []
    assert torch.equal(out, out_ref)


@pytest.mark.parametrize("gate", ["softplus", "bounded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("from_state", [False, True], ids=["zero-state", "initial-state"])
def test_recurrence_is_bit_identical_to_upstream(from_state, dtype, gate):
    args, h0 = kda_inputs(2, 40, 2, 16, 8, gate=gate, seed=2, dtype=dtype)
    initial = h0 if from_state else None
    out_ref, final_ref = UPSTREAM_RECURRENT(*args, initial, True, use_qk_l2norm_in_kernel=True)
    out, final, _ = recurrent_kimi_delta_attention(
        *args, initial, True, use_qk_l2norm_in_kernel=True, emit_positions=[1, 39]
    )
    assert torch.equal(out, out_ref) and torch.equal(final, final_ref)


@pytest.mark.parametrize("gate", ["softplus", "bounded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_size", [64, 8])
@pytest.mark.parametrize("from_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_emitted_states_match_the_recurrence(case, from_state, chunk_size, dtype, gate):
    """Positions 1, on chunk boundaries (64, 128), off them (17, 100, 130) and at T: the state after t tokens."""
    seq_len = case[1]
    positions = sorted(set(valid(POSITIONS, seq_len)) | {seq_len - 1, seq_len})
    args, h0 = kda_inputs(*case, gate=gate, seed=3, dtype=dtype)
    emitted_states_match_the_recurrence(chunk_kimi_delta_attention, recurrent_kimi_delta_attention, args, h0, positions,
                                        from_state=from_state, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [64, 8])
def test_emitted_states_match_upstream_on_the_prefix(chunk_size):
    """The state emitted at t is the final state of transformers' own forward over the first t tokens."""
    positions = [1, 17, 64, 100, 130, 149]
    args, h0 = kda_inputs(2, 150, 2, 16, 8, seed=4)
    emitted_states_match_upstream_on_the_prefix(chunk_kimi_delta_attention, UPSTREAM_CHUNK, args, h0, positions,
                                                chunk_size)


def test_continuing_from_an_emitted_state_matches_the_unsplit_forward():
    split = 100
    args, h0 = kda_inputs(1, 170, 2, 16, 8, gate="bounded", seed=5)
    kwargs = {"output_final_state": True, "use_qk_l2norm_in_kernel": True}
    out, final, (state,) = chunk_kimi_delta_attention(*args, initial_state=h0, **kwargs, emit_positions=[split])
    tail_out, tail_final, _ = chunk_kimi_delta_attention(*(x[:, split:] for x in args), initial_state=state, **kwargs)
    torch.testing.assert_close(tail_out, out[:, split:], **FP32)
    torch.testing.assert_close(tail_final, final, **FP32)


def test_one_decay_per_head_is_the_gated_delta_rule():
    """With the same decay on every key channel KDA is GDN (the two l2 norms differ in the last bit only)."""
    args, h0 = kda_inputs(2, 150, 2, 16, 8, seed=6)
    query, key, value, g, beta = args
    g_head = g[..., 0]
    kda = chunk_kimi_delta_attention(
        query, key, value, g_head[..., None].expand_as(g), beta, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, emit_positions=[100],
    )  # fmt: skip
    gdn = chunk_gated_delta_rule(
        query, key, value, g_head, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        emit_positions=[100],
    )  # fmt: skip
    torch.testing.assert_close(kda[0], gdn[0], **FP32)
    torch.testing.assert_close(kda[1], gdn[1], **FP32)
    torch.testing.assert_close(kda[2][0], gdn[2][0], **FP32)


@pytest.mark.parametrize("shift", [-1, 1], ids=["one-token-early", "one-token-late"])
@pytest.mark.parametrize("t", [1, 17, 64, 100, 130])
@pytest.mark.parametrize("gate", ["softplus", "bounded"])
def test_tolerance_detects_a_state_off_by_one_token(gate, t, shift):
    """The power of the comparisons above: the state one token early or late fails FP32 by a wide margin."""
    args, h0 = kda_inputs(2, 150, 2, 16, 8, gate=gate, seed=3)
    kwargs = {"initial_state": h0, "use_qk_l2norm_in_kernel": True}
    _, _, (state,) = chunk_kimi_delta_attention(*args, **kwargs, emit_positions=[t])
    if t + shift == 0:
        wrong = h0  # the state after 0 tokens
    else:
        _, _, (wrong,) = recurrent_kimi_delta_attention(*args, **kwargs, emit_positions=[t + shift])
    assert (state - wrong).abs().max() > 1000 * FP32["atol"]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(state, wrong, **FP32)


@pytest.mark.parametrize("positions", [[0], [5, 3], [2, 2], [41]], ids=["zero", "unsorted", "repeated", "too-far"])
@pytest.mark.parametrize(
    "kernel", [chunk_kimi_delta_attention, recurrent_kimi_delta_attention, kimi_delta_steps],
    ids=["chunk", "recurrent", "steps"],
)
def test_bad_emit_positions_raise(kernel, positions):
    args, _ = kda_inputs(1, 40, 1, 4, 4)
    with pytest.raises(ValueError, match="emit_positions"):
        kernel(*args, emit_positions=positions)


@pytest.mark.parametrize("module", ["bailing_hybrid.modeling_bailing_hybrid", "glm5_next.modeling_glm5_next"])
def test_bounded_gate_families_use_the_same_upstream_functions(module):
    """Bailing-Hybrid and GLM-5-Next hold character-for-character copies of Kimi-Linear's functions; their bounded
    gate lives in the forget-gate module (when that changes, the bit-identity above no longer covers them)."""
    mod = __import__(f"transformers.models.{module}", fromlist=["_"])
    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "l2norm"):
        ours = inspect.getsource(python_function(getattr(modeling_kimi_linear, name)))
        theirs = inspect.getsource(python_function(getattr(mod, name)))
        assert theirs == ours, f"{module}.{name} differs from modeling_kimi_linear.{name}"


STEP_CASES = {
    # (batch, seq_len, heads, k_dim, v_dim): a decode token, a verify step of 4 drafts in a batch, the longest stepped
    "one-token": (1, 1, 2, 8, 16),
    "five-batch": (3, 5, 2, 16, 8),
    "sixteen": (1, 16, 3, 12, 20),
}


@pytest.mark.parametrize("gate", ["softplus", "bounded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("from_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("case", STEP_CASES.values(), ids=STEP_CASES.keys())
def test_steps_match_the_recurrence(case, from_state, dtype, gate):
    """The stepped form (a verify step's kernel) against the token-by-token reference (delta_steps_checks)."""
    args, h0 = kda_inputs(*case, gate=gate, seed=5, dtype=dtype)
    steps_match_the_recurrence(kimi_delta_steps, recurrent_kimi_delta_attention, args, h0, from_state=from_state,
                               l2norm=True, dtype=dtype)


def test_steps_leave_their_inputs_and_emitted_states_alone():
    args, h0 = kda_inputs(1, 5, 2, 8, 8, seed=9)
    steps_leave_their_inputs_and_emitted_states_alone(kimi_delta_steps, recurrent_kimi_delta_attention, args, h0)


@pytest.mark.parametrize("shift", [-1, 1], ids=["one-token-early", "one-token-late"])
def test_steps_tolerance_detects_a_state_off_by_one_token(shift):
    args, h0 = kda_inputs(3, 5, 2, 16, 8, seed=5)
    steps_tolerance_detects_a_state_off_by_one_token(kimi_delta_steps, recurrent_kimi_delta_attention, args, h0, shift)
