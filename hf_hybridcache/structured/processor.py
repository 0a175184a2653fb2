"""The same constraint for ``generate()`` users: a transformers ``LogitsProcessor`` that keeps one
:class:`~hf_hybridcache.structured.grammar.GrammarMatcher` per row of the batch. It works with or without a
:class:`~hf_hybridcache.HybridPrefixCache` (the mask touches only the scores, never the cache)::

    processor = JSONSchemaLogitsProcessor(tokenizer, {"type": "object", "properties": {"city": {"type": "string"}}})
    out = model.generate(ids, logits_processor=[processor], max_new_tokens=64, cache=cache)

Rows are matched to their tokens at every step: a row whose generated tokens are not the ones its matcher took
(beam search reorders rows) gets a new matcher that takes its tokens again. A processor serves one ``generate()``
call at a time; make one per call (compiling is done once, in the :class:`~.grammar.Grammar`).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from .grammar import Grammar, GrammarCompiler, GrammarMatcher, allocate_token_bitmask, apply_token_bitmask


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks every token ``grammar`` does not allow next, per row. A row whose grammar is complete and has taken its
    end-of-sequence token is left as it is (``generate()`` pads it).

    Args:
        grammar: a compiled :class:`~hf_hybridcache.structured.grammar.Grammar`.
    """

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.prompt_tokens: int | None = None
        self.matchers: list[GrammarMatcher] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``scores`` ``[B, V]`` with the disallowed tokens of each row at -inf (``input_ids`` ``[B, T]``).

        Raises:
            RuntimeError: a row took a token its grammar refused (an earlier processor in the list allowed it).
        """
        if self.prompt_tokens is None or input_ids.shape[1] < self.prompt_tokens:
            self.prompt_tokens, self.matchers = input_ids.shape[1], []
        generated = input_ids[:, self.prompt_tokens:].tolist()
        while len(self.matchers) < len(generated):
            self.matchers.append(self.grammar.matcher())
        bitmask = allocate_token_bitmask(len(generated), self.grammar.vocab_size)
        rows = []
        for row, tokens in enumerate(generated):
            matcher = self._follow(row, tokens)
            if not matcher.is_done:
                matcher.fill(bitmask, row)
                rows.append(row)
        if rows:
            scores = scores.clone()
            apply_token_bitmask(scores, bitmask[rows], torch.tensor(rows))
        return scores

    def _follow(self, row: int, tokens: list[int]) -> GrammarMatcher:
        """Row ``row``'s matcher, advanced to ``tokens`` (a new one when the row's history is not its own)."""
        matcher = self.matchers[row]
        if matcher.tokens != tokens[: len(matcher.tokens)]:
            matcher = self.matchers[row] = self.grammar.matcher()
        for token in tokens[len(matcher.tokens):]:
            if matcher.is_done:
                break
            matcher.accept(token)
        return matcher


class JSONSchemaLogitsProcessor(GrammarLogitsProcessor):
    """:class:`GrammarLogitsProcessor` of JSON that validates against ``schema`` (None: any JSON object), written
    with ``json.dumps``' separators and no other whitespace, its objects closed where the schema does not say.

    Args:
        tokenizer: the model's fast tokenizer.
        schema: a JSON schema (a dict), or None.
        vocab_size: the model's logits width when it differs from ``len(tokenizer)`` (padded embeddings).
        closed: objects that declare their keys hold no others where the schema does not say
            ``additionalProperties`` (:meth:`~hf_hybridcache.structured.GrammarCompiler.json_schema`); False: any.

    Raises:
        ImportError: llguidance is missing (``pip install 'llguidance>=1.0,<2'``).
        ValueError: the schema does not compile.
    """

    def __init__(self, tokenizer, schema: dict | None = None, vocab_size: int | None = None,
                 closed: bool = True) -> None:
        super().__init__(GrammarCompiler(tokenizer, vocab_size).json_schema(schema, closed))
