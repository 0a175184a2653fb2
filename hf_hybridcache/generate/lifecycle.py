"""The life of one call, in the order it happens; the integration layer (``_compat.generation``) calls these.

1. :func:`generate_call` holds the view's call lock for the whole ``generate()`` call (released in ``finally``;
   the store's own lock is taken only around each store operation, see :mod:`~hf_hybridcache.core.calls`).
2. :func:`begin_request` runs before ``generate()`` reads ``get_seq_length()``: it checks the request, ends the
   previous one, restores each row's longest stored prefix into fresh live layers (:mod:`~hf_hybridcache.generate.live`;
   batches via :mod:`~hf_hybridcache.generate.batch`) and makes the new
   :class:`~hf_hybridcache.generate.live.LiveRequest` live.
3. :func:`forward_call` wraps every forward: ``before_forward`` plans the boundaries the patched mixers hand their
   states over at, ``after_forward`` stores new full blocks and checkpoints; a forward that raises (any
   ``BaseException``) ends the request, since its live state is half-written.
4. The request stays live after ``generate()`` returns (a direct forward may continue it) and ends when the view's
   next one begins, when a request begins on another view while this view is not in a call, or on
   ``reset()``/``clear()``.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from .. import _compat
from ..core import Row, log_request, not_cacheable
from ..store import synchronize
from .batch import mask_lengths, replay_rows, unpadded_rows
from .images import CallImages, defer_images, encode_images, prompt_keys
from .live import LiveRequest, restore_row
from .live_cache import LiveCache
from .reply_replay import replay_replies

logger = logging.getLogger("hf_hybridcache")


def find_cache(model, kwargs) -> LiveCache | None:
    """The HybridPrefixCache (a :class:`~hf_hybridcache.generate.live_cache.LiveCache`) of a call to ``model``, or None.

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
    """Around one ``generate()`` call: hold the view's call lock; if the call raises, end its request (the live state
    is half-written and nothing more of it is stored)."""
    with cache.core.generate_scope(cache):
        cache.live.awaiting_request = True
        try:
            yield
            replay_replies(cache)
        except BaseException:
            end_request(cache)
            raise
        finally:
            cache.live.awaiting_request = cache.live.rollback_next_request = False


def begin_request(
    cache, *, input_ids, attention_mask, inputs_embeds, use_cache, decode_tokens: int = 0,
    images: CallImages | None = None,
) -> int:
    """Start the request of a ``generate()`` call that will feed at most ``decode_tokens`` tokens after its prompt,
    looked up and stored by the token keys of its ``images`` (:mod:`~hf_hybridcache.generate.images`); returns the
    restored tokens of its first row."""
    cause = "use_cache" if use_cache is False else _compat.uncached_cause(cache.model)
    if cause is not None:
        # use_cache=False: each step re-feeds the whole sequence, nothing is cached between steps. Training mode with
        # dropout (or 5.23's activation checkpointing): states are not the tokens' own (_compat.training). Either way
        # nothing is looked up or stored; training mode without them reuses prefixes as eval mode does.
        start_request(cache, None, None, input_ids.shape[0], prompt_tokens=input_ids.shape[1], uncached=cause)
        return 0
    if images is not None and images.uncached:
        start_request(cache, None, None, input_ids.shape[0], prompt_tokens=input_ids.shape[1], uncached=images.uncached)
        return 0
    if inputs_embeds is not None:
        check_request(cache, None)
        start_request(cache, None, None, inputs_embeds.shape[0], prompt_tokens=inputs_embeds.shape[1])
    else:
        check_request(cache, input_ids)
        keys = prompt_keys(images, input_ids)
        start_request(cache, keys, attention_mask, input_ids.shape[0], decode_tokens=decode_tokens)
        if keys is not input_ids and cache.live.request.rows:
            cache.live.request.rows[0].keys = keys[0].tolist()
    return cache.last_hit_tokens[0]


@contextlib.contextmanager
def forward_call(cache, *, input_ids, inputs_embeds, use_cache):
    """Around one forward with ``cache``: the view's call lock (re-entrant inside this thread's own ``generate()``), the
    request's bookkeeping before and after, and the end of the request if the forward raises.

    A forward with ``use_cache=False`` runs on fresh, empty live layers and stores nothing, so it computes exactly
    what the model computes without a cache (``generate(use_cache=False)`` re-feeds the whole sequence each step)."""
    ids_or_embeds = input_ids if input_ids is not None else inputs_embeds
    with cache.core.call_scope(cache):
        try:
            started = None
            if ids_or_embeds is not None:
                num_rows, num_tokens = ids_or_embeds.shape[:2]
                if use_cache is False:
                    _begin_uncached_forward(cache)
                storing = _compat.uncached_cause(cache.model) is None
                _before_forward(cache, input_ids, num_rows, num_tokens, storing=storing)
                if cache.core.remote is not None and num_rows == 1 and num_tokens > 1:
                    started = time.perf_counter()
            yield
            if started is not None:
                _observe_forward(cache, started)
            if cache.live.request is not None:
                cache.live.request.after_forward()
        except BaseException:
            end_request(cache)
            raise


def _observe_forward(cache, started: float) -> None:
    """A single-row multi-token forward with a remote tier just ended: its wall time feeds the tier's measured
    compute rate (the fetch-or-recompute rule)."""
    request, core = cache.live.request, cache.core
    if request is None or torch.is_grad_enabled():
        return
    synchronize(core.devices.values())
    core.remote.observe_forward(request.forward_start, request.forward_end, time.perf_counter() - started)


def _begin_uncached_forward(cache) -> None:
    if cache.live.request is None:
        end_idle_requests(cache)
        _make_live(cache, LiveRequest(cache, [], tracking=False))
    cache.live.request.stop_tracking("a forward with use_cache=False")
    cache.layers = _compat.new_live_layers(cache.model.config)


def _before_forward(cache, input_ids: torch.Tensor | None, num_rows: int, num_tokens: int, storing: bool) -> None:
    if cache.live.request is None:  # a forward outside generate(): one request that starts with this forward
        end_idle_requests(cache)
        cache.live.root, cache.live.weights_generation = cache.core.request_start(cache.salt)
        # Live layers that hold tokens nobody tracked (a failed or ended request) must not be stored as if they held
        # this forward's prefix.
        tracking = storing and num_rows == 1 and input_ids is not None and _live_is_empty(cache)
        rows = [Row(prompt_tokens=num_tokens, root=cache.live.root,
                     weights_generation=cache.live.weights_generation)] if tracking else []
        _make_live(cache, LiveRequest(cache, rows, tracking))
    if not storing:
        # A training forward (autograd on), dropout on, or layers that drop the cache: nothing of this forward may be
        # stored and served to eval requests later.
        cache.live.request.stop_tracking("a forward in training mode")
    cache.live.request.before_forward(input_ids, num_rows, num_tokens)


def rows_done(cache, is_done: torch.Tensor) -> None:
    """``generate()``'s stopping criteria finished the rows where ``is_done`` ``[B]`` is True: each such row is fed
    its last real token by the next forward and the pad id after that, which is not stored."""
    if cache.live.request is not None:
        cache.live.request.rows_done(is_done.tolist())


def start_request(
    cache,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    num_rows: int,
    prompt_tokens: int = 0,
    uncached: str | None = None,
    decode_tokens: int = 0,
) -> None:
    """End the view's live request and those of views not in a call, then restore each row's longest hit into fresh
    live layers and make the new request live. ``input_ids`` ``[B, T]`` (None: nothing is looked up, e.g.
    ``inputs_embeds``); ``prompt_tokens`` counts the prompt when there are no ids; ``uncached`` says why there are
    none (a key of :data:`~hf_hybridcache.core.explain.NOT_CACHEABLE`; None: ``inputs_embeds``, or padding inside a
    prompt); a single row's restored KV gets room for ``decode_tokens`` tokens fed after the prompt
    (:func:`~hf_hybridcache.generate.live.restore_row`)."""
    cache.live.awaiting_request = False  # the live layers are the request's from here on (get_seq_length)
    end_request(cache)
    end_idle_requests(cache)
    cache.live.root, cache.live.weights_generation = cache.core.request_start(cache.salt)
    cache.layers = _compat.new_live_layers(cache.model.config)
    rows_tokens = unpadded_rows(input_ids, attention_mask)
    if rows_tokens is None:
        lengths = [prompt_tokens] * num_rows if input_ids is None else mask_lengths(input_ids, attention_mask)
        # Nothing is looked up or stored, but a single row still keeps the states speculative decoding needs.
        single = input_ids is not None and num_rows == 1
        rows = [Row(prompt_tokens=input_ids.shape[1], storing=False,
                    weights_generation=cache.live.weights_generation)] if single else []
        request = LiveRequest(cache, rows, tracking=single)
        _log_no_reuse(cache, input_ids is None)
        cause = uncached or ("inputs_embeds" if input_ids is None else "padding")
        reports = [not_cacheable(n, cause) for n in lengths]
    elif num_rows == 1 and len(rows_tokens[0]) == input_ids.shape[1]:
        row = restore_row(cache, rows_tokens[0], decode_tokens=decode_tokens)
        request = LiveRequest(cache, [row], tracking=True, forward_end=row.hit_tokens)
        lengths, reports = [len(rows_tokens[0])], [row.report]
    else:
        request = replay_rows(cache, rows_tokens, input_ids)
        lengths, reports = [len(t) for t in rows_tokens], [row.report for row in request.rows]
    live = cache.live
    request.rollback, live.rollback_next_request, live.awaiting_request = live.rollback_next_request, False, False
    _make_live(cache, request)
    cache.last_hit_tokens = [row.hit_tokens for row in request.rows] or [0] * num_rows
    cache.last_reports = reports
    request.number = cache.core.count_request(
        sum(lengths), sum(cache.last_hit_tokens), [report.reason for report in reports]
    )
    log_request(request.number, reports)
    divergences = [row.divergence_tokens for row in request.rows]
    logger.debug(
        "request %d: prompt tokens %s, hit %s, replay %d, divergence at %s",
        request.number,
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
    if cache.core.warned_masked_prompt:
        logger.debug("no prefix reuse for this call (padding other than left padding); it runs like a fresh cache")
        return
    cache.core.warned_masked_prompt = True
    logger.warning(
        "No prefix reuse for this call: its attention_mask masks tokens that are not left padding, so it runs like a "
        "fresh cache (reported once per cache). If the prompt holds the pad token id as a real token, pass "
        "attention_mask=torch.ones_like(input_ids): without a mask, generate() masks every pad_token_id it finds."
    )


def _make_live(cache, request: LiveRequest) -> None:
    """Make ``request`` the live request of ``cache`` (its previous one has ended)."""
    with cache.core.store_lock:
        cache.live.request = request
        cache.core.live_views[id(cache)] = cache


def end_request(cache) -> None:
    """End ``cache``'s live request (if any) and unpin its chains."""
    with cache.core.store_lock:
        request, cache.live.request = cache.live.request, None
        cache.core.live_views.pop(id(cache), None)
    if request is not None:
        request.end()


def end_idle_requests(cache) -> None:
    """End the live requests of the views of ``cache``'s store that are not in a call (in another thread). A request
    stays live after ``generate()`` returns (a direct forward may continue it); ending the idle ones whenever a
    request begins means views made per call pin nothing for long."""
    with cache.core.store_lock:
        views = [view for view in cache.core.live_views.values() if view is not cache]
    for view in views:
        if view.live.call_lock.acquire(blocking=False):  # not in a call: nothing can continue its request now
            try:
                end_request(view)
            finally:
                view.live.call_lock.release()


def end_live_requests(cache) -> None:
    """End every live request of ``cache``'s store (the caller holds
    :meth:`~hf_hybridcache.core.sharing.CacheCore.idle`, so no view is in a call)."""
    end_request(cache)
    end_idle_requests(cache)


def _live_is_empty(cache) -> bool:
    return all(_compat.get_kv(cache.layers[a.layer_idx]) is None for a in cache.spec.attention) and all(
        _compat.get_linear_state(cache.layers[m.layer_idx], m.state_idx) is None for m in cache.spec.mamba
    )


def check_request(cache, input_ids: torch.Tensor | None) -> None:
    """Refuse, before anything changes, a request that cannot run: the model changed dtype or devices since the cache
    was built (:meth:`~hf_hybridcache.core.sharing.CacheCore.check_model`), an empty prompt, token ids outside the
    vocabulary.

    Raises:
        ValueError: with what to do.
    """
    model = cache.model
    cache.core.check_model(model)
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


#: The calls ``_compat`` makes into the lifecycle from the model's wrapped ``generate()`` and forwards.
HOOKS = _compat.Hooks(
    find=find_cache,
    generate_call=generate_call,
    begin_request=begin_request,
    forward_call=forward_call,
    rows_done=rows_done,
    defer_images=defer_images,
    encode_images=encode_images,
)
