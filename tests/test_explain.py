"""Why a request hit what it hit: every reason of a HitReport comes out for a scenario built to produce it, on a
Mamba family (Jamba), a gated delta net family (Qwen3.5) and a short-conv family (LFM2); ``cache.explain()`` predicts
the report (and hit) of the ``generate()`` that follows, for one prompt, a batch, a salt and a remote tier, and
changes nothing a later request could notice."""

import logging

import pytest
import torch
from conftest import random_ids

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.core import HITS_LOGGER, REASONS, HitReport
from hf_hybridcache.remote import RemoteConfig
from hf_hybridcache.toy import build_model

EXPLAIN_FAMILIES = pytest.mark.parametrize("family", ["jamba", "qwen3_5_text", "lfm2"])
SHARED = random_ids(48, seed=700)  # three blocks several prompts start with


def with_shared(tail_seed: int, tail: int = 30) -> torch.Tensor:
    return torch.cat([SHARED, random_ids(tail, seed=tail_seed)], dim=1)


def run(model, cache, ids, new_tokens: int = 2, **kwargs) -> torch.Tensor:
    return model.generate(
        ids, **{CACHE_KWARG: cache}, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs
    )


def explained_run(model, cache, ids, reason: str, hit: int, **kwargs) -> tuple[HitReport, torch.Tensor]:
    """``cache.explain(ids)`` says ``reason`` and ``hit``, and the ``generate()`` that follows reports the same."""
    report = cache.explain(ids)
    assert (report.reason, report.hit_tokens) == (reason, hit), report
    out = run(model, cache, ids, **kwargs)
    assert cache.last_report == report and cache.last_reports == [report]
    assert cache.last_hit_tokens == [hit]
    return report, out


@EXPLAIN_FAMILIES
def test_first_request_full_hit_and_next_chat_turn(model):
    cache = HybridPrefixCache(model)
    ids = random_ids(70, seed=701)
    first, _ = explained_run(model, cache, ids, "new_tokens", 0)
    assert (first.prompt_tokens, first.kv_tokens, first.checkpoint_tokens) == (70, 0, 0)
    assert "holds nothing yet" in first.detail

    again, out = explained_run(model, cache, ids, "complete", 64, new_tokens=20)
    assert (again.kv_tokens, again.checkpoint_tokens) == (64, 64)
    # 70 + 20 tokens: the model saw 89, so the reply's blocks reach 80 and its decode-end checkpoint sits there.
    turn = torch.cat([out, random_ids(20, seed=702)], dim=1)
    report, _ = explained_run(model, cache, turn, "new_tokens", 80)
    assert report.kv_tokens == 80 and "stored path ends at 80 tokens" in report.detail

    other = random_ids(40, seed=703)
    report, _ = explained_run(model, cache, other, "new_tokens", 0)
    assert "no stored prompt under this salt and these weights starts with" in report.detail


@EXPLAIN_FAMILIES
def test_too_short(model):
    cache = HybridPrefixCache(model)
    ids = random_ids(17, seed=704)
    run(model, cache, ids)
    report, _ = explained_run(model, cache, ids[:, :16], "too_short", 0)
    assert "block_size + 1 = 17" in report.detail
    explained_run(model, cache, ids, "complete", 16)


@EXPLAIN_FAMILIES
def test_not_cacheable(model):
    cache = HybridPrefixCache(model)
    ids = random_ids(40, seed=705)
    run(model, cache, ids)
    mask = torch.ones_like(ids)
    mask[0, 20] = 0  # padding inside the prompt
    report = cache.explain(ids, attention_mask=mask)
    assert (report.reason, report.hit_tokens, report.prompt_tokens) == ("not_cacheable", 0, 39)
    run(model, cache, ids, attention_mask=mask)
    assert cache.last_report == report and "left-pad" in report.detail

    run(model, cache, ids, use_cache=False)
    assert cache.last_report.reason == "not_cacheable" and "use_cache=False" in cache.last_report.detail
    model.train()
    try:
        explained_run(model, cache, ids, "complete", 32)  # training mode with every dropout at 0: reused as in eval
        model.extra_dropout = torch.nn.Dropout(0.1)  # a dropout module in training mode: forwards are random now
        report = cache.explain(ids)
        assert report.reason == "not_cacheable" and "dropout" in report.detail and "model.eval()" in report.detail
        run(model, cache, ids)
        assert cache.last_report == report
    finally:
        del model.extra_dropout
        model.eval()
    explained_run(model, cache, ids, "complete", 32)


@EXPLAIN_FAMILIES
def test_no_checkpoint_then_diverged(model):
    cache = HybridPrefixCache(model)
    run(model, cache, with_shared(706))
    # The second prompt shares 48 tokens, where no checkpoint was kept (retention 0): its KV chain matches, its hit
    # is 0, and it admits a checkpoint at the divergence point, so the third one hits there.
    report, _ = explained_run(model, cache, with_shared(707), "no_checkpoint", 0)
    assert (report.kv_tokens, report.checkpoint_tokens) == (48, 0)
    assert "keeps one at 48" in report.detail
    report, _ = explained_run(model, cache, with_shared(708), "diverged", 48)
    assert (report.kv_tokens, report.checkpoint_tokens) == (48, 48)
    assert "leaves the stored path at 48 tokens" in report.detail


@EXPLAIN_FAMILIES
def test_no_checkpoint_inside_a_stored_prompt(model):
    cache = HybridPrefixCache(model)
    ids = random_ids(90, seed=709)
    run(model, cache, ids)  # checkpoints at 80 only (prompt end and decode end)
    report, _ = explained_run(model, cache, ids[:, :60], "no_checkpoint", 0)
    assert report.kv_tokens == 48 and "retention_interval='dense'" in report.detail
    # The prompt-end checkpoints of the shorter prompt are kept now: the same prompt hits in full.
    explained_run(model, cache, ids[:, :60], "complete", 48)


@EXPLAIN_FAMILIES
def test_weights_changed(model):
    cache = HybridPrefixCache(model)
    ids = random_ids(70, seed=710)
    run(model, cache, ids)
    weight = model.get_output_embeddings().weight
    with torch.no_grad():
        weight.add_(0.01)
    report = cache.explain(ids)
    assert (report.reason, report.hit_tokens, report.kv_tokens) == ("weights_changed", 0, 0)
    assert "a hit of 64 tokens is stored under the weights or adapters in use 1 weights change ago" in report.detail
    with torch.no_grad():
        weight.add_(0.01)
    report, _ = explained_run(model, cache, ids, "weights_changed", 0)
    assert "in use 2 weights changes ago" in report.detail


@EXPLAIN_FAMILIES
def test_weights_changed_and_back(model):
    cache = HybridPrefixCache(model)
    ids = random_ids(70, seed=711)
    run(model, cache, ids)
    weight = model.get_output_embeddings().weight
    original = weight.detach().clone()
    with torch.no_grad():
        weight.add_(0.01)
    explained_run(model, cache, ids, "weights_changed", 0)
    with torch.no_grad():
        weight.copy_(original)
    explained_run(model, cache, ids, "complete", 64)


@EXPLAIN_FAMILIES
def test_evicted(model):
    cache = HybridPrefixCache(model)
    spec = cache.spec
    ids = random_ids(70, seed=712)
    run(model, cache, ids)  # 4 KV blocks and the checkpoint at 64
    cache.max_cache_bytes = 4 * spec.kv_block_bytes + spec.checkpoint_bytes - 1  # the checkpoint has to go
    report = cache.explain(ids)
    assert (report.reason, report.hit_tokens, report.kv_tokens) == ("evicted", 0, 64), report
    assert report.detail.startswith("the checkpoint at 64 tokens was evicted 1 request ago when max_cache_bytes "
                                    "was lowered")
    assert "eviction='flop_aware'" not in report.detail  # it is the default


    # A budget of one prompt: the next prompts push out the first one's checkpoint and blocks.
    model = build_model(model.config.model_type, seed=0)
    cache = HybridPrefixCache(model, max_cache_bytes=4 * spec.kv_block_bytes + spec.checkpoint_bytes)
    run(model, cache, ids)
    run(model, cache, random_ids(70, seed=713))
    run(model, cache, random_ids(70, seed=714))
    assert cache.stats.evicted_kv_blocks >= 4
    report, _ = explained_run(model, cache, ids, "evicted", 0)
    assert report.kv_tokens == 0
    budget = f"{cache.max_cache_bytes:,} bytes"
    assert report.detail == (
        f"the KV blocks and the checkpoint at 64 tokens were evicted 2 requests ago to stay under max_cache_bytes "
        f"({budget}); raise it, or keep fewer checkpoints per prompt (a larger retention_interval) so that more "
        "prompts fit."
    )


@pytest.mark.parametrize("family", ["jamba"])
def test_evicted_under_lru_names_flop_aware(model):
    cache = HybridPrefixCache(model, eviction="lru")
    spec = cache.spec
    ids = random_ids(70, seed=715)
    run(model, cache, ids)
    cache.max_cache_bytes = 4 * spec.kv_block_bytes + spec.checkpoint_bytes - 1
    run(model, cache, random_ids(70, seed=716))
    report, _ = explained_run(model, cache, ids, "evicted", 0)
    assert report.detail.endswith("raise it or use eviction='flop_aware'.")


# ---------------------------------------------------------------------- batches and salts


@EXPLAIN_FAMILIES
@pytest.mark.parametrize("retention", [0, "dense"])
def test_batch_explain_predicts_every_row(model, retention):
    cache = HybridPrefixCache(model, retention_interval=retention)
    run(model, cache, random_ids(40, seed=717))
    # Rows share a prefix nothing stores yet: in generate() each row replays after the rows before it stored theirs.
    rows = [with_shared(718), with_shared(719, tail=20), with_shared(718), random_ids(50, seed=720),
            with_shared(721, tail=40)]
    width = max(row.shape[1] for row in rows)
    ids = torch.stack([torch.nn.functional.pad(row[0], (width - row.shape[1], 0)) for row in rows])
    mask = torch.stack([torch.arange(width) >= width - row.shape[1] for row in rows]).long()
    reports = cache.explain(ids, attention_mask=mask)
    run(model, cache, ids, attention_mask=mask)
    assert cache.last_reports == reports
    assert [r.hit_tokens for r in reports] == cache.last_hit_tokens
    if retention == 0:
        assert [r.reason for r in reports] == ["new_tokens", "no_checkpoint", "new_tokens", "new_tokens", "diverged"]
    assert reports[2] == reports[0]  # a repeated row shares the first one's hit


@EXPLAIN_FAMILIES
def test_salted_explain_predicts_the_salted_view(model):
    cache = HybridPrefixCache(model)
    ids = random_ids(70, seed=722)
    alice = cache.with_salt("alice")
    run(model, alice, ids)
    assert cache.explain(ids).reason == "new_tokens"  # another tenant's prefix is not this view's
    report = cache.explain(ids, salt="alice")
    assert report == alice.explain(ids) and (report.reason, report.hit_tokens) == ("complete", 64)
    run(model, alice, ids)
    assert alice.last_report == report and cache.last_report is None


def test_explain_refuses_bad_input_and_the_cache_stays_usable():
    model = build_model("jamba", seed=0)
    cache = HybridPrefixCache(model)
    with pytest.raises(ValueError, match="non-empty string naming the tenant"):
        cache.explain(random_ids(20, seed=723), salt="")
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        cache.explain(torch.tensor([[1, 2, 10**6]]))
    with pytest.raises(ValueError, match="The prompt is empty"):
        cache.explain([])
    ids = random_ids(40, seed=724)
    run(model, cache, ids)
    assert cache.explain(ids[0].tolist()) == cache.explain(ids[0]) == cache.explain(ids)
    assert cache.explain(ids).reason == "complete"


# ---------------------------------------------------------------------- changes nothing


def _observed(cache) -> tuple:
    store = cache.store
    return cache.stored_bytes, store.candidates(), cache.stats, store.stored_ids()


@pytest.mark.parametrize("family", ["jamba", "lfm2"])
def test_explain_changes_nothing_a_later_request_sees(family):
    # Two caches of identical models serve the same requests under a budget that evicts; one is asked to explain
    # between every two requests (old prompts too, whose entries a touch would keep from eviction). Everything either
    # shows — bytes, the eviction order, counters, each request's report — stays the same.
    caches = []
    for _ in range(2):
        model = build_model(family, seed=0)
        cache = HybridPrefixCache(model, retention_interval=32)
        cache.max_cache_bytes = 12 * cache.spec.kv_block_bytes + 4 * cache.spec.checkpoint_bytes
        caches.append((model, cache))
    prompts = [with_shared(730 + i, tail=20 + 7 * i) for i in range(4)] + [random_ids(60, seed=735)]
    requests = prompts + [prompts[0], prompts[3], prompts[1], prompts[4], prompts[0]]
    asked = []
    for ids in requests:
        model, cache = caches[1]
        before = _observed(cache)
        asked.append(cache.explain(ids))
        for other in prompts[:3]:
            cache.explain(other)
        cache.explain(torch.cat([with_shared(736, tail=20), prompts[0]]))
        assert _observed(cache) == before
        for model, cache in caches:
            run(model, cache, ids)
        assert _observed(caches[0][1]) == _observed(caches[1][1])
        assert caches[0][1].last_reports == caches[1][1].last_reports == [asked[-1]]
    assert len({r.reason for r in asked}) >= 4, asked


def test_misses_by_reason_and_the_log_line(caplog):
    model = build_model("jamba", seed=0)
    cache = HybridPrefixCache(model)
    ids = random_ids(70, seed=740)
    with caplog.at_level(logging.INFO, logger=HITS_LOGGER):
        run(model, cache, ids)
        run(model, cache, ids)
        run(model, cache, torch.cat([ids, ids]))  # a batch of two rows counts twice
        run(model, cache, ids[:, :10])
    stats = cache.stats
    assert list(stats.misses_by_reason) == list(REASONS)
    assert {k: v for k, v in stats.misses_by_reason.items() if v} == {"new_tokens": 1, "complete": 3, "too_short": 1}
    assert sum(stats.misses_by_reason.values()) == stats.requests + 1
    lines = [r.getMessage() for r in caplog.records if r.name == HITS_LOGGER]
    assert lines[0].startswith("request 1: hit 0 of 70 prompt tokens, new_tokens: the cache holds nothing yet")
    assert lines[1].startswith("request 2: hit 64 of 70 prompt tokens, complete: ")
    assert lines[2].startswith("request 3 row 0: hit 64") and lines[3].startswith("request 3 row 1: hit 64")
    assert lines[4].startswith("request 4: hit 0 of 10 prompt tokens, too_short: ") and len(lines) == 5
    cache.explain(ids)
    assert cache.stats == stats  # a dry run counts nothing


# ---------------------------------------------------------------------- the remote tier


def _tier_contents(server) -> dict:
    client = server.client()
    return {key: client.get(key) for key in client.keys("*")}


@EXPLAIN_FAMILIES
def test_remote_explain_predicts_fetch_and_recompute(server, family):
    server.client().flushall()
    ids = random_ids(70, seed=741)
    writer_model = build_model(family, seed=0)
    writer = HybridPrefixCache(writer_model, remote=server.url)
    run(writer_model, writer, ids)
    assert writer.remote.flush(30)

    # A process whose fetch rule says recomputing is faster: the tier holds a hit of 64 tokens and it is left there.
    model = build_model(family, seed=0)
    slow = HybridPrefixCache(model, remote=RemoteConfig(server.url, min_flops_per_byte=1e30))
    assert slow.explain(ids).reason == "new_tokens"  # the local store alone
    tier, stats = _tier_contents(server), slow.stats
    report = slow.explain(ids, remote=True)
    assert (report.reason, report.hit_tokens, report.kv_tokens, report.checkpoint_tokens) == (
        "remote_recomputed", 0, 64, 64)
    assert _tier_contents(server) == tier and slow.stats == stats  # the tier was read, and nothing shows it
    run(model, slow, ids)
    assert slow.last_report == report and slow.stats.remote_recomputed_tokens == 64

    # A process that fetches: explain(remote=True) predicts the hit the tier supplies.
    model = build_model(family, seed=0)
    fetching = HybridPrefixCache(model, remote=server.url)
    report = fetching.explain(ids, remote=True)
    assert (report.reason, report.hit_tokens) == ("complete", 64)
    assert fetching.stats.remote_round_trips == 0 and fetching.stats.remote_hit_tokens == 0
    assert fetching.remote.client.rate.latency_s is None  # the EXISTS fed no latency sample to the fetch rule
    run(model, fetching, ids)
    assert fetching.last_report == report and fetching.stats.remote_hit_tokens == 64


def test_bf16_reports_leave_two_tokens_to_the_tail():
    """With ``replay_replies`` (bf16) a hit leaves two tokens to run: a 49-token prompt re-run restores 32 tokens, and
    that is ``complete``; a 17-token prompt is too short (a block plus two tokens). ``explain()`` predicts both."""
    model = build_model("jamba", dtype=torch.bfloat16)
    cache = HybridPrefixCache(model)
    assert cache.options.replay_replies
    ids = random_ids(49, seed=720)
    explained_run(model, cache, ids, "new_tokens", 0)
    report, _ = explained_run(model, cache, ids, "complete", 32)
    assert report.kv_tokens == 48
    short = random_ids(17, seed=721)
    explained_run(model, cache, short, "too_short", 0)
