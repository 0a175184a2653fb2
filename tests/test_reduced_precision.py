"""bfloat16 and float16: what "outputs are the same as without the cache" means there (README, "The same output, per
dtype").

A decode step (one token per forward over a cached state) runs the mixers' single-step kernels, which round
differently from their prefill kernels in bf16: KV and checkpoints taken from decode steps put the next chat turn's
first logits 0.02-0.06 away from a cold run. So in bf16/fp16 the cache stores a reply from one prefill forward of its
tokens when ``generate()`` ends (``replay_replies``) and leaves at least two tokens to a hit's tail. A hit then equals
a cold run bit for bit where the prefill kernels give the same bits however a prompt is split (Mamba-1, short convs,
attention), and otherwise the cold run or the stock computation of its path (the chunked scans' fp32 round-off at the
split). ``benchmarks/bf16_multiturn.py`` prints the flip rates; these tests assert the promise in every trial.
"""

import argparse

import pytest
import torch
from conftest import cold_states, greedy, random_ids
from transformers import DynamicCache

from benchmarks.bf16_multiturn import chat
from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.toy import VOCAB_SIZE, build_model

#: 3-turn chats, 8 seeds: turn 1 a random prompt of 37 + seed tokens, turn k = turn k-1 + its 16-token reply + 7 new.
CHAT = argparse.Namespace(turns=3, new_tokens=16, prompt_tokens=37, message_tokens=7, block_size=16)
SEEDS = range(8)
#: Families whose prefill kernels give the same bits however the prompt is split: a hit equals the cold run.
SPLIT_INVARIANT = ["jamba", "lfm2"]
#: One family per mixer kind (Mamba-1, Mamba-2, gated delta net, KDA, short conv) for the stored-state checks.
MIXER_KINDS = ["jamba", "zamba2", "qwen3_next", "kimi_linear", "lfm2"]

_MODELS: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}


def bf16_models(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(model for caches, unpatched cold model), bf16, same weights; built once per session."""
    if family not in _MODELS:
        _MODELS[family] = build_model(family, dtype=torch.bfloat16), build_model(family, dtype=torch.bfloat16)
    return _MODELS[family]


@pytest.mark.parametrize("family", ["zamba2", "jamba", "qwen3_next", "lfm2"])
def test_bf16_chats_equal_a_cold_run_or_the_stock_path(family):
    model, cold = bf16_models(family)
    reply_hits = 0
    for seed in SEEDS:
        for number, turn in enumerate(chat(model, cold, seed, CHAT, replay=True, always_stock=False), 1):
            where = f"seed {seed}, turn {number}: hit {turn.hit_tokens} from the {turn.source}"
            reply_hits += turn.source == "reply"
            same_as_cold = turn.tokens_equal_cold and turn.logits_equal_cold
            if family in SPLIT_INVARIANT:
                assert same_as_cold, f"{where} differs from the cold run (max |dlogit| {turn.max_dlogit})"
            else:
                same_as_stock = turn.tokens_equal_stock and turn.logits_equal_stock
                assert same_as_cold or same_as_stock, f"{where} differs from the cold run and the stock path"
    assert reply_hits >= 10, "the chats must hit inside replies"


def test_bf16_replays_replies_by_default_without_sliding_layers():
    """Sliding-window layers continue a cache with other round-off than one forward anyway (README, Supported
    models); a replay adds a split that matches neither the cold run nor upstream's continuation, so it is off."""
    assert HybridPrefixCache(bf16_models("jamba")[0]).options.replay_replies is True
    assert HybridPrefixCache(build_model("lfm2", dtype=torch.float16)).options.replay_replies is True
    assert HybridPrefixCache(build_model("lfm3", dtype=torch.bfloat16)).options.replay_replies is False


@pytest.mark.parametrize("family", MIXER_KINDS)
def test_a_reply_hit_restores_what_a_cold_prefill_computes(family):
    """The regression: with decode-made entries, the states restored at the decode end were a bf16 ulp (conv, KV) or
    0.4-2% (SSM) away from a cold prefill's. Replayed, conv windows and KV are bit-identical; SSM states are too for
    Mamba-1, and within the chunked scans' fp32 round-off (measured <= 4e-7 of the largest element) otherwise."""
    model, cold = bf16_models(family)
    cache = HybridPrefixCache(model)
    ids = random_ids(37, seed=5)
    reply = greedy(model, ids, cache, new_tokens=27)[0]  # the model consumes 63 tokens: decode end at 48
    assert cache.stats.replayed_reply_tokens == 16  # from the prompt-end checkpoint at 32
    next_turn = torch.cat([reply, random_ids(5, seed=6)], dim=1)
    assert cache.restore(next_turn) == [48]
    ref = cold_states(cold, next_turn, 48)
    for m in cache.spec.mamba:
        live, expected = cache.layers[m.layer_idx], ref.layers[m.layer_idx]
        assert torch.equal(live.conv_states[m.state_idx], expected.conv_states[m.state_idx]), m.key
        ssm, expected_ssm = live.recurrent_states[m.state_idx], expected.recurrent_states[m.state_idx]
        if expected_ssm is None:  # a short conv
            continue
        atol = 0.0 if family == "jamba" else 1e-6 * expected_ssm.abs().max().item()
        torch.testing.assert_close(ssm, expected_ssm, rtol=0, atol=atol)
    for a in cache.spec.attention:
        keys, values = cache.layers[a.layer_idx].keys[..., :48, :], cache.layers[a.layer_idx].values[..., :48, :]
        assert torch.equal(keys, ref.layers[a.layer_idx].keys) and torch.equal(values, ref.layers[a.layer_idx].values)


def test_a_replayed_reply_is_stored_once():
    model, _ = bf16_models("jamba")
    cache = HybridPrefixCache(model)
    ids = random_ids(37, seed=7)
    first = greedy(model, ids, cache, new_tokens=27)[0]
    again = greedy(model, ids, cache, new_tokens=27)[0]
    assert torch.equal(first, again) and cache.last_hit_tokens == [32]
    assert cache.stats.replayed_reply_tokens == 16  # the second reply's blocks and checkpoint were stored already


@pytest.mark.parametrize("replay_replies,hits", [(True, [0, 32]), (False, [0, 48])])
def test_a_hit_leaves_two_tokens_to_the_prefill_in_bf16(replay_replies, hits):
    """A one-token tail would run the mixers' decode step (Jamba: first logits 0.03-0.04 off a cold run); so a
    49-token prompt re-run restores 32 tokens (the mandatory checkpoint at the last boundary <= L - 2) and replays 17
    through the prefill kernels, bit-identical to the cold run."""
    model, cold = bf16_models("jamba")
    cache = HybridPrefixCache(model, replay_replies=replay_replies)
    ids = random_ids(49, seed=8)
    got = []
    for _ in hits:
        seq, logits = greedy(model, ids, cache, new_tokens=2)
        got.append(cache.last_hit_tokens[0])
    assert got == hits
    if replay_replies:
        ref_seq, ref_logits = greedy(cold, ids, new_tokens=2)
        assert torch.equal(seq, ref_seq) and torch.equal(logits, ref_logits)


def test_a_batch_replays_each_row_from_before_its_batched_step():
    """Batch rows replay alone up to their last prompt token and meet in a batched (decode) step: each row's reply is
    replayed from the last boundary before that token, and the next turn of a row hits inside its reply exactly."""
    model, cold = bf16_models("jamba")
    cache = HybridPrefixCache(model)
    g = torch.Generator().manual_seed(9)
    rows = [torch.randint(6, VOCAB_SIZE, (n,), generator=g).tolist() for n in (37, 40)]
    ids = torch.tensor([[0] * 3 + rows[0], rows[1]])
    mask = torch.tensor([[0] * 3 + [1] * 37, [1] * 40])
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=27, min_new_tokens=27,
                         do_sample=False)
    # Row 0 consumed 37 + 26 tokens (decode end 48), row 1 40 + 26 (64); both replay from 32.
    assert cache.stats.replayed_reply_tokens == 16 + 32
    next_turn = torch.cat([out[1:], torch.randint(6, VOCAB_SIZE, (1, 5), generator=g)], dim=1)
    seq, logits = greedy(model, next_turn, cache)
    assert cache.last_hit_tokens == [64]
    ref_seq, ref_logits = greedy(cold, next_turn)
    assert torch.equal(seq, ref_seq) and torch.equal(logits, ref_logits)


def test_a_direct_forward_after_generate_continues_the_decoded_state():
    """The replay runs in fresh live layers: the request's own live state (decode-made, as a DynamicCache would hold
    it) is what a direct forward continues."""
    model, _ = bf16_models("jamba")
    cache = HybridPrefixCache(model)
    ids = random_ids(37, seed=10)
    seq = greedy(model, ids, cache, new_tokens=27)[0]
    past = DynamicCache(config=model.config)
    with torch.no_grad():
        model(seq[:, :37], past_key_values=past, use_cache=True)
        for t in range(37, seq.shape[1] - 1):
            model(seq[:, t : t + 1], past_key_values=past, use_cache=True)
        expected = model(seq[:, -1:], past_key_values=past, use_cache=True).logits
        got = model(seq[:, -1:], past_key_values=cache, use_cache=True).logits
    assert cache.get_seq_length() == seq.shape[1]
    assert torch.equal(got, expected)
