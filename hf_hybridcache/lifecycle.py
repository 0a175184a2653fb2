"""The life of one call, in the order it happens; the integration layer (``_compat.generation``) calls these.

1. :func:`generate_call` holds the cache's lock for the whole ``generate()`` call (released in ``finally``).
2. :func:`begin_request` runs before ``generate()`` reads ``get_seq_length()``: it checks the request, ends the
   previous one, restores each row's longest stored prefix into fresh live layers (:mod:`~hf_hybridcache.live`;
   batches via :mod:`~hf_hybridcache.batch`) and makes the new :class:`~hf_hybridcache.live.LiveRequest` live.
3. :func:`forward_call` wraps every forward: ``before_forward`` plans the boundaries the patched mixers hand their
   states over at, ``after_forward`` stores new full blocks and checkpoints; a forward that raises (any
   ``BaseException``) ends the request, since its live state is half-written.
4. The request stays live after ``generate()`` returns (a direct forward may continue it) and ends when the next one
   begins, or on ``reset()``/``clear()``.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from . import _compat, placement
from .batch import mask_lengths, replay_rows, unpadded_rows
from .live import LiveRequest, restore_row
from .live_cache import LiveCache
from .rows import Row

logger = logging.getLogger("hf_hybridcache")


def find_cache(model, kwargs) -> LiveCache | None:
    """The HybridPrefixCache (a :class:`~hf_hybridcache.live_cache.LiveCache`) of a call to ``model``, or None.

    Raises:
        ValueError: the cache was built for another model.
    """
    cache = _compat.find_cache(kwargs)
    if not isinstance(cache, LiveCache):
        return None
    if cache.model is not model:
        raise ValueError(
            f"This HybridPrefixCache was built for another model ({type(cache.model).__name__} at "
            f"{id(cache.model):#x}) than the one it was passed to ({type(model).__name__} at {id(model):#x}); build "
            "one HybridPrefixCache per model."
        )
    return cache


@contextlib.contextmanager
def generate_call(cache):
    """Around one ``generate()`` call: hold the cache's lock; if the call raises, end its request (the live state is
    half-written and nothing more of it is stored)."""
    with cache._shared.generate_scope():
        cache._awaiting_request = True
        try:
            yield
        except BaseException:
            end_request(cache)
            raise
        finally:
            cache._awaiting_request = cache._rollback_next_request = False


def begin_request(cache, *, input_ids, attention_mask, inputs_embeds, use_cache) -> int:
    """Start the request of a ``generate()`` call; returns the restored tokens of its first row."""
    if use_cache is False or cache.model.training:
        # use_cache=False: each step re-feeds the whole sequence, nothing is cached between steps. Training mode:
        # states may be computed with dropout. Either way nothing is looked up or stored.
        start_request(cache, None, None, input_ids.shape[0], prompt_tokens=input_ids.shape[1])
        return 0
    if inputs_embeds is not None:
        check_request(cache, None)
        start_request(cache, None, None, inputs_embeds.shape[0], prompt_tokens=inputs_embeds.shape[1])
    else:
        check_request(cache, input_ids)
        start_request(cache, input_ids, attention_mask, input_ids.shape[0])
    return cache.last_hit_tokens[0]


@contextlib.contextmanager
def forward_call(cache, *, input_ids, inputs_embeds, use_cache):
    """Around one forward with ``cache``: the lock (re-entrant inside this thread's own ``generate()``), the request's
    bookkeeping before and after, and the end of the request if the forward raises.

    A forward with ``use_cache=False`` runs on fresh, empty live layers and stores nothing, so it computes exactly
    what the model computes without a cache (``generate(use_cache=False)`` re-feeds the whole sequence each step)."""
    ids_or_embeds = input_ids if input_ids is not None else inputs_embeds
    with cache._shared.lock:
        try:
            started = None
            if ids_or_embeds is not None:
                num_rows, num_tokens = ids_or_embeds.shape[:2]
                if use_cache is False:
                    _begin_uncached_forward(cache)
                _before_forward(cache, input_ids, num_rows, num_tokens, storing=not cache.model.training)
                if cache._remote is not None and num_rows == 1 and num_tokens > 1:
                    started = time.perf_counter()
            yield
            if started is not None:
                _observe_forward(cache, started)
            if cache._request is not None:
                cache._request.after_forward()
        except BaseException:
            end_request(cache)
            raise


def _observe_forward(cache, started: float) -> None:
    """A single-row multi-token forward with a remote tier just ended: its wall time feeds the tier's measured
    compute rate (the fetch-or-recompute rule)."""
    request = cache._request
    if request is None or torch.is_grad_enabled():
        return
    placement.synchronize(cache._shared.devices.values())
    cache._remote.observe_forward(request.forward_start, request.forward_end, time.perf_counter() - started)


def _begin_uncached_forward(cache) -> None:
    if cache._request is None:
        end_active_request(cache)
        cache._request = LiveRequest(cache, [], tracking=False)
        cache._shared.active = cache
    cache._request.stop_tracking("a forward with use_cache=False")
    cache.layers = _compat.new_live_layers(cache.model.config)


def _before_forward(cache, input_ids: torch.Tensor | None, num_rows: int, num_tokens: int, storing: bool) -> None:
    if cache._request is None:  # a forward outside generate(): one request that starts with this forward
        end_active_request(cache)
        _refresh_weights(cache)
        # Live layers that hold tokens nobody tracked (a failed or ended request) must not be stored as if they held
        # this forward's prefix.
        tracking = storing and num_rows == 1 and input_ids is not None and _live_is_empty(cache)
        rows = [Row(prompt_tokens=num_tokens, root=cache._root)] if tracking else []
        cache._request = LiveRequest(cache, rows, tracking)
        cache._shared.active = cache
    if not storing:
        # Training mode: dropout may be on and gradient checkpointing drops the cache inside the layers, so nothing
        # of this forward may be stored and served to eval requests later.
        cache._request.stop_tracking("a forward in training mode")
    cache._request.before_forward(input_ids, num_rows, num_tokens)


def rows_done(cache, is_done: torch.Tensor) -> None:
    """``generate()``'s stopping criteria finished the rows where ``is_done`` ``[B]`` is True: each such row is fed
    its last real token by the next forward and the pad id after that, which is not stored."""
    if cache._request is not None:
        cache._request.rows_done(is_done.tolist())


def start_request(
    cache,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    num_rows: int,
    prompt_tokens: int = 0,
) -> None:
    """End the store's live request, then restore each row's longest hit into fresh live layers and make the new
    request live. ``input_ids`` ``[B, T]`` (None: nothing is looked up, e.g. ``inputs_embeds``); ``prompt_tokens``
    counts the prompt when there are no ids."""
    end_active_request(cache)
    _refresh_weights(cache)
    cache.layers = _compat.new_live_layers(cache.model.config)
    rows_tokens = unpadded_rows(input_ids, attention_mask)
    if rows_tokens is None:
        lengths = [prompt_tokens] * num_rows if input_ids is None else mask_lengths(input_ids, attention_mask)
        # Nothing is looked up or stored, but a single row still keeps the states speculative decoding needs.
        single = input_ids is not None and num_rows == 1
        rows = [Row(prompt_tokens=input_ids.shape[1], storing=False)] if single else []
        request = LiveRequest(cache, rows, tracking=single)
        _log_no_reuse(cache, input_ids is None)
    elif num_rows == 1 and len(rows_tokens[0]) == input_ids.shape[1]:
        row = restore_row(cache, rows_tokens[0])
        request = LiveRequest(cache, [row], tracking=True, forward_end=row.hit_tokens)
        lengths = [len(rows_tokens[0])]
    else:
        request = replay_rows(cache, rows_tokens, input_ids)
        lengths = [len(t) for t in rows_tokens]
    request.rollback, cache._rollback_next_request, cache._awaiting_request = cache._rollback_next_request, False, False
    cache._request = request
    cache._shared.active = cache
    cache.last_hit_tokens = [row.hit_tokens for row in request.rows] or [0] * num_rows
    counters = cache._counters
    counters["requests"] += 1
    counters["prompt_tokens"] += sum(lengths)
    counters["hit_tokens"] += sum(cache.last_hit_tokens)
    request.number = counters["requests"]
    divergences = [row.divergence_tokens for row in request.rows]
    logger.debug(
        "request %d: prompt tokens %s, hit %s, replay %d, divergence at %s",
        counters["requests"],
        lengths,
        cache.last_hit_tokens,
        sum(lengths) - sum(cache.last_hit_tokens),
        divergences if any(divergences) else "none",
    )


def _log_no_reuse(cache, embeds_only: bool) -> None:
    """Say why a call runs without reuse. Masked tokens inside a prompt get a warning (once per cache): generate()
    masks every ``pad_token_id`` it finds when no ``attention_mask`` is given, so a chat whose tokens include the pad
    id silently loses all reuse."""
    if embeds_only:
        logger.debug("no prefix reuse for this call (inputs_embeds without input_ids); it runs like a fresh cache")
        return
    if cache._shared.warned_masked_prompt:
        logger.debug("no prefix reuse for this call (padding other than left padding); it runs like a fresh cache")
        return
    cache._shared.warned_masked_prompt = True
    logger.warning(
        "No prefix reuse for this call: its attention_mask masks tokens that are not left padding, so it runs like a "
        "fresh cache (reported once per cache). If the prompt holds the pad token id as a real token, pass "
        "attention_mask=torch.ones_like(input_ids): without a mask, generate() masks every pad_token_id it finds."
    )


def _refresh_weights(cache) -> None:
    """Re-read the model's weights state (:mod:`~hf_hybridcache.weights`) and root this request's chains in it."""
    if cache._shared.weights.refresh():
        logger.warning(
            "The model's weights or adapters changed since the last request: prefixes stored under other weights are "
            "not served (they are again if those weights come back; cache.clear() drops them)."
        )
    cache._root = cache._shared.root(cache.salt)


def end_request(cache) -> None:
    """End ``cache``'s live request (if any) and unpin its chains."""
    request, cache._request = cache._request, None
    if cache._shared.active is cache:
        cache._shared.active = None
    if request is not None:
        request.end()


def end_active_request(cache) -> None:
    """End the live request of whichever view of the store has one. A request stays live after ``generate()``
    returns (a direct forward may continue it); only one per store, so views made per call pin nothing for long."""
    active = cache._shared.active
    if active is not None:
        end_request(active)


def _live_is_empty(cache) -> bool:
    return all(_compat.get_kv(cache.layers[a.layer_idx]) is None for a in cache.spec.attention) and all(
        _compat.get_linear_state(cache.layers[m.layer_idx], m.state_idx) is None for m in cache.spec.mamba
    )


def check_request(cache, input_ids: torch.Tensor | None) -> None:
    """Refuse, before anything changes, a request that cannot run: the model changed dtype or devices since the cache
    was built, an empty prompt, token ids outside the vocabulary.

    Raises:
        ValueError: with what to do.
    """
    shared, model = cache._shared, cache.model
    if model.dtype != shared.dtype:
        raise ValueError(
            f"The model is {model.dtype} but this HybridPrefixCache was built for it in {shared.dtype}, and its "
            f"stored entries are {shared.dtype}; convert the model back or build a new HybridPrefixCache."
        )
    devices = placement.layer_devices(model, shared.devices)
    if devices != shared.devices:
        moved = {idx: f"{shared.devices[idx]} -> {now}" for idx, now in devices.items() if now != shared.devices[idx]}
        raise ValueError(
            f"The model's layers moved to other devices since this HybridPrefixCache was built (layer: was -> now "
            f"{moved}); move them back or build a new HybridPrefixCache after placing the model."
        )
    if input_ids is None:
        return
    if input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be a [batch, tokens] tensor of token ids, got shape {tuple(input_ids.shape)}; add a batch "
            "dimension with input_ids[None]."
        )
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(
            f"`input_ids` must hold integer token ids (torch.long, as tokenizers return them), got a {input_ids.dtype} "
            "tensor; convert it with input_ids.long(), or pass embeddings as inputs_embeds instead."
        )
    if input_ids.shape[-1] == 0:
        raise ValueError(
            "The prompt is empty: pass at least one token id (e.g. the BOS token); a prefix cache has nothing to "
            "look up and the model nothing to continue."
        )
    vocab_size = model.get_input_embeddings().num_embeddings
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"Token id {low if low < 0 else high} is outside the model's vocabulary [0, {vocab_size}); check that "
            "the tokenizer belongs to this model."
        )
