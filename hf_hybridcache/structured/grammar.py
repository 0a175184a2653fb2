"""Grammars over a tokenizer's vocabulary, from llguidance: a :class:`GrammarCompiler` per tokenizer (built once),
a :class:`Grammar` per schema (compiled once, shared by every request that uses it), a :class:`GrammarMatcher` per
sequence (where that sequence stands in the grammar), and :func:`apply_token_bitmask` for a batch of rows.

Why llguidance (``benchmarks/grammar_masks.py``, docs/serving.md): it emits only JSON that parses (xgrammar 0.2.9
lets raw control characters into strings: 24 of 100 random walks on the toy vocabulary parsed, llguidance's and
outlines-core's 100), compiles a schema in under 1 ms at 128k tokens (xgrammar about 40 ms, outlines-core 1.2 s, and
6-20 s for an object of any keys), fills one row's mask in 0.02-0.11 ms on a CPU at 262 to 128k tokens, and is one
wheel with no dependencies.

Bitmasks are transformers' and llguidance's layout: ``[rows, ceil(V / 32)]`` int32, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed.
"""

from __future__ import annotations

import torch

from .schemas import closed_schema

#: What to install when llguidance is missing (hf_hybridcache is not on PyPI: its extras install from a clone).
EXTRA = "pip install 'llguidance>=1.0,<2' (or pip install -e '.[structured]' in a clone of hf_hybridcache)"

#: JSON as the grammars write it: the separators of ``json.dumps`` and no other whitespace (a grammar that lets
#: whitespace be free lets a weak model fill its budget with spaces and never close the JSON); ``oneOf`` read as
#: ``anyOf`` (llguidance refuses it otherwise; xgrammar, llama.cpp and outlines read it so, and pydantic writes it
#: for discriminated unions, whose branches exclude each other anyway).
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "coerce_one_of": True}


def llguidance():
    """The llguidance module (``llguidance.hf`` loaded).

    Raises:
        ImportError: it is not installed (the message names the extra that installs it).
    """
    try:
        import llguidance
        import llguidance.hf
    except ImportError as error:
        raise ImportError(f"Structured output (grammars, JSON schemas, tool calls) needs llguidance: {EXTRA}.") \
            from error
    return llguidance


class GrammarCompiler:
    """Compiles grammars for one tokenizer.

    Args:
        tokenizer: a fast Hugging Face tokenizer (``PreTrainedTokenizerFast``).
        vocab_size: the width of the model's logits (padded embeddings included); tokens the tokenizer lacks are
            never allowed. None: the tokenizer's length.
        eos_token_ids: the ids that end a sequence once the grammar is complete (None: the tokenizer's EOS).

    Raises:
        ImportError: llguidance is missing.
        ValueError: the tokenizer is not a fast one, or ``vocab_size`` is smaller than the tokenizer.
    """

    def __init__(self, tokenizer, vocab_size: int | None = None, eos_token_ids: list[int] | None = None) -> None:
        llg = llguidance()
        self.vocab_size = vocab_size or len(tokenizer)
        if self.vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size={self.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens; "
                             f"pass the width of the model's logits (model.config.vocab_size, at least "
                             f"{len(tokenizer)}) or leave vocab_size out to use the tokenizer's length.")
        eos = list(eos_token_ids) if eos_token_ids else [tokenizer.eos_token_id]
        if any(not isinstance(i, int) or not 0 <= i < self.vocab_size for i in eos):
            raise ValueError(f"eos_token_ids must be token ids in [0, {self.vocab_size}), got {eos}.")
        self.eos_token_ids = frozenset(eos)
        try:
            self.tokenizer = llg.hf.from_tokenizer(tokenizer, self.vocab_size, eos_token=eos)
        except ValueError as error:
            if "fast" not in str(error):
                raise ValueError(f"llguidance cannot load this tokenizer: {error}") from error
            raise ValueError(f"Grammars need a fast tokenizer (PreTrainedTokenizerFast), got "
                             f"{type(tokenizer).__name__}; load it with AutoTokenizer.from_pretrained(..., "
                             f"use_fast=True).") from error

    def json_schema(self, schema: dict | None = None, closed: bool = True) -> Grammar:
        """The grammar of JSON that validates against ``schema`` (None: any JSON object).

        Args:
            closed: objects that declare their keys hold no others unless they say ``additionalProperties``
                (:func:`~hf_hybridcache.structured.schemas.closed_schema`, the default of llama.cpp's and vLLM's
                grammars); False: JSON Schema's own default, any other key.

        Raises:
            ValueError: the schema is not a JSON object, or uses something llguidance does not support.
        """
        if schema is not None and not isinstance(schema, dict):
            raise ValueError(f"A JSON schema must be a JSON object, got {type(schema).__name__}.")
        schema = {"type": "object"} if schema is None else closed_schema(schema) if closed else schema
        try:
            text = llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError, RuntimeError) as error:
            raise ValueError(f"The JSON schema cannot be compiled: {error}") from error
        return self._checked(text, "JSON schema")

    def lark(self, grammar: str) -> Grammar:
        """The grammar of a Lark grammar text (llguidance's dialect, which can embed ``%json {...}`` schemas).

        Raises:
            ValueError: it does not compile.
        """
        return self._checked(llguidance().LLMatcher.grammar_from_lark(grammar), "Lark grammar")

    def regex(self, pattern: str) -> Grammar:
        """The grammar of text that matches ``pattern`` in full.

        Raises:
            ValueError: it does not compile.
        """
        return self._checked(llguidance().LLMatcher.grammar_from_regex(pattern), "regular expression")

    def _checked(self, text: str, what: str) -> Grammar:
        error = llguidance().LLMatcher.validate_grammar(text, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"The {what} cannot be compiled: {error}")
        return Grammar(self.tokenizer, text, self.vocab_size, self.eos_token_ids)


class Grammar:
    """A compiled grammar (immutable, shared): :meth:`matcher` starts a sequence at its beginning.

    Attributes:
        vocab_size: the width of the logits its masks cover.
        eos_token_ids: the tokens that end a sequence once the grammar is complete (its compiler's).
    """

    def __init__(self, tokenizer, text: str, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer, self.text, self.vocab_size, self.eos_token_ids = tokenizer, text, vocab_size, eos_token_ids

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(llguidance().LLMatcher(self._tokenizer, self.text), self.eos_token_ids, self.vocab_size)

    def __repr__(self) -> str:
        return f"Grammar({self.text[:80]!r})"


class GrammarMatcher:
    """Where one sequence stands in a grammar: the tokens it may take next, and the tokens it took. Once the grammar
    is complete and can go no further, only its end-of-sequence tokens are allowed."""

    def __init__(self, matcher, eos_token_ids: frozenset[int], vocab_size: int) -> None:
        self._matcher, self.eos_token_ids, self.vocab_size = matcher, eos_token_ids, vocab_size
        self.tokens: list[int] = []

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of ``bitmask`` (``[rows, ceil(V / 32)]`` int32, CPU,
        contiguous).

        Raises:
            RuntimeError: the matcher is in an error state (a token it refused was accepted before).
        """
        if self._matcher.is_error():
            raise RuntimeError(f"The grammar refused token {self.tokens[-1:]}: {self._matcher.get_error()}")
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (the matcher is then in an error state, which :meth:`fill` reports) when the
        grammar does not allow it. Never raises."""
        self.tokens.append(token)
        return self._matcher.consume_token(token)

    def try_accept(self, token: int) -> bool:
        """Advance by ``token`` if the grammar allows it (True), else stay where it is (False). Never raises."""
        if self._matcher.try_consume_tokens([token]) != 1:
            return False
        self.tokens.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Take back the last ``num_tokens`` tokens it took (a verified draft's, :meth:`try_accept`)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)
            del self.tokens[-num_tokens:]

    @property
    def is_done(self) -> bool:
        """The grammar is complete and took an end-of-sequence token: the sequence is over."""
        return bool(self.tokens) and self.tokens[-1] in self.eos_token_ids and self._matcher.is_stopped() \
            and not self._matcher.is_error()

    @property
    def is_complete(self) -> bool:
        """What it took so far is a whole sentence of the grammar (it may still go on)."""
        return self._matcher.is_accepting()


def allocate_token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A ``[rows, ceil(vocab_size / 32)]`` int32 CPU bitmask with every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` ``[M, V]`` (any float dtype and device) with the tokens ``bitmask`` does not allow at -inf, in
    place; ``rows``: the rows of ``logits`` the bitmask's rows belong to (None: all, in order). Columns past the
    bitmask's width are disallowed. The words are read as bytes, each byte looked up in a 256 x 8 table of blocked
    bits (plain torch: llguidance's own applier is a ``torch.compile`` kernel, seconds to compile on first use and a
    C++ compiler on a CPU; this one is 2-4x faster than shifting each word 32 ways)."""
    table = _BLOCKED.get(logits.device)
    if table is None:
        table = _BLOCKED[logits.device] = (((torch.arange(256)[:, None] >> torch.arange(8)) & 1) == 0).to(
            logits.device)
    words = bitmask.to(logits.device, non_blocking=True).contiguous()
    blocked = table[words.view(torch.uint8).int()].view(words.shape[0], -1)  # little-endian: bit t of word t // 32
    width = min(blocked.shape[1], logits.shape[1])
    target = logits if rows is None else logits.index_select(0, rows.to(logits.device))
    target[:, :width].masked_fill_(blocked[:, :width], float("-inf"))
    target[:, width:] = float("-inf")
    if rows is not None:
        logits.index_copy_(0, rows.to(logits.device), target)
    return logits


#: Per device: ``[256, 8]`` bool, True where bit ``j`` of byte ``i`` is clear (the token is not allowed).
_BLOCKED: dict[torch.device, torch.Tensor] = {}
