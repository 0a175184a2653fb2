"""deterministic=True on the pure Mamba-2 family (``mamba2``, issue 46): deterministic_bank.py's cases on the toy
Mamba-2 (4 heads of 32 in 2 groups, ``chunk_size=24``, off the 16-token block grid): a request's tokens and logits /
logprobs are the same bits cold and after hits of several lengths (block boundaries, one inside a scan chunk), with a
reply replayed in a chat, decoded or prefilled, as a row of a padded generate() batch, and among 1-8 other requests
in the engine at prefill chunks of 16, 48 and 512 tokens and in speculative steps; in float32, bfloat16 and float16.

Power (each ingredient switched off alone through the private ``mamba2_deterministic._OFF``, or the mode off; at two
intra-op threads on the 2-core AVX-512 CPU, torch 2.13 with MKL; ``x``: the case differs; docs/deterministic.md has
the table):

- the row-invariant linear: float32 hits, decoded tokens and the engine differ (bf16 / fp16: none);
- the invariant conv: a decoded token differs from the same token prefilled in every dtype;
- the per-token scan: float32 and float16 hits, decoded tokens and the engine differ; bf16 decoded tokens;
- the gated RMSNorm: no case here (the toy's 128 channels fill whole vectors, so ``F.silu`` has no scalar tail);
  tests/test_mamba2_invariant.py shows upstream's norm moving a row's bits at a width of 1000;
- the mode off: every case in float32 and float16; decoded tokens and the engine in bfloat16.
"""

import pytest
import torch
from deterministic_bank import (
    BASE,
    chat_with_the_reply_replayed,
    checkpoints_hold_upstream_states,
    decode_vs_prefill_case,
    engine_requests_equal_generate_alone,
    engine_requests_hit_each_others_prefix,
    hit_case,
    hits_equal_cold,
    identical_prompt_and_decoded_tokens,
    ingredient_off_breaks,
    mode_off_some_case_differs,
    padded_batch_rows_equal_each_alone,
    run,
    speculative_case,
)

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.models import mamba2_deterministic
from hf_hybridcache.toy import build_model

FAMILY = "mamba2"


@pytest.fixture(params=[torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def dtype(request):
    return request.param


@pytest.mark.parametrize("overrides", [{}, {"time_step_limit": (0.0, 0.05)}], ids=["default", "dt-clamped"])
def test_the_mode_computes_the_default_paths_prefill_within_round_off(overrides):
    """The same mixer as the package's Mamba-2 path (groups, dt_bias, softplus, the time_step_limit clamp, the D skip,
    the gated norm): a prefill's logits within float32 round-off of the default mode's, with the clamp biting too
    (0.05 is below most of the long-memory toy's time steps). Only the prefill: upstream's decode step ignores
    time_step_limit, which the chunked prefill and the mode apply."""
    prompt = BASE[:40]
    logits = {}
    for on in (False, True):
        model = build_model(FAMILY, seed=0, **overrides)
        logits[on] = run(model, HybridPrefixCache(model, deterministic=on), prompt, new_tokens=1)[1]
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=1e-4)


def test_checkpoints_hold_the_states_of_an_upstream_cold_forward():
    """What the mode stores is what the default path stores: the conv window and the float32 SSM state ``[H, P, N]``
    at a block boundary equal an unpatched model's (transformers' own chunked scan) within fp32 round-off. In float32
    only: in bf16 upstream's chunked scan rounds its products to bf16 where the per-token step keeps float32 (the
    states were 5.6e-3 apart)."""
    checkpoints_hold_upstream_states(FAMILY)


@pytest.mark.parametrize("length", [16, 24, 47, 89])  # 24: the scan's chunk_size, which the mode does not use
def test_hits_of_several_lengths_equal_cold_bit_for_bit(dtype, length):
    hits_equal_cold(FAMILY, dtype, length)


def test_identical_prompt_and_decoded_tokens_equal_cold_and_prefilled(dtype):
    identical_prompt_and_decoded_tokens(FAMILY, dtype)


def test_chat_turn_with_the_reply_replayed_equals_cold(dtype):
    chat_with_the_reply_replayed(FAMILY, dtype, turns=3)


def test_padded_generate_batch_rows_equal_each_alone(dtype):
    padded_batch_rows_equal_each_alone(FAMILY, dtype)


@pytest.mark.parametrize("max_batch_tokens", [16, 48, 512])
@pytest.mark.parametrize("threads", [1, 2])
def test_engine_requests_equal_generate_alone_in_any_batch(dtype, max_batch_tokens, threads):
    """The engine's tokens and logprobs for 1, 3 and 8 concurrent requests equal each one alone in generate()."""
    torch.set_num_threads(threads)
    engine_requests_equal_generate_alone(FAMILY, dtype, max_batch_tokens)


def test_speculative_engine_steps_equal_generate_alone(dtype):
    speculative_case(FAMILY, dtype)


def test_engine_requests_hit_each_others_prefix():
    engine_requests_hit_each_others_prefix(FAMILY)


@pytest.mark.parametrize("off, dtype, case", [
    ("linear", torch.float32, hit_case),
    ("conv", torch.float32, decode_vs_prefill_case),
    ("conv", torch.bfloat16, decode_vs_prefill_case),
    ("scan", torch.float32, hit_case),
    ("scan", torch.bfloat16, decode_vs_prefill_case),
], ids=["linear-fp32-hit", "conv-fp32-decode", "conv-bf16-decode", "scan-fp32-hit", "scan-bf16-decode"])
def test_each_ingredient_off_alone_breaks_a_case(monkeypatch, off, dtype, case):
    torch.set_num_threads(2)  # MKL's float32 1-row product sums in another order at 2 threads (the suite runs 1)
    ingredient_off_breaks(monkeypatch, mamba2_deterministic, off, case, FAMILY, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_with_the_mode_off_some_case_differs(dtype):
    mode_off_some_case_differs(FAMILY, dtype)
