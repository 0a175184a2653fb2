"""Regression tests for bugs found by trying the package as a new user would."""

import copy
import io

import pytest
import torch
from conftest import assert_matches_cold, greedy, random_ids
from test_batches import left_pad

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache, _compat
from hf_hybridcache.core import check_store
from hf_hybridcache.toy import build_model


def pinned_blocks(cache):
    return {block.block_id: block.ref_count for block in cache.store.blocks() if block.ref_count}


def test_deep_copy_of_a_patched_model_runs_its_own_weights(model, cold_model, family):
    HybridPrefixCache(model)
    copied = copy.deepcopy(model)
    expected = build_model(family, seed=0)
    with torch.no_grad():
        copied.lm_head.weight.mul_(-1)
        expected.lm_head.weight.mul_(-1)
    ids = random_ids(30, seed=400)
    out = copied.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, expected.generate(ids, max_new_tokens=6, do_sample=False))
    cache = HybridPrefixCache(copied)  # the copy takes its own cache
    assert_matches_cold(copied, expected, cache, ids)
    assert_matches_cold(copied, expected, cache, ids)
    assert cache.last_hit_tokens == [16]


def test_patched_model_pickles(model):
    HybridPrefixCache(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    ids = random_ids(20, seed=401)
    assert torch.equal(loaded.generate(ids, max_new_tokens=4, do_sample=False),
                       model.generate(ids, max_new_tokens=4, do_sample=False))


def test_deep_copy_of_the_cache_is_refused_with_advice(model):
    cache = HybridPrefixCache(model)
    with pytest.raises(ValueError, match="pass the same HybridPrefixCache"):
        copy.deepcopy(cache)


def test_use_cache_false_stores_nothing(model, cold_model):
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(60, seed=402)
    model.generate(ids, **{CACHE_KWARG: cache}, use_cache=False, max_new_tokens=3, do_sample=False)
    assert (cache.stats.kv_blocks, cache.stats.checkpoints, cache.last_hit_tokens) == (0, 0, [0])
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [0]


@pytest.mark.parametrize("how", ["kwarg", "generation_config"])
def test_use_cache_false_generates_what_the_model_generates_without_a_cache(model, cold_model, how):
    # The live layers held state across the steps that each re-feed the whole sequence, so the tokens differed from
    # a run without the cache; a generation_config saying use_cache=False (common after gradient checkpointing) did
    # the same with no flag passed.
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(40, seed=420)
    greedy(model, ids, cache, new_tokens=3)  # entries stored and a live request holding state
    stored = (cache.stats.kv_blocks, cache.stats.checkpoints)
    kwargs = {"use_cache": False}
    if how == "generation_config":
        model.generation_config.use_cache = cold_model.generation_config.use_cache = False
        kwargs = {}
    try:
        seq, logits = greedy(model, ids, cache, new_tokens=6, **kwargs)
        ref_seq, ref_logits = greedy(cold_model, ids, None, new_tokens=6, **kwargs)
    finally:
        model.generation_config.use_cache = cold_model.generation_config.use_cache = True
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    assert (cache.stats.kv_blocks, cache.stats.checkpoints, cache.last_hit_tokens) == (*stored, [0])
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [32]


def test_direct_forward_with_use_cache_false_is_a_forward_without_the_cache(model, cold_model):
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(40, seed=421)
    greedy(model, ids, cache, new_tokens=3)
    stored = (cache.stats.kv_blocks, cache.stats.checkpoints)
    with torch.no_grad():
        logits = model(ids, **{CACHE_KWARG: cache}, use_cache=False).logits
        ref = cold_model(ids, use_cache=False).logits
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)
    assert (cache.stats.kv_blocks, cache.stats.checkpoints) == stored  # nothing tracked or stored
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [32]


def test_interrupted_batch_replay_leaves_nothing_pinned(model):
    cache = HybridPrefixCache(model)
    rows = [random_ids(80, seed=403), random_ids(40, seed=404)]
    model.generate(rows[0], **{CACHE_KWARG: cache}, max_new_tokens=2)
    calls = []

    def interrupt(module, args):
        calls.append(1)
        if len(calls) == 2:  # the second row's replay
            raise KeyboardInterrupt

    handle = model.register_forward_pre_hook(interrupt)
    ids, mask = left_pad([torch.cat([rows[0], random_ids(20, seed=405)], 1), rows[1]])
    with pytest.raises(KeyboardInterrupt):
        model.generate(ids, attention_mask=mask, **{CACHE_KWARG: cache}, max_new_tokens=2)
    handle.remove()
    assert pinned_blocks(cache) == {}
    model.generate(rows[1], **{CACHE_KWARG: cache}, max_new_tokens=2)
    cache.reset()
    assert pinned_blocks(cache) == {}


def test_float_attention_mask_on_a_padded_batch(model, cold_model):
    cache = HybridPrefixCache(model)
    ids, mask = left_pad([random_ids(30, seed=406), random_ids(12, seed=407)])
    out, logits = greedy(model, ids, cache, attention_mask=mask.float())
    ref, ref_logits = greedy(cold_model, ids, attention_mask=mask)
    assert torch.equal(out, ref)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)


def test_a_row_that_ends_early_keeps_its_decode_end_checkpoint(model, cold_model):
    """generate() feeds padding to rows that hit EOS; the row's reply, not the padding, is what the next turn reuses."""
    cache = HybridPrefixCache(model)
    first, other = random_ids(40, seed=408), random_ids(33, seed=409)
    ids, mask = left_pad([first, other])
    # The row's reply in this batch (a batched row may round differently from the row alone, and flip a near tie).
    reference = cold_model.generate(ids, attention_mask=mask, max_new_tokens=30, min_new_tokens=30, do_sample=False)
    reference = reference[0, ids.shape[1] :]
    eos = int(reference[11])
    stop_at = reference.tolist().index(eos) + 1  # tokens generated by the row, EOS included
    # min_new_tokens kept the model's own EOS (id 2) out of the reference; it stays out here too.
    out = model.generate(ids, attention_mask=mask, **{CACHE_KWARG: cache}, max_new_tokens=30, do_sample=False,
                         eos_token_id=eos, pad_token_id=0, suppress_tokens=[2])
    reply = out[0, ids.shape[1] : ids.shape[1] + stop_at]
    turn = torch.cat([first, reply[None], random_ids(5, seed=410)], dim=1)
    assert_matches_cold(model, cold_model, cache, turn, attention_mask=torch.ones_like(turn))
    seen = 40 + stop_at  # the next step still feeds the row its EOS (the other row decodes on), then padding
    assert cache.last_hit_tokens == [(seen // 16) * 16]


def test_seed_must_be_bytes(model):
    for seed in ("abc", 123):
        with pytest.raises(ValueError, match="`seed` must be bytes"):
            HybridPrefixCache(model, seed=seed)
    assert HybridPrefixCache(model, seed=b"abc").block_size == 16


def test_backbone_call_gets_a_clear_error(model):
    cache = HybridPrefixCache(model)
    with pytest.raises(ValueError, match="backbone"):
        backbone = model.base_model  # Mamba's: model.backbone, whose forward takes cache_params on 5.23
        backbone(random_ids(10, seed=411), **{_compat.cache_kwarg(backbone): cache}, use_cache=True)


def test_direct_forward_with_gradients(model, cold_model, family):
    """A forward with autograd on (e.g. scoring or training code) takes the differentiable scan."""
    cache = HybridPrefixCache(model)
    ids = random_ids(40, seed=412)
    logits = model(ids, **{CACHE_KWARG: cache}, use_cache=True).logits
    logits[0, -1].sum().backward()
    with torch.no_grad():
        reference = cold_model(ids).logits
    torch.testing.assert_close(logits.detach(), reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("eviction", ["lru", "flop_aware"])
@pytest.mark.parametrize("family", ["jamba"])
def test_tight_budget_keeps_a_checkpoint_instead_of_kv_no_hit_can_use(model, cold_model, eviction):
    """A budget of one checkpoint plus three KV blocks: a 64-token prompt used to store all 4 of its KV blocks first,
    and then none of its checkpoints fitted (its own pinned blocks cannot be evicted), so an identical re-run never
    hit. KV past the deepest block whose checkpoint can fit next to its chain serves no hit; not storing it leaves
    room for the prompt-end checkpoint at 48 (the last boundary below the prompt length)."""
    cache = HybridPrefixCache(model, block_size=16, eviction=eviction)
    cache.max_cache_bytes = 3 * cache.spec.kv_block_bytes + cache.spec.checkpoint_bytes
    ids = random_ids(64, seed=5)
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
    assert (cache.stats.kv_blocks, cache.stats.checkpoints) == (3, 1)
    assert_matches_cold(model, cold_model, cache, ids, new_tokens=4)
    assert cache.last_hit_tokens == [48]
    check_store(cache)



def test_divergence_checkpoints_count_only_what_admission_added(model, cold_model, tmp_path):
    """A path stored without retention, then loaded with dense retention: the next prompt diverges at 288, where dense
    retention keeps a checkpoint anyway, so the stat must not count it as admitted (it did)."""
    trunk = random_ids(300, seed=70)
    prompts = [torch.cat([trunk, random_ids(30, seed=71 + i)], dim=1) for i in range(3)]
    cache = HybridPrefixCache(model, retention_interval=0)
    assert_matches_cold(model, cold_model, cache, prompts[0], 4)
    cache.save(tmp_path / "cache")
    cache = HybridPrefixCache.load(tmp_path / "cache", model, retention_interval="dense")
    hits = []
    for ids in prompts[1:]:
        assert_matches_cold(model, cold_model, cache, ids, 4)
        hits.append(cache.last_hit_tokens[0])
    assert hits == [0, 288]
    assert cache.stats.divergence_checkpoints == 0


def test_reset_from_a_running_call_fails_fast(model, cold_model):
    """reset() from a streamer of a running generate() emptied the call's live layers, so the rest of the call
    decoded from an empty state and its output differed from the cold run with no error."""
    cache = HybridPrefixCache(model)
    ids = random_ids(50, seed=531)
    caught = []

    class ResettingStreamer:
        def put(self, value):
            if not caught:
                with pytest.raises(RuntimeError, match="generate"):
                    cache.reset()
                caught.append(True)

        def end(self):
            pass

    out, _ = greedy(model, ids, cache, streamer=ResettingStreamer())
    assert caught, "the streamer was never called"
    assert torch.equal(out, greedy(cold_model, ids)[0])
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [48]


def test_training_forward_with_gradient_checkpointing_stores_nothing_and_matches(model, cold_model):
    # model.train() + activation (gradient) checkpointing crashed with an internal TypeError (the layers drop the cache),
    # and a training forward could store states computed with dropout for later eval requests.
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(40, seed=430)
    greedy(model, ids, cache, new_tokens=3)
    cache.reset()  # the next forward starts a request of its own, as a fresh cache would
    stored = (cache.stats.kv_blocks, cache.stats.checkpoints)
    for m in (model, cold_model):
        m.train()
        m.activation_checkpointing_enable()  # gradient_checkpointing_enable's name from transformers 5.23 on
    try:
        train_ids = random_ids(40, seed=432)  # not stored yet: storing it would need the dropped live KV
        loss = model(train_ids, **{CACHE_KWARG: cache}, labels=train_ids).loss
        ref = cold_model(train_ids, labels=train_ids).loss
        loss.backward()
    finally:
        for m in (model, cold_model):
            m.activation_checkpointing_disable()
            m.eval()
            m.zero_grad(set_to_none=True)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-5)
    assert (cache.stats.kv_blocks, cache.stats.checkpoints) == stored
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [32]


def test_forward_with_grad_enabled_stores_detached_entries(model, cold_model):
    # Stored entries kept their autograd graphs (grad_fn set), pinning the forward's activations.
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(40, seed=431)
    logits = model(ids, **{CACHE_KWARG: cache}, use_cache=True).logits
    assert logits.requires_grad and cache.stats.kv_blocks == 2 and cache.stats.checkpoints >= 1
    blocks, _ = cache.store.export_entries()
    tensors = [t for block in blocks for pair in block.kv.values() for t in pair]
    tensors += [t for block in blocks if block.checkpoint for state in block.checkpoint.values() for t in state]
    assert tensors and not any(t.requires_grad or t.grad_fn is not None for t in tensors)
    assert_matches_cold(model, cold_model, cache, ids)
    assert cache.last_hit_tokens == [32]


def test_repr_shows_the_options_and_the_budget(model):
    # repr(cache) showed only transformers' list of live layers.
    cache = HybridPrefixCache(model, retention_interval=32, max_cache_bytes=2**26)
    greedy(model, random_ids(40, seed=440), cache, new_tokens=2)
    text = repr(cache.with_salt("tenant"))
    assert text.startswith(f"HybridPrefixCache({type(model).__name__}, block_size=16, retention_interval=32, ")
    assert f"salt='tenant', stored_bytes={cache.stored_bytes}, max_cache_bytes={2**26})" in text
    assert cache.stored_bytes > 0


def test_restore_then_a_decoding_loop_of_direct_forwards_matches_cold(model, cold_model):
    # Bamba numbered positions from 0 in a direct forward without position_ids, whatever the cache held: a loop of
    # direct forwards after restore() ran and stored KV at the wrong rotary positions, and generate() served it.
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(40, seed=450)
    greedy(model, ids, cache, new_tokens=2)
    prompt = torch.cat([ids[:, :36], random_ids(5, seed=451)], dim=1)
    hit = cache.restore(prompt)[0]
    assert hit == 32
    with torch.no_grad():
        logits = model(prompt[:, hit:], **{CACHE_KWARG: cache}, use_cache=True).logits[:, -1]
        tokens = prompt
        for _ in range(4):
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
            logits = model(tokens[:, -1:], **{CACHE_KWARG: cache}, use_cache=True).logits[:, -1]
        ref = cold_model(tokens).logits[:, -1]
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)
    # What the loop stored serves generate() exactly. The mask says every token is real: a tiny model may pick the
    # pad id, which generate() would otherwise read as padding in the middle of the prompt.
    assert_matches_cold(model, cold_model, cache, tokens, attention_mask=torch.ones_like(tokens))
    assert cache.last_hit_tokens == [32]


def test_restore_refuses_ids_that_are_not_a_batch(model):
    cache = HybridPrefixCache(model)
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        cache.restore(random_ids(20, seed=452)[0])
    greedy(model, random_ids(20, seed=452), cache, new_tokens=2)


@pytest.mark.parametrize("family", ["jamba", "qwen3_5_text", "bailing_hybrid", "zaya"])
def test_a_hit_writes_the_prompt_tail_after_the_restored_kv_in_place(model, cold_model):
    # A hit's full attention layers are restored into buffers with room for the prompt's tail, which the layer's
    # update then writes after the prefix instead of concatenating (a second copy of the prefix per layer). Decoding
    # past the room concatenates as transformers does. Exact either way.
    cache = HybridPrefixCache(model, retention_interval="dense")
    ids = random_ids(40, seed=460)
    greedy(model, ids, cache, new_tokens=2)
    prompt = torch.cat([ids[:, :36], random_ids(5, seed=461)], dim=1)
    assert cache.restore(prompt) == [32]
    layer = cache.layers[next(a.layer_idx for a in cache.spec.attention if a.sliding_window is None)]
    restored = layer.keys.data_ptr()
    with torch.no_grad():
        logits = model(prompt[:, 32:], **{CACHE_KWARG: cache}, use_cache=True).logits[:, -1]
        assert layer.keys.shape[-2] == 41 and layer.keys.data_ptr() == restored
        torch.testing.assert_close(logits, cold_model(prompt).logits[:, -1], rtol=0, atol=1e-4)
        tokens = torch.cat([prompt, logits.argmax(-1, keepdim=True)], dim=1)
        logits = model(tokens[:, -1:], **{CACHE_KWARG: cache}, use_cache=True).logits[:, -1]
        assert layer.keys.shape[-2] == 42 and layer.keys.data_ptr() != restored
        torch.testing.assert_close(logits, cold_model(tokens).logits[:, -1], rtol=0, atol=1e-4)


def test_a_pad_id_inside_a_prompt_warns_of_no_weights_change(model, cold_model, caplog):
    """A prompt holding the pad id with no mask is not cacheable (generate() masks the id), and its row stores
    nothing: it once started with weights generation 0, and the first weights check called it stale and logged "The
    model's weights changed while requests ran" though nothing had changed."""
    cache = HybridPrefixCache(model)
    assert_matches_cold(model, cold_model, cache, random_ids(40, seed=404))  # the weights are read once
    ids = random_ids(40, seed=405)
    ids[0, 20] = 0  # the pad id
    with caplog.at_level("WARNING", logger="hf_hybridcache"):
        out = model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, cold_model.generate(ids, max_new_tokens=8, do_sample=False))
    assert cache.last_hit_tokens == [0]
    assert not [r for r in caplog.records if "weights changed" in r.getMessage()]
