"""Batches: each row replays alone from its own hit, then the rows are assembled into one left-padded live batch.

Rows of a batch have different hits, and padding between a restored state and its tail would make the SSM state
decay (DESIGN.md), so a row is never padded against another while it replays: it is restored and run alone up to its
last prompt token, and then the rows' live layers are stacked in ``generate()``'s padded layout with all but each
row's last token consumed, so ``generate()``'s own prefill runs one batched step.
"""

from __future__ import annotations

import torch

from .. import _compat
from .live import LiveRequest, restore_row


def unpadded_rows(input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> list[list[int]] | None:
    """Each row's tokens without its left padding; None when there are no ids or the padding is not all on the
    left (then nothing can be reused exactly).

    Args:
        input_ids: ``[B, T]`` int64 token ids, or None.
        attention_mask: ``[B, T]`` 0/1 mask, or None (no padding).
    """
    if input_ids is None:
        return None
    rows = input_ids.tolist()
    if attention_mask is None:
        return rows
    attention_mask = attention_mask.bool()
    lengths = attention_mask.sum(dim=1).tolist()
    left_padded = all(
        bool(mask_row[len(row) - n :].all()) and not bool(mask_row[: len(row) - n].any())
        for mask_row, row, n in zip(attention_mask, rows, lengths)
    )
    if not left_padded or 0 in lengths:
        return None
    return [row[len(row) - n :] for row, n in zip(rows, lengths)]


def mask_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Real (unmasked) tokens per row of ``input_ids`` ``[B, T]``."""
    if attention_mask is None:
        return [input_ids.shape[1]] * input_ids.shape[0]
    return attention_mask.bool().sum(dim=1).tolist()


def replay_rows(cache, rows_tokens: list[list[int]], input_ids: torch.Tensor) -> LiveRequest:
    """Restore and replay each row of ``rows_tokens`` alone up to its last token, then assemble the batch's live
    layers in ``input_ids``'s ``[B, T]`` padded layout. Returns the batch's request (the caller makes it live); if a
    replay raises, the pins of the rows replayed so far are released."""
    rows, row_layers = [], []
    try:
        for tokens in rows_tokens:
            twin = next((i for i, other in enumerate(rows_tokens[: len(rows)]) if other == tokens), None)
            if twin is not None:  # beams and num_return_sequences repeat rows: replay once, share the chain
                original = rows[twin]
                row = type(original)(**{**vars(original), "token_ids": list(original.token_ids),
                                        "block_ids": list(original.block_ids),
                                        "block_hashes": list(original.block_hashes)})
                cache.core.pin(row.block_ids)
                rows.append(row)
                row_layers.append(row_layers[twin])
                continue
            cache.layers = _compat.new_live_layers(cache.model.config)
            row = restore_row(cache, tokens)
            cache.live.request = LiveRequest(cache, [row], tracking=True, forward_end=row.hit_tokens)
            tail = tokens[row.hit_tokens : len(tokens) - 1]
            if tail:  # a forward that raises ends this row's request (and unpins it) on its way out
                _compat.run_forward(cache.model, torch.tensor([tail], device=input_ids.device), cache)
            cache.live.request = None
            rows.append(row)
            row_layers.append(cache.layers)
    except BaseException:
        cache.live.request = None
        for row in rows:
            cache.core.release(row.block_ids)
        raise
    consumed = input_ids.shape[1] - 1
    for row in rows:
        row.pad = consumed - len(row.token_ids)
    cache.layers = _compat.new_live_layers(cache.model.config)
    if consumed:
        _assemble(cache, row_layers, consumed)
    return LiveRequest(cache, rows, tracking=True, forward_end=consumed)


def _assemble(cache, row_layers: list[list], consumed: int) -> None:
    """Fill ``cache``'s fresh live layers with the rows' layers, each KV left-padded with zero positions (masked out
    by the attention mask) to the ``consumed`` live positions (a sliding layer: to the window it keeps of them), and
    a missing state (a row that consumed nothing) as zeros."""
    devices = cache.core.devices
    for attn in cache.spec.attention:
        device = devices[attn.layer_idx]
        width = consumed if attn.sliding_window is None else min(consumed, attn.sliding_window - 1)
        keys, values = [], []
        for layers in row_layers:
            kv = _compat.get_kv(layers[attn.layer_idx])
            if kv is None:
                kv = tuple(torch.zeros(1, attn.num_kv_heads, 0, dim, dtype=attn.dtype, device=device)
                           for dim in (attn.head_dim, attn.value_head_dim))
            keys.append(torch.nn.functional.pad(kv[0], (0, 0, width - kv[0].shape[-2], 0)))
            values.append(torch.nn.functional.pad(kv[1], (0, 0, width - kv[1].shape[-2], 0)))
        _compat.set_kv(cache.layers[attn.layer_idx], torch.cat(keys), torch.cat(values), consumed)
    for m in cache.spec.mamba:
        device = devices[m.layer_idx]
        convs, ssms = [], []
        for layers in row_layers:
            state = _compat.get_linear_state(layers[m.layer_idx], m.state_idx)
            if state is None:
                state = (torch.zeros(1, *m.conv.shape, dtype=m.conv.dtype, device=device),
                         torch.zeros(1, *m.ssm.shape, dtype=m.ssm.dtype, device=device))
            convs.append(state[0])
            ssms.append(state[1])
        _compat.set_linear_state(cache.layers[m.layer_idx], torch.cat(convs), torch.cat(ssms), m.state_idx, consumed)
