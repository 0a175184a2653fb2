from hf_hybridcache.hashing import block_hash, chain_hashes, model_identity, root_hash
from hf_hybridcache.toy import build_model

TOKENS = list(range(100, 164))  # 4 blocks of 16


def test_chain_has_one_hash_per_full_block():
    root = root_hash(b"seed", "model")
    hashes = chain_hashes(root, TOKENS + [1, 2, 3], 16)
    assert len(hashes) == 4
    assert hashes[0] == block_hash(root, TOKENS[:16])
    assert hashes[1] == block_hash(hashes[0], TOKENS[16:32])


def test_changed_token_changes_that_block_and_every_later_one():
    root = root_hash(b"seed", "model")
    base = chain_hashes(root, TOKENS, 16)
    changed = TOKENS.copy()
    changed[20] += 1
    other = chain_hashes(root, changed, 16)
    assert other[0] == base[0]
    assert all(a != b for a, b in zip(base[1:], other[1:]))


def test_seed_salt_and_model_identity_change_every_hash():
    base = chain_hashes(root_hash(b"seed", "model"), TOKENS, 16)
    for root in (root_hash(b"other", "model"), root_hash(b"seed", "model2"), root_hash(b"seed", "model", "tenant")):
        assert all(a != b for a, b in zip(base, chain_hashes(root, TOKENS, 16)))


def test_root_hash_parts_are_length_prefixed():
    assert root_hash(b"ab", "c") != root_hash(b"a", "bc")


def test_model_identity_depends_on_config_and_dtype():
    import torch

    a = build_model(seed=0)
    b = build_model(seed=1)
    c = build_model(seed=0, hidden_size=32)
    assert model_identity(a) == model_identity(b)  # same architecture: identity names config, not weights
    assert model_identity(a) != model_identity(c)
    assert model_identity(a) != model_identity(a.to(torch.bfloat16))
