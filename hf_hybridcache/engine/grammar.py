"""Grammars in the engine's batched sampling: a request added with a
:class:`~hf_hybridcache.structured.Grammar` holds its own
:class:`~hf_hybridcache.structured.GrammarMatcher` (``EngineRequest.grammar``); each step the runner fills one
bitmask row per sampled request that has one, sets the disallowed logits of those rows to -inf before the end-of-
sequence floor and the sampling processors, and advances each matcher with its row's token. Rows without a grammar
are not touched, so they sample exactly what they would alone.

A matcher follows the request's generated tokens, not its slot or pages: a preempted request, recomputed later from
the store, and the prefix it hits or stores are the same as without a grammar. A matcher that raises (one that
refused a token raises at its next mask; a grammar's own code may raise on any row, a decode row or a prefill's last)
is its request's fault and no one else's: its row is left unmasked, its error is kept in its ``sample_error``, and the
engine fails that request alone once the step is settled, while the other rows of the forward keep their tokens (no
recompute, no isolation by bisection: :mod:`~hf_hybridcache.engine.isolation` is for raises nobody can name).

A request that verifies draft tokens (:mod:`~hf_hybridcache.engine.speculative`) masks each verified position with
its matcher advanced over the drafts before it, then rolled back; the matcher then takes the tokens the step kept.
"""

from __future__ import annotations

import torch

from ..structured.grammar import allocate_token_bitmask, apply_token_bitmask


def grammar_error(grammar, eos_token_ids: frozenset[int], floor, vocab_size: int) -> str | None:
    """Why a request cannot run with ``grammar`` (None: it can, or it has no grammar), as a sentence that says what to
    do.

    Args:
        grammar: the request's :class:`~hf_hybridcache.structured.Grammar`, or None.
        eos_token_ids: the ids that end the request.
        floor: the manager's :class:`~hf_hybridcache.engine.generation_fields.EosFloor`, or None.
        vocab_size: the model's vocabulary size.
    """
    if grammar is None:
        return None
    if not hasattr(grammar, "matcher") or not hasattr(grammar, "eos_token_ids"):
        return (f"grammar must be a hf_hybridcache.structured.Grammar (GrammarCompiler(tokenizer).json_schema(...)), "
                f"got {type(grammar).__name__}.")
    if grammar.vocab_size != vocab_size:
        return (f"The grammar covers {grammar.vocab_size} tokens and the model has {vocab_size}; build the "
                f"GrammarCompiler with vocab_size={vocab_size}.")
    if not grammar.eos_token_ids <= eos_token_ids:
        return (f"The grammar ends with token(s) {sorted(grammar.eos_token_ids)}, which do not end this request "
                f"(its end-of-sequence ids: {sorted(eos_token_ids)}); pass eos_token_id= to add_request, or build the "
                "GrammarCompiler with eos_token_ids= of the request.")
    if floor is not None:
        return ("A request with a grammar cannot run under min_new_tokens / min_length: once the grammar is complete "
                "only an end-of-sequence token is allowed, which they hold off; unset them in the generation config.")
    return None


def grammar_rows(segments: list) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The sampled rows of ``segments`` (a step's sampled segments: one row each, or one per position of a segment
    that verifies draft tokens) whose request has a grammar, and their bitmask ``[G, ceil(V / 32)]`` int32 (CPU);
    None when no row has one. A verified position's mask is the matcher's after the drafts before it (taken for the
    mask and rolled back; the positions after a draft the grammar refuses are left unmasked: that draft is never
    kept, so no token is emitted from them). A matcher that raises (in an error state: it refused a token) leaves its
    rows out, and its request's ``sample_error`` says why."""
    firsts, row = [], 0
    for segment in segments:
        firsts.append(row)
        row += segment.num_logits
    wanted = [(first, s) for first, s in zip(firsts, segments) if s.request.grammar is not None]
    if not wanted:
        return None
    bitmask = allocate_token_bitmask(sum(s.num_logits for _, s in wanted), wanted[0][1].request.grammar.vocab_size)
    kept = []
    for first, segment in wanted:
        matcher, taken = segment.request.grammar, 0
        try:
            for i in range(segment.num_logits):
                if i and not matcher.try_accept(segment.draft[i - 1]):
                    break
                taken += bool(i)
                matcher.fill(bitmask, len(kept))
                kept.append(first + i)
        except Exception as error:  # noqa: BLE001 - the request's own fault: it fails alone
            segment.request.sample_error = f"The grammar raised {type(error).__name__}: {error}"
            bitmask[len(kept)] = -1  # what it wrote before it raised; the next row overwrites all of it
        finally:
            if taken:  # a request without drafts takes none (its matcher needs no rollback)
                try:
                    matcher.rollback(taken)
                except Exception as error:  # noqa: BLE001 - the request's own fault: it fails alone
                    segment.request.sample_error = (segment.request.sample_error
                                                    or f"The grammar raised {type(error).__name__}: {error}")
    return (torch.tensor(kept), bitmask[: len(kept)]) if kept else None


def mask_logits(logits: torch.Tensor, masks: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``logits`` ``[M, V]`` float32 with the disallowed tokens of the rows in ``masks`` at -inf (a copy; the
    others' rows unchanged)."""
    if masks is None:
        return logits
    rows, bitmask = masks
    return apply_token_bitmask(logits.clone(), bitmask, rows)


def advance(requests: list, tokens: list[list[int]]) -> None:
    """Each request with a grammar takes the tokens its step emitted (a refusal shows at the next mask; a matcher that
    raises here sets its request's ``sample_error``). Never raises."""
    for request, emitted in zip(requests, tokens):
        if request.grammar is not None and request.sample_error is None:
            try:
                for token in emitted:
                    request.grammar.accept(token)
            except Exception as error:  # noqa: BLE001 - the request's own fault: it fails alone
                request.sample_error = f"The grammar raised {type(error).__name__}: {error}"
