"""The bank of deterministic mode's tests (issue 46), shared by tests/test_deterministic*.py: how a family's toy is
run (:func:`run`, :func:`cold`), the cases a power test switches (:func:`hit_case`, :func:`decode_vs_prefill_case`,
:func:`engine_case`; True while the guarantee holds) and the case bodies every family's file repeats (hits vs cold,
decoded vs prefilled, a replayed chat, a padded batch, the engine at a chunk size, ...), each taking the family and
asserting with a message. How a family's toy is built stays test_deterministic.py's (:func:`fresh`), which also
re-exports these names for the family files that import them from there.
"""

import torch
from conftest import assert_restored_states_match
from engine_scenarios import finals, ids
from transformers import ContinuousBatchingConfig, GenerationConfig

from hf_hybridcache.engine import NgramDrafter, Speculation

GREEDY = dict(do_sample=False, pad_token_id=0)
BASE = ids(90, seed=4600)
#: Engine prompts: two share BASE's first 40 tokens (a hit inside the engine), the rest are new, of mixed lengths.
PROMPTS = [BASE[:40] + ids(n, seed=4610 + n) for n in (3, 12)] + [ids(n, seed=4620 + n) for n in (1, 17, 33, 50, 7, 24)]


def fresh(family, dtype, deterministic=True, **kwargs):
    """test_deterministic.py's ``fresh`` (``family``'s toy in ``dtype`` and a ``HybridPrefixCache`` over it, checkpoints
    dense), read at call time: how a family's toy is built stays there, beside the ``OVERRIDES`` table family files
    add to and the ``build_model`` LFM2's file patches (test_deterministic.py imports this module, so not at import)."""
    import test_deterministic

    return test_deterministic.fresh(family, dtype, deterministic, **kwargs)


def plain_toy(family):
    """``family``'s float32 toy as :func:`fresh` builds it, without a cache: the unpatched model."""
    import test_deterministic

    return test_deterministic.toy(family)


def run(model, cache, prompt, new_tokens=6, floor=True):
    """generate(): the new tokens and the raw logits of each step ``[n, V]``."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens if floor else None, output_logits=True,
                             return_dict_in_generate=True, **GREEDY)
    return out.sequences[0, len(prompt):].tolist(), torch.stack([step[0] for step in out.logits])


def cold(family, dtype, prompt, new_tokens=6, deterministic=True, floor=True):
    return run(*fresh(family, dtype, deterministic), prompt, new_tokens, floor)


def hit_case(family, dtype, deterministic=True) -> bool:
    model, cache = fresh(family, dtype, deterministic)
    first = run(model, cache, BASE)
    again = run(model, cache, BASE)
    assert cache.last_hit_tokens == [80]
    return first[0] == again[0] and torch.equal(first[1], again[1])


def decode_vs_prefill_case(family, dtype, deterministic=True) -> bool:
    """Reply token 3's logits, decoded, against the same position prefilled (BASE + the first 3 reply tokens)."""
    tokens, logits = cold(family, dtype, BASE, deterministic=deterministic)
    return torch.equal(logits[3], cold(family, dtype, BASE + tokens[:3], 1, deterministic)[1][0])


def engine_outputs(family, dtype, prompts, max_batch_tokens, deterministic=True):
    model, _ = fresh(family, dtype, deterministic)
    outputs = model.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=4, **GREEDY),
                                   continuous_batching_config=ContinuousBatchingConfig(
                                       max_batch_tokens=max_batch_tokens, return_logprobs=True))
    return [outputs[f"req_{i}"] for i in range(len(prompts))]


def logprobs(tokens, logits):
    """Each token's log-probability as the engine computes it (softmax of float32 logits, then log)."""
    return [torch.softmax(row.float(), -1)[t].log().item() for row, t in zip(logits, tokens)]


def engine_case(family, dtype, prompts=PROMPTS, max_batch_tokens=48, deterministic=True) -> bool:
    outputs = engine_outputs(family, dtype, prompts, max_batch_tokens, deterministic)
    for prompt, output in zip(prompts, outputs):
        assert output.error is None, output.error
        tokens, logits = cold(family, dtype, prompt, 4, deterministic, floor=False)
        if output.generated_tokens != tokens or list(output.logprobs) != logprobs(tokens, logits):
            return False
    return True


def speculative_case(family, dtype, new_tokens=12):
    """Drafts verified in one multi-token forward (n-gram drafts of repetitive prompts) give each request the tokens
    and logprobs of generate() alone."""
    loop = ids(10, seed=4640)
    prompts = [loop * 4 + ids(3, seed=4641), ids(20, seed=4642) + loop * 3, ids(33, seed=4643)]
    _, cache = fresh(family, dtype)
    manager = cache.init_continuous_batching(GenerationConfig(max_new_tokens=new_tokens, **GREEDY),
                                             ContinuousBatchingConfig(return_logprobs=True),
                                             speculation=Speculation(NgramDrafter(), 4))
    manager.start()
    try:
        names = manager.add_requests(prompts, max_new_tokens=new_tokens)
        outputs = finals(manager, names)
    finally:
        manager.stop()
    assert manager.batch_processor.speculator.stats.verify_segments > 0
    for name, prompt in zip(names, prompts):
        tokens, logits = cold(family, dtype, prompt, new_tokens, floor=False)
        assert outputs[name].generated_tokens == tokens
        assert list(outputs[name].logprobs) == logprobs(tokens, logits)


def hits_equal_cold(family, dtype, length):
    """After BASE stored a checkpoint at every block boundary up to 80, a prompt sharing its first ``length`` tokens
    hits the deepest boundary and gives cold's tokens and logits."""
    model, cache = fresh(family, dtype)
    run(model, cache, BASE)
    prompt = BASE[:length] + ids(7, seed=4601)
    tokens, logits = run(model, cache, prompt)
    assert cache.last_hit_tokens == [min(length, 80) // 16 * 16]
    ref_tokens, ref_logits = cold(family, dtype, prompt)
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)


def identical_prompt_and_decoded_tokens(family, dtype):
    assert hit_case(family, dtype)
    assert decode_vs_prefill_case(family, dtype)


def chat_with_the_reply_replayed(family, dtype, turns, first=BASE[:50], runner=run):
    """``turns`` chat turns from the prompt ``first``, each a reply of 9 tokens replayed with 5 new ones: each turn's
    blocks hit, and its tokens and logits are cold's. ``runner``: how generate() is called (:func:`run`'s
    arguments); a reply holding the pad token 0 is masked by :func:`run` (the turn then does not hit)."""
    model, cache = fresh(family, dtype, replay_replies=True)
    turn = first
    for n in range(turns):
        reply, _ = runner(model, cache, turn, new_tokens=9)
        turn = turn + reply + ids(5, seed=4630 + n)
        tokens, logits = runner(model, cache, turn)
        assert cache.last_hit_tokens[0] >= len(turn) - 5 - 9 - 16, f"turn {n + 2}: the reply {reply} did not hit"
        ref_tokens, ref_logits = runner(*fresh(family, dtype), turn)
        assert tokens == ref_tokens and torch.equal(logits, ref_logits), f"turn {n + 2}"


def padded_batch_rows(family, dtype, deterministic=True) -> list[bool]:
    """For each row of a left-padded generate() batch of 3 prompts: whether its tokens and logits are that prompt's
    alone."""
    prompts = [PROMPTS[i] for i in (3, 1, 6)]
    width = max(map(len, prompts))
    batch = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    model, cache = fresh(family, dtype, deterministic)
    with torch.no_grad():
        out = model.generate(batch, attention_mask=(batch != 0).long(), past_key_values=cache, max_new_tokens=5,
                             min_new_tokens=5, output_logits=True, return_dict_in_generate=True, **GREEDY)
    rows = []
    for row, prompt in enumerate(prompts):
        tokens, logits = cold(family, dtype, prompt, 5, deterministic)
        rows.append(out.sequences[row, width:].tolist() == tokens
                    and torch.equal(torch.stack([step[row] for step in out.logits]), logits))
    return rows


def padded_batch_rows_equal_each_alone(family, dtype):
    rows = padded_batch_rows(family, dtype)
    assert all(rows), f"rows {[row for row, equal in enumerate(rows) if not equal]} differ"


def engine_requests_equal_generate_alone(family, dtype, max_batch_tokens):
    """The engine's tokens and logprobs for 1, 3 and 8 concurrent requests (two of them hit each other's prefix)
    equal each one alone in generate()."""
    for prompts in (PROMPTS[:1], PROMPTS[2:5], PROMPTS):
        assert engine_case(family, dtype, prompts, max_batch_tokens), f"{len(prompts)} requests"


def engine_requests_hit_each_others_prefix(family):
    outputs = engine_outputs(family, torch.bfloat16, PROMPTS, 48)
    assert sorted(o.hit_tokens for o in outputs[:2]) == [0, 32]


def mode_is_the_model(family, prompt_tokens=40):
    """The deterministic forward computes the model: its float32 logits after BASE's first ``prompt_tokens`` are a
    plain forward's within round-off."""
    model, cache = fresh(family, torch.float32)
    plain = plain_toy(family)
    _, logits = run(model, cache, BASE[:prompt_tokens], new_tokens=1)
    with torch.no_grad():
        expected = plain(torch.tensor([BASE[:prompt_tokens]])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


def checkpoints_hold_upstream_states(family):
    """What the mode stores is what the default path stores: the states at a block boundary equal an unpatched
    model's within float32 round-off."""
    model, cache = fresh(family, torch.float32)
    run(model, cache, BASE)
    plain = plain_toy(family)
    assert_restored_states_match(cache, plain, torch.tensor([BASE[:70]]), expected_hit=64)


def ingredient_off_breaks(monkeypatch, module, off, case, family, dtype):
    """``case`` holds, and with ``off`` named in ``module``'s private ``_OFF`` alone it does not."""
    assert case(family, dtype)
    monkeypatch.setattr(module, "_OFF", {off})
    assert not case(family, dtype)


MODE_OFF_CASES = (decode_vs_prefill_case, engine_case, hit_case)


def mode_off_some_case_differs(family, dtype, cases=MODE_OFF_CASES):
    assert not all(case(family, dtype, deterministic=False) for case in cases)

