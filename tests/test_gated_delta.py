"""The emitting gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo-Hybrid, Qwen4-Exp) against transformers'
torch path (bit-identical outputs and final state) and against the token-by-token recurrence (emitted states)."""

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
from transformers.models.qwen3_next import modeling_qwen3_next

from hf_hybridcache._compat.modeling import python_function
from hf_hybridcache.kernels import chunk_gated_delta_rule, gated_delta_steps, recurrent_gated_delta_rule

# The upstream torch functions, without the hub/FLA dispatch wrapper (which would pick FLA's kernels if installed).
UPSTREAM_CHUNK = inspect.unwrap(modeling_qwen3_next.torch_chunk_gated_delta_rule)
UPSTREAM_RECURRENT = inspect.unwrap(modeling_qwen3_next.torch_recurrent_gated_delta_rule)

# fp32 round-off of unit-scale states (measured: <= 2.4e-6 between the chunked and the token-by-token state).
FP32 = {"rtol": 1e-5, "atol": 1e-5}
POSITIONS = [1, 17, 63, 64, 65, 100, 128, 130]

CASES = {
    # (batch, seq_len, k_heads, v_heads, k_dim, v_dim)
    "ragged-T-grouped": (2, 150, 2, 4, 16, 8),
    "two-chunks-exact": (1, 128, 2, 2, 8, 16),
    "long-grouped": (1, 200, 1, 2, 16, 16),
}


def gdn_inputs(batch, seq_len, k_heads, v_heads, k_dim, v_dim, *, seed=0, dtype=torch.float32, beta_max=1.0):
    """Random ``(query, key, value, g, beta)`` in ``dtype`` (unit-scale q/k/v, decays ``exp(g)`` in (0, 1), beta in
    ``(0, beta_max)``) and a unit-scale float32 initial state."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    args = (
        randn(batch, seq_len, k_heads, k_dim),
        randn(batch, seq_len, k_heads, k_dim),
        randn(batch, seq_len, v_heads, v_dim),
        -F.softplus(randn(batch, seq_len, v_heads)),
        beta_max * torch.rand(batch, seq_len, v_heads, generator=gen),
    )
    return tuple(x.to(dtype) for x in args), randn(batch, v_heads, k_dim, v_dim)


def valid(positions, seq_len):
    return [t for t in positions if t <= seq_len]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_size", [64, 8])
@pytest.mark.parametrize("from_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_chunk_is_bit_identical_to_upstream(case, from_state, chunk_size, dtype):
    """Outputs and final state equal transformers' ``torch_chunk_gated_delta_rule`` exactly, emission or not."""
    args, h0 = gdn_inputs(*case, dtype=dtype)
    kwargs = {
        "chunk_size": chunk_size,
        "initial_state": h0 if from_state else None,
        "output_final_state": True,
        "use_qk_l2norm_in_kernel": True,
    }
    out_ref, final_ref = UPSTREAM_CHUNK(*args, **kwargs)
    out, final, emitted = chunk_gated_delta_rule(*args, **kwargs, emit_positions=valid(POSITIONS, case[1]))
    assert out.dtype == dtype and final.dtype == torch.float32
    assert torch.equal(out, out_ref) and torch.equal(final, final_ref)
    assert len(emitted) == len(valid(POSITIONS, case[1]))


@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "raw-qk"])
def test_chunk_without_final_state_and_without_l2norm_is_bit_identical(l2norm):
    args, h0 = gdn_inputs(2, 37, 2, 2, 16, 16, seed=1)
    query, key = args[0] / 4, args[1] / 4  # |k| ~ 1, so that the delta rule stays stable without the l2 norm
    args = (query, key, *args[2:])
    out_ref, final_ref = UPSTREAM_CHUNK(*args, initial_state=h0, use_qk_l2norm_in_kernel=l2norm)
    out, final, emitted = chunk_gated_delta_rule(*args, initial_state=h0, use_qk_l2norm_in_kernel=l2norm)
    assert final is final_ref is None and emitted == []
    assert torch.equal(out, out_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("from_state", [False, True], ids=["zero-state", "initial-state"])
def test_recurrence_is_bit_identical_to_upstream(from_state, dtype):
    args, h0 = gdn_inputs(2, 40, 2, 4, 16, 8, seed=2, dtype=dtype)
    kwargs = {"initial_state": h0 if from_state else None, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    out_ref, final_ref = UPSTREAM_RECURRENT(*args, **kwargs)
    out, final, _ = recurrent_gated_delta_rule(*args, **kwargs, emit_positions=[1, 39])
    assert torch.equal(out, out_ref) and torch.equal(final, final_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_size", [64, 8])
@pytest.mark.parametrize("from_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_emitted_states_match_the_recurrence(case, from_state, chunk_size, dtype):
    """Positions 1, on chunk boundaries (64, 128), off them (17, 100, 130) and at T: the state after t tokens."""
    seq_len = case[1]
    positions = sorted(set(valid(POSITIONS, seq_len)) | {seq_len - 1, seq_len})
    args, h0 = gdn_inputs(*case, seed=3, dtype=dtype)
    emitted_states_match_the_recurrence(chunk_gated_delta_rule, recurrent_gated_delta_rule, args, h0, positions,
                                        from_state=from_state, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [64, 8])
def test_emitted_states_match_upstream_on_the_prefix(chunk_size):
    """The state emitted at t is the final state of transformers' own forward over the first t tokens, which is
    what a later request restoring it continues from."""
    positions = [1, 17, 64, 100, 130, 149]
    args, h0 = gdn_inputs(2, 150, 2, 4, 16, 8, seed=4)
    emitted_states_match_upstream_on_the_prefix(chunk_gated_delta_rule, UPSTREAM_CHUNK, args, h0, positions,
                                                chunk_size)


def test_continuing_from_an_emitted_state_matches_the_unsplit_forward():
    """Split at an off-boundary t: the second half from the emitted state gives the unsplit outputs and state."""
    split = 100
    args, h0 = gdn_inputs(1, 170, 2, 4, 16, 8, seed=5)
    out, final, (state,) = chunk_gated_delta_rule(
        *args, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, emit_positions=[split]
    )
    tail_out, tail_final, _ = chunk_gated_delta_rule(
        *(x[:, split:] for x in args), initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(tail_out, out[:, split:], **FP32)
    torch.testing.assert_close(tail_final, final, **FP32)


def test_olmo_negative_eigenvalue_beta():
    """OLMo-Hybrid's ``allow_neg_eigval`` doubles beta (range (0, 2)); same kernel, same guarantees."""
    args, h0 = gdn_inputs(2, 150, 2, 4, 16, 8, seed=6, beta_max=2.0)
    kwargs = {"initial_state": h0, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    out_ref, final_ref = UPSTREAM_CHUNK(*args, **kwargs)
    out, final, emitted = chunk_gated_delta_rule(*args, **kwargs, emit_positions=[17, 64, 130])
    assert torch.equal(out, out_ref) and torch.equal(final, final_ref)
    _, _, emitted_ref = recurrent_gated_delta_rule(*args, **kwargs, emit_positions=[17, 64, 130])
    for state, state_ref in zip(emitted, emitted_ref):
        torch.testing.assert_close(state, state_ref, **FP32)


def test_emitted_states_are_new_tensors():
    args, h0 = gdn_inputs(1, 128, 1, 1, 8, 8, seed=7)
    h0_before = h0.clone()
    _, final, emitted = chunk_gated_delta_rule(*args, initial_state=h0, output_final_state=True, emit_positions=[128])
    assert emitted[0].data_ptr() != final.data_ptr()
    emitted[0].zero_()
    assert final.abs().sum() > 0 and torch.equal(h0, h0_before)


@pytest.mark.parametrize("shift", [-1, 1], ids=["one-token-early", "one-token-late"])
@pytest.mark.parametrize("t", [1, 17, 64, 100, 130])
def test_tolerance_detects_a_state_off_by_one_token(t, shift):
    """The power of the comparisons above: the state one token early or late fails FP32 by a wide margin."""
    args, h0 = gdn_inputs(2, 150, 2, 4, 16, 8, seed=3)
    kwargs = {"initial_state": h0, "use_qk_l2norm_in_kernel": True}
    _, _, (state,) = chunk_gated_delta_rule(*args, **kwargs, emit_positions=[t])
    if t + shift == 0:
        wrong = h0  # the state after 0 tokens
    else:
        _, _, (wrong,) = recurrent_gated_delta_rule(*args, **kwargs, emit_positions=[t + shift])
    assert (state - wrong).abs().max() > 1000 * FP32["atol"]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(state, wrong, **FP32)


@pytest.mark.parametrize("positions", [[0], [5, 3], [2, 2], [41]], ids=["zero", "unsorted", "repeated", "too-far"])
@pytest.mark.parametrize("kernel", [chunk_gated_delta_rule, recurrent_gated_delta_rule, gated_delta_steps],
                         ids=["chunk", "recurrent", "steps"])
def test_bad_emit_positions_raise(kernel, positions):
    args, _ = gdn_inputs(1, 40, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="emit_positions"):
        kernel(*args, emit_positions=positions)


@pytest.mark.parametrize("kernel", [chunk_gated_delta_rule, gated_delta_steps], ids=["chunk", "steps"])
def test_value_heads_must_be_a_multiple_of_key_heads(kernel):
    args, _ = gdn_inputs(1, 10, 2, 3, 4, 4)
    with pytest.raises(ValueError, match="not a multiple of the 2 query/key heads"):
        kernel(*args)


STEP_CASES = {
    # (batch, seq_len, k_heads, v_heads, k_dim, v_dim): a decode token, a verify step of 4 drafts, the longest stepped
    "one-token": (1, 1, 2, 2, 8, 16),
    "five-grouped-batch": (3, 5, 2, 4, 16, 8),
    "sixteen": (1, 16, 1, 2, 12, 20),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "raw-qk"])
@pytest.mark.parametrize("from_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("case", STEP_CASES.values(), ids=STEP_CASES.keys())
def test_steps_match_the_recurrence(case, from_state, l2norm, dtype):
    """The stepped form (a verify step's kernel) against the token-by-token reference (delta_steps_checks)."""
    args, h0 = gdn_inputs(*case, seed=5, dtype=dtype)
    steps_match_the_recurrence(gated_delta_steps, recurrent_gated_delta_rule, args, h0, from_state=from_state,
                               l2norm=l2norm, dtype=dtype)


def test_steps_leave_their_inputs_and_emitted_states_alone():
    args, h0 = gdn_inputs(1, 5, 2, 2, 8, 8, seed=9)
    steps_leave_their_inputs_and_emitted_states_alone(gated_delta_steps, recurrent_gated_delta_rule, args, h0)


@pytest.mark.parametrize("shift", [-1, 1], ids=["one-token-early", "one-token-late"])
def test_steps_tolerance_detects_a_state_off_by_one_token(shift):
    args, h0 = gdn_inputs(3, 5, 2, 4, 16, 8, seed=5)
    steps_tolerance_detects_a_state_off_by_one_token(gated_delta_steps, recurrent_gated_delta_rule, args, h0, shift)


GDN_MODULES = [
    "qwen3_5.modeling_qwen3_5",
    "qwen3_5_moe.modeling_qwen3_5_moe",
    "olmo_hybrid.modeling_olmo_hybrid",
    "qwen4_exp.modeling_qwen4_exp",
]


@pytest.mark.parametrize("module", GDN_MODULES)
def test_other_families_use_the_same_upstream_functions(module):
    """The families this kernel serves hold character-for-character copies of Qwen3-Next's functions (when that
    changes in a new transformers, the bit-identity above no longer covers them)."""
    mod = __import__(f"transformers.models.{module}", fromlist=["_"])
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "l2norm"):
        ours = inspect.getsource(python_function(getattr(modeling_qwen3_next, name)))
        theirs = inspect.getsource(python_function(getattr(mod, name)))
        assert theirs == ours, f"{module}.{name} differs from modeling_qwen3_next.{name}"
