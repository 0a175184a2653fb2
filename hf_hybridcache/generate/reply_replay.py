"""Replies stored as a prefill computes them (``replay_replies``; by default on in bfloat16 and float16, see
:func:`replays_by_default`).

A reply's tokens go through the model one per forward, and a one-token forward over a cached state runs the mixers'
decode step, which rounds differently from their prefill kernels in bf16: transformers' Mamba-2 single-token update
computes ``dt * B * x`` in bf16 and its output from a bf16 copy of the fp32 state, where the chunked scan stays in
fp32; Mamba-1's and the gated delta rule's steps differ likewise. From the first layer whose step rounds differently,
the reply's hidden states are a bf16 ulp away from what a prefill of the same tokens computes, so KV blocks and a
decode-end checkpoint taken from decode steps are a bf16 ulp (KV, conv windows) or 0.4-2% (SSM states) away from a
cold prefill's, and a chat turn that hits inside the reply gets first-step logits 0.02-0.06 away from a cold run on
the tiny models (benchmarks/bf16_multiturn.py), enough to flip near-tied tokens. In float32 the paths agree to
round-off.

With ``replay_replies`` a row stores nothing past its first decode step while the request runs
(:attr:`~hf_hybridcache.core.rows.Row.prefill_tokens`). When ``generate()`` has produced its output,
:func:`replay_replies` restores each row's deepest checkpoint at or before that step into fresh live layers and runs
the row's tokens up to its last block boundary as one forward, which stores their KV blocks, the retained
checkpoints and the decode-end checkpoint as a prefill does. The live layers of the request are left as they are
(a direct forward may continue them, as it would continue a ``DynamicCache``), but nothing more of it is stored.

Cost: one forward of about the reply's length (plus up to one block) per row, after the last token was produced,
so it adds to the call's total time, never to its TTFT (benchmarks/bf16_multiturn.py measures it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .. import _compat
from ..config import ModelStateSpec
from ..core import replay_start
from ..store import last_boundary
from .live import LiveRequest, restore_row

logger = logging.getLogger("hf_hybridcache")


def replays_by_default(dtype: torch.dtype, spec: ModelStateSpec) -> bool:
    """``replay_replies`` when not given: on in bfloat16 and float16, where decode steps round differently from a
    prefill. Off in float32 (the two agree to round-off), and for models with sliding-window attention layers: their
    continuation from a cache already differs from one forward in round-off (the window's attention runs over fewer
    keys), and a replay only adds a split that matches neither the cold run nor stock transformers' own continuation
    (benchmarks/bf16_multiturn.py: LFM3, Inkling, ZAYA flipped as often with it as without)."""
    return dtype in (torch.bfloat16, torch.float16) and not spec.sliding_layers


def replay_replies(cache, run_forward: Callable = _compat.run_forward) -> None:
    """Store the decode-made part of each row of ``cache``'s live request from one prefill forward of its tokens
    (``run_forward(model, input_ids [1, T], cache)``; the trace simulator passes its own) and count the tokens run.
    Does nothing unless the request stored its rows up to their first decode step (``replay_replies`` on, a request
    still tracking its rows)."""
    request = cache.live.request
    if request is None or not request.tracking:
        return
    bs = cache.options.block_size
    spans: dict[tuple[int, ...], tuple[int, int]] = {}  # repeated rows (num_return_sequences) are replayed once
    for row in request.rows:
        start = replay_start(row, bs)
        if start is not None:
            spans.setdefault(tuple(row.token_ids[: last_boundary(len(row.token_ids), bs)]), (start, row.prompt_tokens))
    if not spans:
        return
    live_layers = cache.layers
    try:
        with torch.no_grad():
            for tokens, (start, prompt_tokens) in spans.items():
                tail = _replay(cache, list(tokens), start, prompt_tokens, request.input_device, run_forward)
                cache.core.count_replayed_reply_tokens(tail)
    finally:
        cache.layers, cache.live.request = live_layers, request
    request.stop_tracking("its reply was stored from a replay")


def _replay(
    cache, tokens: list[int], start: int, prompt_tokens: int, device: torch.device, run_forward: Callable
) -> int:
    """Run ``tokens`` (ending on a block boundary) from the deepest checkpoint at or before ``start`` as one forward
    in fresh live layers, storing what it computes; returns the tokens run (0 when all is stored already)."""
    with cache.core.store_lock:
        stored = cache.core.store.lookup(tokens, cache.live.root, tail_tokens=0).hit_tokens
    if stored == len(tokens):
        return 0  # a re-run of the same reply: its blocks and decode-end checkpoint are stored (by a prefill)
    cache.layers = _compat.new_live_layers(cache.model.config)
    # At least two tokens run, or the forward would be a decode step again (block_size 1).
    row = restore_row(cache, tokens[: min(start, len(tokens) - 2) + 1], tail_tokens=1)
    row.prompt_tokens, row.divergence_tokens = prompt_tokens, 0  # the same retained boundaries as the request
    cache.live.request = replay = LiveRequest(cache, [row], tracking=True, forward_end=row.hit_tokens)
    try:
        tail = tokens[row.hit_tokens :]
        if min(tail) < 0:  # image keys: the images' features are not at hand, so the reply stays as decoded
            return 0
        run_forward(cache.model, torch.tensor([tail], device=device), cache)
    finally:
        replay.end()
    logger.debug("replayed %d reply tokens from %d to store them as a prefill computes them", len(tail), row.hit_tokens)
    return len(tail)
