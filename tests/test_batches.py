"""Batches with left padding: every row restores its own hit and equals that row run alone, cold."""

import torch
from conftest import NEW_TOKENS, assert_matches_cold, greedy, random_ids

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache


def left_pad(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[1] :] = r[0]
        mask[i, width - r.shape[1] :] = 1
    return ids, mask


def assert_rows_match_cold(model, cold_model, cache, rows, new_tokens=NEW_TOKENS):
    ids, mask = left_pad(rows)
    out, logits = greedy(model, ids, cache, new_tokens, attention_mask=mask)
    for i, row in enumerate(rows):
        ref, ref_logits = greedy(cold_model, row, None, new_tokens)
        assert torch.equal(out[i, ids.shape[1] :], ref[0, row.shape[1] :]), f"row {i} differs from its cold run"
        torch.testing.assert_close(logits[i], ref_logits[0], rtol=0, atol=1e-4)
    return out


def test_three_rows_with_different_hits(model, cold_model):
    cache = HybridPrefixCache(model)
    trunk_a, trunk_b = random_ids(97, seed=100), random_ids(33, seed=101)
    assert_matches_cold(model, cold_model, cache, trunk_a)  # checkpoints at 96 (prompt end) and 112 (decode end)
    assert_matches_cold(model, cold_model, cache, trunk_b)  # checkpoints at 32 and 48
    rows = [
        torch.cat([trunk_a, random_ids(3, seed=102)], dim=1),  # 100 tokens
        torch.cat([trunk_a, random_ids(4, seed=103)], dim=1),  # 101 tokens
        torch.cat([trunk_b, random_ids(12, seed=104)], dim=1),  # 45 tokens
    ]
    assert_rows_match_cold(model, cold_model, cache, rows)
    assert cache.last_hit_tokens == [96, 96, 32]
    assert cache.stats.hit_tokens == 96 + 96 + 32


def test_rows_that_miss_hit_and_repeat(model, cold_model):
    cache = HybridPrefixCache(model)
    seen = random_ids(50, seed=110)
    assert_matches_cold(model, cold_model, cache, seen)
    rows = [random_ids(20, seed=111), seen, random_ids(1, seed=112), seen]
    assert_rows_match_cold(model, cold_model, cache, rows)
    assert cache.last_hit_tokens == [0, 48, 0, 48]


def test_batch_rows_are_stored_for_later_requests(model, cold_model):
    cache = HybridPrefixCache(model)
    rows = [random_ids(40, seed=120), random_ids(70, seed=121)]
    out = assert_rows_match_cold(model, cold_model, cache, rows)
    assert cache.last_hit_tokens == [0, 0]
    for i, row in enumerate(rows):  # each row's prompt-end checkpoint serves the same prompt alone
        assert_matches_cold(model, cold_model, cache, row)
        assert cache.last_hit_tokens == [((row.shape[1] - 1) // 16) * 16]
    # the second row's reply was stored during the batched decode: its next turn hits inside the reply
    width = out.shape[1] - NEW_TOKENS
    turn = torch.cat([rows[1], out[1:, width:], random_ids(5, seed=122)], dim=1)
    seq, logits = greedy(model, turn, cache, attention_mask=torch.ones_like(turn))  # the reply holds a pad id
    ref, ref_logits = greedy(cold_model, turn, attention_mask=torch.ones_like(turn))
    assert torch.equal(seq, ref)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    assert cache.last_hit_tokens == [80]


def test_single_left_padded_row(model, cold_model):
    cache = HybridPrefixCache(model)
    row = random_ids(50, seed=130)
    assert_matches_cold(model, cold_model, cache, row)
    ids, mask = left_pad([row, random_ids(60, seed=131)])
    out, logits = greedy(model, ids[:1], cache, attention_mask=mask[:1])
    ref, ref_logits = greedy(cold_model, row)
    assert torch.equal(out[0, ids.shape[1] :], ref[0, row.shape[1] :])
    torch.testing.assert_close(logits[0], ref_logits[0], rtol=0, atol=1e-4)
    assert cache.last_hit_tokens == [48]


def test_rows_whose_tokens_equal_the_pad_id_keep_storing(model, cold_model):
    # A row was taken as finished when the token fed to it equalled the pad id: a prompt ending with the pad id, or a
    # row generating it, stopped storing. generate()'s own stopping criteria now say which rows are finished.
    first = greedy(cold_model, random_ids(37, seed=460), None, new_tokens=1)[0][0, -1].item()
    rows = [random_ids(37, seed=460), torch.cat([random_ids(28, seed=461), torch.tensor([[first]])], dim=1)]
    ids, mask = left_pad(rows, pad_id=first)
    cache = HybridPrefixCache(model)
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=first)
    out = model.generate(ids, attention_mask=mask, **{CACHE_KWARG: cache}, **kwargs)
    for i, row in enumerate(rows):
        ref = cold_model.generate(row, attention_mask=torch.ones_like(row), **kwargs)  # the pad id is a real token
        assert torch.equal(out[i, ids.shape[1] :], ref[0, row.shape[1] :])
    # Row 0 generates the pad id first; row 1's prompt ends with it. Both ran 12 tokens past their prompts, so the
    # next turn of each reuses its reply up to the decode-end checkpoint (37 + 11 = 48; 29 + 11 = 40 -> 32).
    for i, (row, expected_hit) in enumerate(zip(rows, (48, 32))):
        follow = torch.cat([row, out[i : i + 1, ids.shape[1] :], random_ids(3, seed=462 + i)], dim=1)
        # Every token is real: a tiny model may also generate the config's pad id (Ling's picks 0), which generate()
        # would otherwise read as padding in the middle of the prompt and run without reuse.
        assert_matches_cold(model, cold_model, cache, follow, new_tokens=4, attention_mask=torch.ones_like(follow))
        assert cache.last_hit_tokens == [expected_hit]
