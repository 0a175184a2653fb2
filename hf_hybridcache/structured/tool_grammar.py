"""The tool-call formats a model writes on its own (``tool_choice: "auto"``): which one a tokenizer uses, and the
grammar of a reply that is free text or, after it, calls in that format whose arguments follow the tools' schemas.

A format is known from the tokenizer's ``response_template`` (transformers' declarative parser,
``tokenizer.parse_response``) or, for tokenizers that ship none, from its chat template, as ``transformers serve``
falls back by model type (``transformers/cli/serving/utils.py``, ``_RESPONSE_TEMPLATE_FALLBACKS``):

- :data:`HERMES`: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call, separated by
  a newline, after the reply's text (Qwen2.5, Qwen3, Qwen3-Next; Hermes-style templates that describe the call as
  ``{"name": <function-name>, "arguments": <args-json-object>}``).

Not (yet) constrained, so ``"auto"`` is refused for them: Qwen3.5's ``<function=NAME><parameter=KEY>`` markup (its
chat template holds ``<function=``) and Gemma 4's ``<|tool_call>call:NAME{...}<tool_call|>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes tool calls after its text: each call is ``open`` + JSON ``{"name": ..., "arguments":
    {...}}`` + ``close``, calls joined by ``separator``.

    Attributes:
        name: what docs and errors call it.
        open, close, separator: the literal text around and between calls.
    """

    name: str
    open: str
    close: str
    separator: str


HERMES = ToolCallFormat("hermes (Qwen2.5 / Qwen3 / Qwen3-Next)", "<tool_call>\n", "\n</tool_call>", "\n")
#: What a refusal names as supported.
SUPPORTED = ("the hermes-style <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> of Qwen2.5, Qwen3 and "
             "Qwen3-Next")
#: The regular expression of the free text before the calls, or of a reply without calls (any text that does not
#: hold the format's opening tag).
FREE_TEXT = r"(?s:.*)"
#: JSON inside the grammar is written as the server's other grammars write it (``json.dumps``' separators).
_JSON_STYLE = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


def tool_call_format(tokenizer) -> ToolCallFormat | None:
    """The tool-call format ``tokenizer``'s model writes, or None when the server knows none for it."""
    template = getattr(tokenizer, "response_template", None)
    if isinstance(template, dict):
        field = (template.get("fields") or {}).get("tool_calls")
        if not isinstance(field, dict):
            return None
        opening = str(field.get("open") or field.get("open_pattern") or "")
        plain_json = field.get("content") == "json" and not field.get("content_args")
        return HERMES if plain_json and "<tool_call>" in opening and "(?P<" not in opening else None
    chat = getattr(tokenizer, "chat_template", None)
    if isinstance(chat, dict):
        chat = chat.get("tool_use") or chat.get("default")
    if not isinstance(chat, str) or "<function=" in chat:
        return None
    return HERMES if "<tool_call>" in chat and "<function-name>" in chat else None


def tool_call_lark(fmt: ToolCallFormat, functions: dict[str, dict], parallel: bool = True) -> str:
    """The Lark grammar (llguidance's dialect) of a reply that is free text, or free text then calls in ``fmt`` (one
    with ``parallel`` False, else one or more), each ``{"name": N, "arguments": A}`` with ``A`` valid for
    ``functions[N]`` (a JSON schema).

    The text before the calls and the opening tag are one lexeme (llguidance's lexer does not go back to end the
    text where a tag starts), and the text of a reply without calls cannot hold the opening tag: once the model has
    written it, it is writing a call.

    Raises:
        ValueError: ``functions`` is empty.
    """
    if not functions:
        raise ValueError("A tool-call grammar needs one function at least.")
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, parameters in functions.items()]
    schema = {**_JSON_STYLE, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
    opening = _regex(fmt.open)
    more = f"more: {json.dumps(fmt.close + fmt.separator + fmt.open)} call\n" if parallel else ""
    return "\n".join([
        f"start: TEXT | HEAD call {'more* ' if parallel else ''}{json.dumps(fmt.close)}",
        *([more.rstrip()] if parallel else []),
        f"call: %json {json.dumps(schema)}",
        f"TEXT: /{FREE_TEXT}/ & ~/(?s:.*){opening}(?s:.*)/",
        f"HEAD: /{FREE_TEXT}{opening}/ & ~/(?s:.*){opening}(?s:.*){opening}(?s:.*)/",
    ]) + "\n"


def _regex(literal: str) -> str:
    """``literal`` as a regular expression inside a Lark ``/.../`` (newlines written ``\\n``, punctuation escaped)."""
    return "".join("\\n" if ch == "\n" else ch if ch.isalnum() or ch in "_<>= " else "\\" + ch for ch in literal)
