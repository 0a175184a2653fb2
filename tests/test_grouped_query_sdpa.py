"""Masked multi-query attention inside this package's forwards uses SDPA's grouped-query mode instead of
``repeat_kv`` copies (a hit's tail over its restored prefix); the outputs stay the model's own."""

import torch

from hf_hybridcache._compat import attention


def test_grouped_query_sdpa_only_inside_package_forwards():
    from transformers.integrations import sdpa_attention

    attention.route_grouped_query_sdpa()
    key = value = torch.randn(1, 2, 40, 16)
    mask = torch.ones(1, 1, 8, 40, dtype=torch.bool)
    assert sdpa_attention.use_gqa_in_sdpa(mask, key, value) is False  # transformers' own answer
    with attention.package_forward(), torch.no_grad():
        assert sdpa_attention.use_gqa_in_sdpa(mask, key, value) is True
        with torch.enable_grad():  # training forwards (their checkpointed recompute runs outside the package's forward)
            assert sdpa_attention.use_gqa_in_sdpa(mask, key, value) is False
        one_query = torch.ones(1, 1, 1, 40, dtype=torch.bool)
        assert sdpa_attention.use_gqa_in_sdpa(one_query, key, value) is False  # pack_gqa copies nothing


def test_grouped_query_sdpa_is_bit_identical_to_repeat_kv():
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import repeat_kv

    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 8, 16, 32, generator=g)
    key, value = (torch.randn(1, 2, 80, 32, generator=g) for _ in range(2))
    mask = (torch.arange(16)[:, None] + 64 >= torch.arange(80)[None, :]).view(1, 1, 16, 80)
    repeated = F.scaled_dot_product_attention(query, repeat_kv(key, 4), repeat_kv(value, 4), attn_mask=mask)
    grouped = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    assert torch.equal(repeated, grouped)
