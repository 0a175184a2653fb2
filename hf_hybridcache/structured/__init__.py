"""Structured output: text constrained to a grammar (a JSON schema, any JSON object, a Lark grammar, a regular
expression) by masking the logits of the tokens it does not allow, with llguidance
(``pip install -e '.[structured]'`` in a clone of the repository).

Used three ways: per request in the engine (``manager.add_request(ids, grammar=compiler.json_schema(schema))``,
masks of a step's rows with a grammar, :mod:`~hf_hybridcache.engine.grammar`), by the server's ``response_format``
and ``tools`` (:mod:`~hf_hybridcache.serve.structured`), and as a logits processor for ``generate()``
(:class:`JSONSchemaLogitsProcessor`). A mask changes only which token is sampled: prefix reuse is untouched. JSON
schemas are read with their objects closed where they do not say ``additionalProperties``, as llama.cpp's and vLLM's
grammars read them (:mod:`~hf_hybridcache.structured.schemas`, which also holds OpenAI's strict-mode rules).
"""

from .grammar import EXTRA, Grammar, GrammarCompiler, GrammarMatcher, allocate_token_bitmask, apply_token_bitmask
from .processor import GrammarLogitsProcessor, JSONSchemaLogitsProcessor

__all__ = [
    "EXTRA", "Grammar", "GrammarCompiler", "GrammarLogitsProcessor", "GrammarMatcher", "JSONSchemaLogitsProcessor",
    "allocate_token_bitmask", "apply_token_bitmask",
]
