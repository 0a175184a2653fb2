"""Attention whose output for a query does not depend on how many other queries share the call, on how its keys are
split or padded, or on whether it arrives in a prefill, a prefill chunk, a decode step or a verify group (issue 46,
deterministic mode's attention ingredient).

``F.scaled_dot_product_attention`` picks its kernel and its split of the keys by the call's shape: on this project's
CPU a query's output moves by float32 round-off between a causal prefill and a decode step, and by a bf16 ulp
(``benchmarks/batch_invariance.py``, table 3). Batch-invariant attention (Thinking Machines Lab, "Defeating
Nondeterminism in LLM Inference", 2025; vLLM's ``VLLM_BATCH_INVARIANT`` attention) fixes the reduction order by
splitting the keys in fixed-size blocks counted from position 0. Here, per query row:

- the keys are re-aligned so that key ``j`` of a row is the row's ``j``-th real token (the row's leading padding, the
  keys its last query does not see, is shifted out), then cut in blocks of :data:`KV_BLOCK` keys anchored at 0;
- within a block, each score is ``sum_d q_d k_d`` and each output ``sum_s p_s v_s``, a product of materialized
  float32 terms summed over a contiguous last dim of fixed length (a reduction whose order depends only on that
  length, not on how many rows are reduced), never a matrix product, whose kernel depends on the row count;
- across blocks, an online softmax in block order (Milakov and Gimelshein, "Online normalizer calculation for
  softmax", 2018; the FlashAttention recurrence): a running max, a rescaled running sum and a rescaled output;
- a key the query may not see gets the probability ``+0`` and contributes a ``+0`` term in its slot: the reduction
  tree is the same whichever keys are masked, and a block with no visible key leaves the running values unchanged,
  so the extra keys of a longer prefill (the future of a query) change nothing.

So a query at absolute position ``p`` is summed over the same blocks, in the same order, with the same terms in the
same slots, whatever the call. Elementwise ops are IEEE operations and ``exp``, whose vectorized body and tail agree
here (``benchmarks/batch_invariance.py``, table 2). Everything is computed in float32 and rounded once to the query's
dtype. Not supported: logit softcaps (no family in deterministic mode has them yet), dropout.

A sliding window of ``W`` keys (a query at ``p`` sees ``p - W < j <= p``, transformers' convention) re-lays the keys
out per query instead: slot ``s`` of query ``p`` holds key ``p - W + 1 + s`` (counted back from the query's last
visible key, its own), cut in blocks of :data:`KV_BLOCK` slots from slot 0. So a query's terms sit in the same slots
whether the call holds the whole past (a prefill), only the window (``generate()``'s sliding cache layer keeps
``W - 1`` keys), or the engine's window rows, and keys beyond the window never enter its sums.

Shapes (the package's legend): ``query`` ``[B, H, T, D]``, ``key`` ``[B, Hkv, K, D]``, ``value`` ``[B, Hkv, K, Dv]``
with ``H`` a multiple of ``Hkv`` (grouped-query attention: query head ``h`` reads KV head ``h // (H // Hkv)``),
``visible`` ``[B or 1, 1 or H, T, K]`` bool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Keys per block of the fixed reduction order. A multiple of an AVX-512 vector of floats; the per-block score
#: tensor is ``[B, H, T, KV_BLOCK, D]`` float32, so larger blocks cost memory in long prefills.
KV_BLOCK = 32
#: Queries computed together (each query's arithmetic is its own; this only bounds the per-block terms,
#: ``[B, H, QUERY_CHUNK, KV_BLOCK, D]`` float32, to stay in cache).
QUERY_CHUNK = 32


def causal_visible(num_queries: int, num_keys: int, device: torch.device | None = None,
                   window: int | None = None) -> torch.Tensor:
    """``[1, 1, T, K]`` bool: the causal mask of ``T`` queries that are the last ``T`` of ``K`` keys (a prefill over
    a cached past, or a decode step), True where a query sees a key; within the last ``window`` keys if given."""
    visible = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril(num_keys - num_queries)
    if window is not None:
        visible = visible.triu(num_keys - num_queries - window + 1)
    return visible[None, None]


def attention_invariant(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                        scaling: float, window: int | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention ``softmax(scaling * q k^T) v`` over the keys ``visible`` allows, in the fixed order of the
    module docstring.

    Args:
        query: ``[B, H, T, D]``; key: ``[B, Hkv, K, D]``; value: ``[B, Hkv, K, Dv]`` (one float dtype, one device).
        visible: ``[B or 1, 1 or H, T, K]`` bool, True where a query sees a key. Each row's keys must be its
            tokens from absolute position 0 on, after any left padding the row's last query does not see (as
            ``generate()``'s caches and the engine's page reads lay them out).
        scaling: the scores' factor (usually ``D ** -0.5``).
        window: a sliding window of ``W`` keys (the module docstring), or None. With a window, each query's visible
            keys must be contiguous and end at its own key (the keys may start anywhere before the window).
        bias: ``[B or 1, 1 or H, T, K]`` float added to the scaled scores (a relative position bias, Inkling's),
            laid out with the keys; or None.

    Returns:
        ``[B, H, T, Dv]`` in ``query``'s dtype; zeros for a query that sees no key.

    Raises:
        ValueError: ``H`` is not a multiple of ``Hkv``, or ``visible``'s shape does not broadcast to the call.
    """
    batch, heads, num_queries, _ = query.shape
    kv_heads, num_keys = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"attention_invariant needs the query heads ({heads}) to be a multiple of the key heads "
                         f"({kv_heads}).")
    if visible.dim() != 4 or visible.shape[-2:] != (num_queries, num_keys) or visible.shape[0] not in (1, batch):
        raise ValueError(f"visible must be [B or 1, 1 or H, {num_queries}, {num_keys}] bool, got "
                         f"{list(visible.shape)}.")
    groups = heads // kv_heads
    q = (query.float() * scaling).view(batch, kv_heads, groups, num_queries, 1, -1)  # [B, Hkv, G, T, 1, D]
    key, value, visible = key.float(), value.float(), visible.expand(batch, -1, -1, -1)
    if window is None:
        key, value, visible, bias = _anchor(key, value, visible, bias)
        blocks = _blocks(key[:, :, None, None], value[:, :, None, None])
    else:
        index, inside = _window_slots(visible, window)
        visible = torch.gather(visible, 3, index[:, None].expand(-1, visible.shape[1], -1, -1)) & inside[:, None]
        if bias is not None:
            bias = torch.gather(bias.expand(batch, -1, -1, -1), 3, index[:, None].expand(-1, bias.shape[1], -1, -1))
    visible = visible.reshape(batch, 1 if visible.shape[1] == 1 else kv_heads, -1, num_queries, visible.shape[-1])
    if bias is not None:
        bias = bias.float().expand(batch, -1, -1, -1)
        bias = bias.reshape(batch, 1 if bias.shape[1] == 1 else kv_heads, -1, num_queries, bias.shape[-1])
    chunks = []
    for begin in range(0, num_queries, QUERY_CHUNK):
        if window is not None:  # [B, Hkv, 1, Tc, slots, D]: each query's own window of keys
            rows = index[:, None, begin : begin + QUERY_CHUNK, :, None]
            blocks = _blocks(*(_take_window(x, rows, inside[:, None, begin : begin + QUERY_CHUNK, :, None])[:, :, None]
                               for x in (key, value)))
        chunks.append(_query_chunk(q[:, :, :, begin : begin + QUERY_CHUNK], blocks,
                                   visible[..., begin : begin + QUERY_CHUNK, :],
                                   None if bias is None else bias[..., begin : begin + QUERY_CHUNK, :]))
    return torch.cat(chunks, dim=3).view(batch, heads, num_queries, -1).to(query.dtype)


def _blocks(key: torch.Tensor, value: torch.Tensor) -> list:
    """``(start, keys [..., S, D], values^T [..., Dv, S])`` per block of :data:`KV_BLOCK` slots of ``key`` /
    ``value`` ``[..., slots, D]``."""
    return [(start, key[..., start : start + KV_BLOCK, :], value[..., start : start + KV_BLOCK, :].transpose(-1, -2))
            for start in range(0, key.shape[-2], KV_BLOCK)]


def _window_slots(visible: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, inside)`` ``[B, T, slots]`` for ``visible`` ``[B, 1 or H, T, K]``: slot ``s`` of a query holds key
    ``last - window + 1 + s`` (``last``: the last key it sees), ``inside`` where that key exists and ``s < window``;
    ``slots`` is ``window`` rounded up to :data:`KV_BLOCK`."""
    num_keys = visible.shape[-1]
    slots = torch.arange(-(-window // KV_BLOCK) * KV_BLOCK, device=visible.device)
    last = torch.where(visible.any(1), torch.arange(num_keys, device=visible.device), -1).amax(-1)  # [B, T]
    index = last[..., None] - (window - 1) + slots
    inside = (index >= 0) & (slots < window) & (last[..., None] >= 0)
    return index.clamp(0, num_keys - 1), inside


def _take_window(x: torch.Tensor, rows: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, Tc, slots, D]``: ``x`` ``[B, Hkv, K, D]`` at ``rows`` ``[B, 1, Tc, slots, 1]``, zeros outside."""
    batch, kv_heads, _, dim = x.shape
    shape = (batch, kv_heads, rows.shape[2], rows.shape[3], dim)
    taken = torch.gather(x[:, :, None].expand(-1, -1, rows.shape[2], -1, -1), 3, rows.expand(shape))
    return torch.where(inside, taken, torch.zeros((), dtype=x.dtype, device=x.device))


def _query_chunk(q: torch.Tensor, blocks, visible: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 outputs ``[B, Hkv, G, Tc, Dv]`` of the queries ``q`` ``[B, Hkv, G, Tc, 1, D]`` (scaled) over the
    ``(start, keys, values^T)`` blocks, ``visible`` ``[B, 1 or Hkv, 1 or G, Tc, K]``, ``bias`` (float32, laid out as
    ``visible``) added to the scores. Each query's arithmetic is its
    own (every op is per query row), so cutting the queries in chunks changes no bit; it keeps a chunk's per-block
    terms in cache. A block no query of the chunk sees is skipped: it would leave every running value unchanged."""
    shape = q.shape[:4]
    running_max = q.new_full(shape, float("-inf"))
    running_sum = q.new_zeros(shape)
    out = q.new_zeros((*shape, blocks[0][2].shape[-2]))
    needed = visible.reshape(-1, visible.shape[-1]).any(0)
    for start, keys, values in blocks:
        if not bool(needed[start : start + KV_BLOCK].any()):
            continue
        hidden = ~visible[..., start : start + KV_BLOCK]  # [B, 1 or Hkv, 1 or G, Tc, S]
        scores = (q * keys).sum(-1)  # [B, Hkv, G, Tc, S]
        if bias is not None:
            scores = scores + bias[..., start : start + KV_BLOCK]
        scores = scores.masked_fill_(hidden, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(-1))
        anchor = torch.where(new_max == float("-inf"), 0.0, new_max)
        probs = torch.exp(scores - anchor[..., None])  # +0 where hidden
        rescale = torch.exp(running_max - anchor)
        terms = (probs[..., None, :] * values).masked_fill_(hidden[..., None, :], 0.0)  # +0 terms, never -0
        running_sum = running_sum * rescale + probs.sum(-1)
        out = out * rescale[..., None] + terms.sum(-1)
        running_max = new_max
    return out / torch.where(running_sum == 0, 1.0, running_sum)[..., None]


def _anchor(key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, bias: torch.Tensor | None = None):
    """Shift each row's keys left by its leading padding (the keys before the first one its last query sees), pad
    the key count to a multiple of :data:`KV_BLOCK` with zero keys nobody sees, and return the four (``bias`` laid
    out as ``visible``, or None) re-laid out."""
    batch, num_keys = key.shape[0], key.shape[2]
    first = visible[:, :, -1].any(1).int().argmax(-1)  # [B] first key the last query sees (0 when it sees none)
    padded = -(-num_keys // KV_BLOCK) * KV_BLOCK
    if bool((first == 0).all()):
        pad = padded - num_keys
        return (F.pad(key, (0, 0, 0, pad)), F.pad(value, (0, 0, 0, pad)), F.pad(visible, (0, pad), value=False),
                None if bias is None else F.pad(bias, (0, pad)))
    index = torch.arange(padded, device=key.device)[None] + first[:, None]  # [B, padded]
    inside = index < num_keys
    index = index.clamp(max=num_keys - 1)

    def take(x: torch.Tensor, dim: int, shape) -> torch.Tensor:
        taken = torch.gather(x, dim, index.view(shape).expand(*x.shape[:dim], padded, *x.shape[dim + 1:]))
        return torch.where(inside.view(shape), taken, torch.zeros((), dtype=x.dtype, device=x.device))

    return (take(key, 2, (batch, 1, padded, 1)), take(value, 2, (batch, 1, padded, 1)),
            take(visible, 3, (batch, 1, 1, padded)),
            None if bias is None else take(bias.expand(batch, -1, -1, -1), 3, (batch, 1, 1, padded)))


def invariance_failures(dtype: torch.dtype, length: int = 90, attention=None, window: int | None = None) -> list[str]:
    """The cases in which ``attention`` (default :func:`attention_invariant`; the signature is its own) gives a query
    other bits than in one causal prefill of ``length`` random queries (4 heads over 2 KV heads of 16, CPU): a decode
    step and a prefill chunk starting at the query, early, at block edges and at the last position (where SDPA
    differs here in each dtype). With a sliding ``window``, the decode step holds only the window's keys (as a
    sliding cache layer does). Empty where it holds.
    """
    attention = attention_invariant if attention is None else attention
    extra = {} if window is None else {"window": window}
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, 16, generator=gen).to(dtype) for heads in (4, 2, 2))
    full = attention(q, k, v, causal_visible(length, length, window=window), 0.25, **extra)
    failures = []
    for p in (0, 5, KV_BLOCK - 1, KV_BLOCK, KV_BLOCK + 1, 2 * KV_BLOCK, length - 1):
        first = 0 if window is None else max(0, p + 1 - window)
        step = attention(q[:, :, p : p + 1], k[:, :, first : p + 1], v[:, :, first : p + 1],
                         causal_visible(1, p + 1 - first), 0.25, **extra)
        chunk = attention(q[:, :, p:], k, v, causal_visible(length - p, length, window=window), 0.25, **extra)
        failures += [f"{name} at {p}" for name, out in (("decode", step), ("chunk", chunk))
                     if not torch.equal(out[:, :, :1], full[:, :, p : p + 1])]
    return failures


#: The sliding window :func:`check_invariance` probes (not a multiple of :data:`KV_BLOCK`).
PROBE_WINDOW = 24
_CHECKED: set[tuple] = set()


def check_invariance(dtype: torch.dtype) -> None:
    """Raise unless :func:`attention_invariant` holds here in ``dtype`` (:func:`invariance_failures`, probed once per
    dtype and intra-op thread count in a process).

    Raises:
        RuntimeError: some case differs; names the dtype, the torch version and the cases.
    """
    key = (dtype, torch.get_num_threads())
    if key in _CHECKED:
        return
    failures = invariance_failures(dtype) or [f"{case} (sliding window of {PROBE_WINDOW})"
                                              for case in invariance_failures(dtype, window=PROBE_WINDOW)]
    if failures:
        raise RuntimeError(f"The invariant attention gives a query other bits in {dtype} on torch "
                           f"{torch.__version__} ({', '.join(failures)}), so deterministic results cannot be "
                           "guaranteed here.")
    _CHECKED.add(key)
