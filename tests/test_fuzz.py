"""Property-based test: random sequences of operations on one cache — prompts sharing random prefixes, chat turns,
batches, salts, clear, save/load, budget changes — with every output checked against a cold run and DESIGN.md's
invariants checked after every step.

CI runs a fixed, bounded set of examples; ``HF_HYBRIDCACHE_FUZZ_EXAMPLES=500`` runs more, with fresh randomness.
"""

import os

import torch
from conftest import greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_batches import left_pad

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.core import check_store, entry_digests
from hf_hybridcache.toy import VOCAB_SIZE, build_model

EXAMPLES = int(os.environ.get("HF_HYBRIDCACHE_FUZZ_EXAMPLES", "0"))
FAMILY = "jamba"
TRUNK_TOKENS = 72
_MODELS: dict[str, torch.nn.Module] = {}


def _models():
    """(the model every cache patches, an unpatched twin for cold runs), built once."""
    if not _MODELS:
        _MODELS["model"], _MODELS["cold"] = build_model(FAMILY, seed=0), build_model(FAMILY, seed=0)
    return _MODELS["model"], _MODELS["cold"]


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(6, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


TRUNKS = [_tokens(TRUNK_TOKENS, seed=700 + i) for i in range(3)]

# A prompt: a prefix of one of a few shared trunks, then fresh tokens (at least one token in all). The lengths are
# drawn from lists because hypothesis favours small integers, and short prompts share no block.
prompts = st.builds(
    lambda trunk, shared, fresh, seed: TRUNKS[trunk][:shared] + _tokens(fresh if shared else fresh + 1, seed),
    st.integers(0, len(TRUNKS) - 1),
    st.sampled_from([TRUNK_TOKENS, 64, 48, 33, 20, 8, 0]),
    st.sampled_from([9, 1, 20, 4, 0]),
    st.integers(0, 10_000),
)
new_tokens = st.integers(1, 6)
salts = st.sampled_from([None, None, "tenant-a"])
ARGUMENTS = {
    "generate": st.tuples(prompts, new_tokens, salts),
    "chat": st.tuples(st.sampled_from([5, 12, 1]), new_tokens, st.integers(0, 10_000)),
    "batch": st.tuples(st.lists(prompts, min_size=2, max_size=3), new_tokens),
    "clear": st.tuples(),
    "save_load": st.tuples(st.none() | st.sampled_from([24, 6, 1])),
    "budget": st.tuples(st.sampled_from([30, 12, 4, 1])),
}
# Requests three times as often as the other operations.
operations = st.sampled_from(["generate", "chat"] * 3 + ["batch", "clear", "save_load", "budget"]).flatmap(
    lambda kind: ARGUMENTS[kind].map(lambda args: (kind, *args))
)


def _budget(cache, num_blocks: int) -> int:
    """A budget of about ``num_blocks`` KV blocks plus a checkpoint per four blocks (at least the minimum)."""
    return num_blocks * cache.spec.kv_block_bytes + (num_blocks // 4 + 1) * cache.spec.checkpoint_bytes


class Run:
    """One example's state: the cache under test, the last single-row sequence (for chat turns), digests."""

    def __init__(self, cache, tmp_dir):
        self.cache, self.tmp_dir = cache, tmp_dir
        self.model, self.cold = _models()
        self.last_sequence: list[int] | None = None
        self.digests = check_store(cache)

    def generate(self, ids: list[int], num_new: int, salt):
        view = self.cache if salt is None else self.cache.with_salt(salt)
        tensor = torch.tensor([ids])
        mask = torch.ones_like(tensor)  # replies may hold the pad id; it is a real token here
        seq, logits = greedy(self.model, tensor, view, num_new, attention_mask=mask)
        ref_seq, ref_logits = greedy(self.cold, tensor, None, num_new, attention_mask=mask)
        hit = view.last_hit_tokens[0]
        assert torch.equal(seq, ref_seq), f"tokens differ from the cold run (hit {hit} of {len(ids)})"
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
        assert hit % self.cache.block_size == 0 and hit <= len(ids) - 1
        self.last_sequence = seq[0].tolist() if salt is None else None

    def batch(self, rows: list[list[int]], num_new: int):
        ids, mask = left_pad([torch.tensor([row]) for row in rows])
        out, logits = greedy(self.model, ids, self.cache, num_new, attention_mask=mask)
        for i, row in enumerate(rows):
            ref, ref_logits = greedy(self.cold, torch.tensor([row]), None, num_new)
            assert torch.equal(out[i, ids.shape[1] :], ref[0, len(row) :]), f"row {i} differs from its cold run"
            torch.testing.assert_close(logits[i], ref_logits[0], rtol=0, atol=1e-4)
        self.last_sequence = None

    def save_load(self, num_blocks):
        path = os.path.join(self.tmp_dir, "cache.safetensors")
        self.cache.save(path)
        budget = None if num_blocks is None else _budget(self.cache, num_blocks)
        loaded = HybridPrefixCache.load(path, self.model, max_cache_bytes=budget)
        saved, restored = entry_digests(self.cache), entry_digests(loaded)
        assert all(saved[key] == digest for key, digest in restored.items()), "a loaded entry differs from the saved"
        if budget is None:
            assert restored == saved
        self.cache, self.digests = loaded, None

    def step(self, op):
        kind = op[0]
        if kind == "generate":
            self.generate(*op[1:])
        elif kind == "chat":
            _, fresh, num_new, seed = op
            previous = self.last_sequence or TRUNKS[0][:40]  # the first turn of a chat has a system prompt
            self.generate(previous + _tokens(fresh, seed), num_new, None)
        elif kind == "batch":
            self.batch(*op[1:])
        elif kind == "clear":
            self.cache.clear()
            assert self.cache.stored_bytes == 0
        elif kind == "save_load":
            self.save_load(op[1])
        elif kind == "budget":
            self.cache.max_cache_bytes = _budget(self.cache, op[1])
        self.digests = check_store(self.cache, self.digests)


@settings(
    max_examples=EXAMPLES or 40,
    derandomize=not EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    block_size=st.sampled_from([4, 8, 16]),
    retention=st.sampled_from([0, "dense", "two blocks"]),
    initial_blocks=st.sampled_from([None, 40, 12, 3]),
    ops=st.lists(operations, min_size=3, max_size=10),
)
def test_random_operation_sequences_match_cold_runs(tmp_path_factory, block_size, retention, initial_blocks, ops):
    model, _ = _models()
    interval = 2 * block_size if retention == "two blocks" else retention
    cache = HybridPrefixCache(model, block_size=block_size, retention_interval=interval)
    if initial_blocks is not None:
        cache.max_cache_bytes = _budget(cache, initial_blocks)
    run = Run(cache, tmp_path_factory.mktemp("fuzz"))
    for op in ops:
        run.step(op)
