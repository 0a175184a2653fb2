"""The checks of an emitting delta rule against its references, shared by tests/test_gated_delta.py and
tests/test_kda.py: each test builds its rule's inputs and passes its rule's functions (the chunked form, the
token-by-token recurrence, the stepped form of a verify step, upstream's chunked forward; same arguments and returns
within a rule)."""

import pytest
import torch

# fp32 round-off of unit-scale states (measured: <= 2.9e-6 between the chunked and the token-by-token state).
FP32 = {"rtol": 1e-5, "atol": 1e-5}


def emitted_states_match_the_recurrence(chunk, recurrent, args, h0, positions, *, from_state, chunk_size):
    """The chunked form's final state and the states it emits after ``positions`` tokens against the recurrence's,
    within fp32 round-off, all float32 of the final state's shape."""
    kwargs = {"initial_state": h0 if from_state else None, "output_final_state": True,
              "use_qk_l2norm_in_kernel": True}
    _, final, emitted = chunk(*args, chunk_size=chunk_size, **kwargs, emit_positions=positions)
    _, final_ref, emitted_ref = recurrent(*args, **kwargs, emit_positions=positions)
    torch.testing.assert_close(final, final_ref, **FP32)
    assert len(emitted) == len(positions)
    for t, state, state_ref in zip(positions, emitted, emitted_ref):
        assert state.dtype == torch.float32 and state.shape == final.shape
        torch.testing.assert_close(state, state_ref, **FP32, msg=lambda m, t=t: f"state after {t} tokens: {m}")


def emitted_states_match_upstream_on_the_prefix(chunk, upstream_chunk, args, h0, positions, chunk_size):
    """The state emitted after t tokens is the final state of upstream's forward over the first t tokens."""
    _, _, emitted = chunk(
        *args, chunk_size=chunk_size, initial_state=h0, use_qk_l2norm_in_kernel=True, emit_positions=positions
    )
    for t, state in zip(positions, emitted):
        _, prefix_final = upstream_chunk(
            *(x[:, :t] for x in args),
            chunk_size=chunk_size,
            initial_state=h0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(state, prefix_final, **FP32)


def steps_match_the_recurrence(steps, recurrent, args, h0, *, from_state, l2norm, dtype):
    """Outputs, final state and the state after every token within fp32 round-off (bf16 outputs: within their
    rounding); outputs in the inputs' dtype, states float32."""
    seq_len = args[0].shape[1]
    kwargs = {"initial_state": h0 if from_state else None, "output_final_state": True,
              "use_qk_l2norm_in_kernel": l2norm}
    positions = list(range(1, seq_len + 1))
    out, final, emitted = steps(*args, **kwargs, emit_positions=positions)
    out_ref, final_ref, emitted_ref = recurrent(*args, **kwargs, emit_positions=positions)
    assert out.dtype == dtype and out.shape == out_ref.shape and final.dtype == torch.float32
    tolerance = FP32 if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}  # bf16: the output's rounding
    torch.testing.assert_close(out, out_ref, **tolerance)
    torch.testing.assert_close(final, final_ref, **FP32)
    for t, state, state_ref in zip(positions, emitted, emitted_ref, strict=True):
        torch.testing.assert_close(state, state_ref, **FP32, msg=lambda m, t=t: f"state after {t} tokens: {m}")


def steps_leave_their_inputs_and_emitted_states_alone(steps, recurrent, args, h0):
    """Emitted states are not written by later tokens nor aliased with the final state (which the caller writes in
    place), and the initial state is left as it was; without ``output_final_state`` no final state."""
    h0_before = h0.clone()
    _, final, emitted = steps(*args, initial_state=h0, output_final_state=True, emit_positions=[2, 5])
    _, _, emitted_ref = recurrent(*args, initial_state=h0, emit_positions=[2, 5])
    assert torch.equal(h0, h0_before) and emitted[1].data_ptr() != final.data_ptr()
    final.zero_()
    for state, state_ref in zip(emitted, emitted_ref, strict=True):
        torch.testing.assert_close(state, state_ref, **FP32)
    assert steps(*args, initial_state=h0)[1] is None


def steps_tolerance_detects_a_state_off_by_one_token(steps, recurrent, args, h0, shift):
    """The power of the stepped comparisons: the state after 3 tokens against the recurrence's one token early or
    late fails FP32."""
    kwargs = {"initial_state": h0, "use_qk_l2norm_in_kernel": True}
    _, _, (state,) = steps(*args, **kwargs, emit_positions=[3])
    _, _, (wrong,) = recurrent(*args, **kwargs, emit_positions=[3 + shift])
    with pytest.raises(AssertionError):
        torch.testing.assert_close(state, wrong, **FP32)
