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
same slots, whatever the call.

A sliding window of ``W`` keys (a query at ``p`` sees ``p - W < j <= p``) is anchored at the query instead
(:func:`_window_chunk`): its keys are taken by distance ``d = p - j`` from the query's own key (the last key it sees),
``d = 0 .. W - 1`` in blocks of :data:`KV_BLOCK` distances, the slots past the window, before the row's first token
or not visible holding ``+0`` terms as above. A query's terms then sit in the same slots whatever the cache holds
beyond the window (a full layer's every past key, a sliding layer's last ``W - 1``, an engine step's window cut) and
wherever its keys start in the call, which a block grid anchored at position 0 would not give once the keys before
the window are dropped. Elementwise ops are IEEE operations and ``exp``, whose vectorized body and tail agree
here (``benchmarks/batch_invariance.py``, table 2). Everything is computed in float32 and rounded once to the query's
dtype. Sink logits (one extra logit per query and head with a zero value, which only absorbs probability mass:
Inkling 2's) sit in a fixed slot, before the first block: the online softmax starts from the sink's running max and a
running sum of ``1``. Not supported: logit softcaps (no family in deterministic mode has them yet), dropout.

Shapes (the package's legend): ``query`` ``[B, H, T, D]``, ``key`` ``[B, Hkv, K, D]``, ``value`` ``[B, Hkv, K, Dv]``
with ``H`` a multiple of ``Hkv`` (grouped-query attention: query head ``h`` reads KV head ``h // (H // Hkv)``),
``visible`` ``[B or 1, 1 or H, T, K]`` bool.
"""

from __future__ import annotations

import functools

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
    a cached past, or a decode step), True where a query sees a key; with a sliding ``window``, only its own key and
    the ``window - 1`` before it."""
    ones = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device)
    visible = ones.tril(num_keys - num_queries)
    if window is not None:
        visible &= ones.triu(num_keys - num_queries - window + 1)
    return visible[None, None]


def attention_invariant(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                        scaling: float, window: int | None = None, bias: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention ``softmax(scaling * q k^T) v`` over the keys ``visible`` allows, in the fixed order of the
    module docstring.

    Args:
        query: ``[B, H, T, D]``; key: ``[B, Hkv, K, D]``; value: ``[B, Hkv, K, Dv]`` (one float dtype, one device).
        visible: ``[B or 1, 1 or H, T, K]`` bool, True where a query sees a key. Each row's keys must be its
            tokens from absolute position 0 on, after any left padding the row's last query does not see (as
            ``generate()``'s caches and the engine's page reads lay them out).
        scaling: the scores' factor (usually ``D ** -0.5``).
        window: a sliding window of this many keys (each query sees itself and the ``window - 1`` keys before it, as
            far as ``visible`` allows; its own key is the last one ``visible`` shows it), or None.
        bias: ``[B or 1, 1 or H, T, K]`` float added to the scaled scores in float32 (a relative position bias,
            Inkling's), laid out with the keys; or None.
        sinks: ``[B or 1, H, T]`` float sink logits (compared with the scaled, biased scores in float32), or None.

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
    if bias is not None:
        bias = bias.float().expand(batch, -1, -1, -1)
    if sinks is not None:
        sinks = sinks.float().expand(batch, -1, -1).reshape(batch, kv_heads, groups, num_queries)
    if window is not None:
        return _windowed(query, key, value, visible.expand(batch, -1, -1, -1), scaling, window, bias, sinks)
    key, value, visible, bias = _anchor(key.float(), value.float(), visible.expand(batch, -1, -1, -1), bias)
    q = (query.float() * scaling).view(batch, kv_heads, groups, num_queries, 1, -1)  # [B, Hkv, G, T, 1, D]
    visible = visible.reshape(batch, 1 if visible.shape[1] == 1 else kv_heads, -1, num_queries, visible.shape[-1])
    if bias is not None:
        bias = bias.reshape(batch, 1 if bias.shape[1] == 1 else kv_heads, -1, num_queries, bias.shape[-1])
    blocks = [(start, key[:, :, None, None, start : start + KV_BLOCK],  # [B, Hkv, 1, 1, S, D]
               value[:, :, None, None, start : start + KV_BLOCK].transpose(-1, -2))  # [B, Hkv, 1, 1, Dv, S]
              for start in range(0, key.shape[2], KV_BLOCK)]
    out = torch.cat([_query_chunk(q[:, :, :, begin : begin + QUERY_CHUNK], blocks,
                                  visible[..., begin : begin + QUERY_CHUNK, :],
                                  None if bias is None else bias[..., begin : begin + QUERY_CHUNK, :],
                                  None if sinks is None else sinks[..., begin : begin + QUERY_CHUNK])
                     for begin in range(0, num_queries, QUERY_CHUNK)], dim=3)
    return out.view(batch, heads, num_queries, -1).to(query.dtype)


def _query_chunk(q: torch.Tensor, blocks, visible: torch.Tensor, bias: torch.Tensor | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 outputs ``[B, Hkv, G, Tc, Dv]`` of the queries ``q`` ``[B, Hkv, G, Tc, 1, D]`` (scaled) over the
    ``(start, keys, values^T)`` blocks, ``visible`` ``[B, 1 or Hkv, 1 or G, Tc, K]`` (``bias``, float32, laid out
    alike, added to the scores). Each query's arithmetic is its
    own (every op is per query row), so cutting the queries in chunks changes no bit; it keeps a chunk's per-block
    terms in cache. A block no query of the chunk sees is skipped: it would leave every running value unchanged."""
    needed = visible.reshape(-1, visible.shape[-1]).any(0)
    pieces = ((keys, values, ~visible[..., start : start + KV_BLOCK],
               None if bias is None else bias[..., start : start + KV_BLOCK]) for start, keys, values in blocks
              if bool(needed[start : start + KV_BLOCK].any()))
    return _online_softmax(q, pieces, blocks[0][2].shape[-2], sinks)


def _online_softmax(q: torch.Tensor, pieces, value_dim: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 ``[B, Hkv, G, Tc, Dv]``: the scaled queries ``q`` ``[B, Hkv, G, Tc, 1, D]`` over ``(keys [.., S, D],
    values^T [.., Dv, S], hidden [.., Tc, S], bias [.., Tc, S] or None)`` blocks (broadcasting against ``q``; the bias
    added to the scores) merged in the order given, a
    hidden key a ``+0`` term in its slot. A block with no visible key may be left out: it changes no running value.
    ``sinks`` ``[B, Hkv, G, Tc]`` float32 (or None): a sink logit per query, merged first (its term ``1``, no value)."""
    shape = q.shape[:4]
    running_max = q.new_full(shape, float("-inf")) if sinks is None else sinks.clone()
    running_sum = q.new_zeros(shape) if sinks is None else q.new_ones(shape)
    out = q.new_zeros((*shape, value_dim))
    for keys, values, hidden, bias in pieces:
        scores = (q * keys).sum(-1)  # [B, Hkv, G, Tc, S]
        if bias is not None:
            scores = scores + bias
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


def _windowed(query, key, value, visible, scaling: float, window: int, bias=None, sinks=None) -> torch.Tensor:
    """:func:`attention_invariant` with a sliding ``window``: each query's keys by distance from its own key (the last
    key ``visible`` shows it), :func:`_window_chunk` per chunk of :data:`QUERY_CHUNK` queries."""
    batch, heads, num_queries, _ = query.shape
    kv_heads, num_keys = key.shape[1], key.shape[2]
    if visible.shape[1] != 1:
        assert bool((visible == visible[:, :1]).all()), "a windowed call's mask must be the same for every head"
        visible = visible[:, :1]
    q = (query.float() * scaling).view(batch, kv_heads, heads // kv_heads, num_queries, 1, -1)
    slots = torch.arange(num_keys, device=key.device) + 1
    own = (visible[:, 0].long() * slots).amax(-1) - 1  # [B, T] each query's own key; -1: it sees none
    distances = torch.arange(-(-window // KV_BLOCK) * KV_BLOCK, device=key.device)
    out = torch.cat([_window_chunk(q[:, :, :, begin : begin + QUERY_CHUNK], key.float(), value.float(),
                                   visible[:, 0, begin : begin + QUERY_CHUNK], own[:, begin : begin + QUERY_CHUNK],
                                   distances, window,
                                   None if bias is None else bias[:, :, begin : begin + QUERY_CHUNK],
                                   None if sinks is None else sinks[..., begin : begin + QUERY_CHUNK])
                     for begin in range(0, num_queries, QUERY_CHUNK)], dim=3)
    return out.view(batch, heads, num_queries, -1).to(query.dtype)


def _window_chunk(q, key, value, visible, own, distances, window: int, bias=None, sinks=None) -> torch.Tensor:
    """Float32 outputs ``[B, Hkv, G, Tc, Dv]`` of the scaled queries ``q`` ``[B, Hkv, G, Tc, 1, D]`` whose own keys
    are ``own`` ``[B, Tc]`` among ``key`` / ``value`` ``[B, Hkv, K, D]``, ``visible`` ``[B, Tc, K]``, ``bias``
    ``[B, 1 or H, Tc, K]`` float32 or None: slot ``d`` of ``distances`` ``[Wp]`` (a whole number of blocks) holds key
    ``own - d``, blocks merged in distance order."""
    index = own[..., None] - distances  # [B, Tc, Wp]
    inside = (index >= 0) & (distances < window)
    index = index.clamp(min=0)
    seen = torch.gather(visible, 2, index) & inside  # [B, Tc, Wp]
    batch, kv_heads, num_queries = key.shape[0], key.shape[1], index.shape[1]
    flat = index.reshape(batch, 1, -1, 1)

    def take(x: torch.Tensor) -> torch.Tensor:  # [B, Hkv, K, D] -> [B, Hkv, 1, Tc, Wp, D]
        taken = torch.gather(x, 2, flat.expand(batch, kv_heads, flat.shape[2], x.shape[-1]))
        return taken.view(batch, kv_heads, 1, num_queries, -1, x.shape[-1])

    keys, values = take(key), take(value).transpose(-1, -2)  # values: [B, Hkv, 1, Tc, Dv, Wp]
    seen = seen[:, None, None]  # [B, 1, 1, Tc, Wp]
    if bias is not None:  # [B, 1 or H, Tc, K] -> [B, 1 or Hkv, 1 or G, Tc, Wp]
        bias = torch.gather(bias, 3, index[:, None].expand(-1, bias.shape[1], -1, -1))
        bias = bias.reshape(batch, 1 if bias.shape[1] == 1 else kv_heads, -1, num_queries, bias.shape[-1])
    blocks = (slice(start, start + KV_BLOCK) for start in range(0, distances.shape[0], KV_BLOCK))
    pieces = ((keys[..., block, :], values[..., block], ~seen[..., block], None if bias is None else bias[..., block])
              for block in blocks if bool(seen[..., block].any()))
    return _online_softmax(q, pieces, value.shape[-1], sinks)


def _anchor(key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, bias: torch.Tensor | None = None):
    """Shift each row's keys left by its leading padding (the keys before the first one its last query sees), pad
    the key count to a multiple of :data:`KV_BLOCK` with zero keys nobody sees, and return the four (``bias``, laid
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
            take(visible, 3, (batch, 1, 1, padded)), None if bias is None else take(bias, 3, (batch, 1, 1, padded)))


def invariance_failures(dtype: torch.dtype, length: int = 90, attention=None, window: int | None = None) -> list[str]:
    """The cases in which ``attention`` (default :func:`attention_invariant`; the signature is its own, ``window``
    passed by keyword where set) gives a query other bits than in one causal prefill of ``length`` random queries (4
    heads over 2 KV heads of 16, CPU): a decode step and a prefill chunk starting at the query, early, at block edges
    and at the last position (where SDPA differs here in each dtype); with a sliding ``window``, each also over only
    the keys a sliding cache layer keeps (the query's window). Empty where it holds.
    """
    attention = attention_invariant if attention is None else attention
    run = attention if window is None else functools.partial(attention, window=window)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, 16, generator=gen).to(dtype) for heads in (4, 2, 2))
    full = run(q, k, v, causal_visible(length, length, window=window), 0.25)
    failures = []
    for p in (0, 5, KV_BLOCK - 1, KV_BLOCK, KV_BLOCK + 1, 2 * KV_BLOCK, length - 1):
        firsts = (0,) if window is None else sorted({0, max(0, p - window + 1)})
        for first in firsts:
            keys, values, tail = k[:, :, first:], v[:, :, first:], length - first
            cases = {"decode": run(q[:, :, p : p + 1], keys[:, :, : p + 1 - first], values[:, :, : p + 1 - first],
                                   causal_visible(1, p + 1 - first, window=window), 0.25),
                     "chunk": run(q[:, :, p:], keys, values, causal_visible(length - p, tail, window=window),
                                  0.25)[:, :, :1]}
            failures += [f"{name} at {p} (keys from {first})" for name, out in cases.items()
                         if not torch.equal(out, full[:, :, p : p + 1])]
    return failures


_CHECKED: set[tuple] = set()


def check_invariance(dtype: torch.dtype, window: int | None = None) -> None:
    """Raise unless :func:`attention_invariant` holds here in ``dtype`` (with a sliding ``window``, where set)
    (:func:`invariance_failures`, probed once per dtype, window and intra-op thread count in a process).

    Raises:
        RuntimeError: some case differs; names the dtype, the torch version and the cases.
    """
    key = (dtype, torch.get_num_threads(), window)
    if key in _CHECKED:
        return
    failures = invariance_failures(dtype, window=window)
    if failures:
        raise RuntimeError(f"The invariant attention gives a query other bits in {dtype} on torch "
                           f"{torch.__version__} ({', '.join(failures)}), so deterministic results cannot be "
                           "guaranteed here.")
    _CHECKED.add(key)
