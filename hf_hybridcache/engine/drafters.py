"""What proposes the draft tokens of the engine's speculative steps (:mod:`~hf_hybridcache.engine.speculative`).

A :class:`Drafter` serves one engine: before each step it gets the decoding requests that speculate and how many
tokens each may draft, and returns their drafts; the engine verifies them in the step's forward and keeps what the
target model agrees with. Drafts are tokens, optionally with the draft distribution each was sampled from
(:class:`Draft`); a drafter that returns bare tokens proposes them with certainty (a point-mass proposal, which
rejection sampling accepts with the target's probability of the token). Drafters here:

- :class:`NgramDrafter`: prompt lookup over the request's own tokens, no model (transformers'
  ``PromptLookupCandidateGenerator``; Saxena 2023, "Prompt lookup decoding");
- :class:`~hf_hybridcache.engine.draft_model.DraftModelDrafter`: a smaller causal LM with the same tokenizer, run by
  an engine of its own over its own :class:`~hf_hybridcache.HybridPrefixCache` (its own state slots, pages and prefix
  reuse).

A drafter for MTP heads, or one that replays known continuations at set acceptance rates (the benchmark's
``benchmarks/engine_speculative.py``), subclasses :class:`Drafter` the same way.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Draft:
    """Draft tokens and, when they were sampled, the distributions they were sampled from.

    Attributes:
        tokens: the draft tokens, in order.
        probs: ``[len(tokens), V]`` float32, row ``i`` the draft model's distribution token ``i`` was drawn from (on
            the target model's device); None: the tokens are proposed with certainty.
    """

    tokens: tuple[int, ...]
    probs: torch.Tensor | None = None


class Drafter:
    """Proposes draft tokens for running requests (subclass it; every method but :meth:`propose` may be left as is).

    A drafter serves one engine at a time, called from its thread only.

    Attributes:
        wants_hidden_states: True: the engine hands it the target's final hidden states of every position it keeps
            (:meth:`observe`; an MTP head drafts from them); False (the default) spares that copy.
    """

    wants_hidden_states = False

    def start(self, engine) -> None:
        """The engine (:class:`~hf_hybridcache.engine.engine.Engine`) it serves starts.

        Raises:
            ValueError: it cannot serve that engine's model (the message says why).
        """

    def propose(self, requests: Sequence, num_tokens: Sequence[int]) -> list[Draft | Sequence[int]]:
        """Drafts for ``requests`` (each decoding: its tokens so far are ``request.tokens``, the last one not fed
        yet), at most ``num_tokens[i]`` tokens for ``requests[i]`` (fewer, or none, is fine)."""
        raise NotImplementedError

    def observe(self, request, past: int, hidden: torch.Tensor) -> None:
        """(``wants_hidden_states`` only) ``request``'s tokens at positions ``past ..`` ran in a step and were kept:
        ``hidden`` ``[T, H]`` (the model's dtype and device) is the target's final hidden state at each, row ``i``
        the one that predicted token ``past + i + 1`` (a verify step's kept positions only, a prefix hit's none)."""

    def release(self, request) -> None:
        """``request`` left the engine (finished, failed or cancelled): forget what was kept for it."""

    def close(self) -> None:
        """The engine stopped: give back whatever the drafter holds."""


_SERVING: dict[int, weakref.ref] = {}  # id(drafter) -> the engine it serves (the drafter keeps its id alive)
_SERVING_LOCK = threading.Lock()


def claim(drafter: Drafter, engine) -> None:
    """Record that ``drafter`` serves ``engine`` from now on (the engine's construction; :func:`release` at its
    close).

    Raises:
        ValueError: ``drafter`` serves another engine that has not closed: two engines at once would interleave
            their calls and per-request state (a draft model's own slots, an n-gram index).
    """
    with _SERVING_LOCK:
        serving = _SERVING.get(id(drafter))
        if serving is not None and serving() not in (None, engine):
            gc.collect()  # an engine dropped without closing, waiting in a reference cycle, serves nothing
        other = None if serving is None else serving()
        if other is not None and other is not engine:
            raise ValueError(f"This {type(drafter).__name__} already serves another running engine (a drafter serves "
                             "one engine at a time); give each manager its own Speculation(drafter), or stop the "
                             "other manager first.")
        _SERVING[id(drafter)] = weakref.ref(engine)


def release(drafter: Drafter, engine) -> None:
    """``engine`` no longer uses ``drafter`` (it closed, or its construction failed)."""
    with _SERVING_LOCK:
        serving = _SERVING.get(id(drafter))
        if serving is not None and serving() in (None, engine):
            del _SERVING[id(drafter)]


class NgramDrafter(Drafter):
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the request's last ``n`` tokens,
    for the longest ``n`` from ``max_ngram`` down to ``min_ngram`` that occurred before. No model runs; a reply that
    repeats its prompt (a code edit, a quotation, a summary that cites) drafts well, free text hardly at all.

    Args:
        max_ngram: the longest n-gram tried (first).
        min_ngram: the shortest n-gram tried (last).

    Each request keeps an index ``{n-gram: where its latest occurrence ended}`` that grows with its tokens (one dict
    update per token and ``n``), so a lookup costs ``O(max_ngram)`` whatever the length.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not isinstance(min_ngram, int) or not isinstance(max_ngram, int) or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramDrafter needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}.")
        self.sizes = tuple(range(max_ngram, min_ngram - 1, -1))
        self._index: dict[object, tuple[int, dict]] = {}

    def propose(self, requests: Sequence, num_tokens: Sequence[int]) -> list[list[int]]:
        return [self.lookup(request, request.tokens, n) for request, n in zip(requests, num_tokens)]

    def lookup(self, key, tokens: list[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens continuing ``tokens`` by lookup (``key`` names its index)."""
        indexed, where = self._index.get(key, (0, {}))
        length = len(tokens)
        for end in range(max(indexed, 1), length):  # n-grams ending before the last token, whose next token is known
            for n in self.sizes:
                if end >= n:
                    where[tuple(tokens[end - n : end])] = end
        self._index[key] = (max(indexed, length), where)
        for n in self.sizes:
            if length >= n:
                end = where.get(tuple(tokens[length - n :]))
                if end is not None:
                    return tokens[end : end + num_tokens]
        return []

    def release(self, request) -> None:
        self._index.pop(request, None)

    def close(self) -> None:
        self._index.clear()
