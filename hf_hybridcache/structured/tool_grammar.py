"""The tool-call formats a model writes on its own (``tool_choice: "auto"``): which one a tokenizer uses, and the
grammar of a reply that is free text or, after it, calls in that format whose arguments follow the tools' schemas
(their objects closed where they do not say, :mod:`~hf_hybridcache.structured.schemas`).

A format is known from the tokenizer's ``response_template`` (transformers' declarative parser,
``tokenizer.parse_response``) or, for tokenizers that ship none, from its chat template, as ``transformers serve``
falls back by model type (``transformers/cli/serving/utils.py``, ``_RESPONSE_TEMPLATE_FALLBACKS``):

- :data:`HERMES`: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call, separated by
  a newline, after the reply's text (Qwen2.5, Qwen3, Qwen3-Next; Hermes-style templates that describe the call as
  ``{"name": <function-name>, "arguments": <args-json-object>}``).
- :data:`QWEN3_5`: ``<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>``
  (Qwen3.5; transformers' ``xml-inline`` fallback for ``qwen3_5``; templates that hold ``<function=`` and
  ``<parameter=``): a string's value is its raw text, any other type's is JSON, as Qwen's own parser reads them.

Not (yet) constrained, so ``"auto"`` is refused for it: Gemma 4's ``<|tool_call>call:NAME{...}<tool_call|>``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .grammar import JSON_OPTIONS
from .schemas import closed_schema, rebased


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes tool calls after its text: each call is ``open`` + its body + ``close``, calls joined by
    ``separator``.

    Attributes:
        name: what docs and errors call it.
        open, close, separator: the literal text around and between calls.
        kind: the body, ``"json"`` (``{"name": ..., "arguments": {...}}``) or ``"xml"`` (``<function=NAME>`` ...).
        functions: ``{name: parameters schema}`` of a request's tools (bound per request: the ``"xml"`` reader
            needs each parameter's type to read its value).
    """

    name: str
    open: str
    close: str
    separator: str
    kind: str = "json"
    functions: dict | None = field(default=None, compare=False)


HERMES = ToolCallFormat("hermes (Qwen2.5 / Qwen3 / Qwen3-Next)", "<tool_call>\n", "\n</tool_call>", "\n")
QWEN3_5 = ToolCallFormat("Qwen3.5 (<function=NAME><parameter=KEY>)", "<tool_call>\n", "\n</tool_call>", "\n", "xml")
#: What a refusal names as supported.
SUPPORTED = ("the hermes-style <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> of Qwen2.5, Qwen3 and "
             "Qwen3-Next, or Qwen3.5's <tool_call><function=NAME><parameter=KEY> markup")
#: The regular expression of the free text before the calls, or of a reply without calls (any text that does not
#: hold the format's opening tag).
FREE_TEXT = r"(?s:.*)"
#: JSON inside the grammar is written as the server's other grammars write it (``json.dumps``' separators).
_JSON_STYLE = {"x-guidance": JSON_OPTIONS}


def tool_call_format(tokenizer) -> ToolCallFormat | None:
    """The tool-call format ``tokenizer``'s model writes, or None when the server knows none for it."""
    template = getattr(tokenizer, "response_template", None)
    if isinstance(template, dict):
        field = (template.get("fields") or {}).get("tool_calls")
        if not isinstance(field, dict):
            return None
        opening = str(field.get("open") or field.get("open_pattern") or "")
        if field.get("content") == "xml-inline" and "<tool_call>" in opening and "<function=" in opening:
            return QWEN3_5 if "<parameter=" in str((field.get("content_args") or {}).get("tag_pattern")) else None
        plain_json = field.get("content") == "json" and not field.get("content_args")
        return HERMES if plain_json and "<tool_call>" in opening and "(?P<" not in opening else None
    chat = getattr(tokenizer, "chat_template", None)
    if isinstance(chat, dict):
        chat = chat.get("tool_use") or chat.get("default")
    if not isinstance(chat, str) or "<tool_call>" not in chat:
        return None
    if "<function=" in chat:
        return QWEN3_5 if "<parameter=" in chat else None
    return HERMES if "<function-name>" in chat else None


def tool_call_lark(fmt: ToolCallFormat, functions: dict[str, dict], parallel: bool = True) -> str:
    """The Lark grammar (llguidance's dialect) of a reply that is free text, or free text then calls in ``fmt`` (one
    with ``parallel`` False, else one or more), each ``{"name": N, "arguments": A}`` with ``A`` valid for
    ``functions[N]`` (a JSON schema), or in the ``"xml"`` format ``N``'s parameters (:func:`_xml_calls`).

    The text before the calls and the opening tag are one lexeme (llguidance's lexer does not go back to end the
    text where a tag starts), and the text of a reply without calls cannot hold the opening tag: once the model has
    written it, it is writing a call.

    Raises:
        ValueError: ``functions`` is empty.
    """
    if not functions:
        raise ValueError("A tool-call grammar needs one function at least.")
    if fmt.kind == "xml":
        return _with_text(fmt, parallel, *_xml_calls(functions))
    return _with_text(fmt, parallel, f"call: %json {json.dumps({**_JSON_STYLE, **call_schema(functions)})}")


def call_schema(functions: dict[str, dict], at: str = "") -> dict:
    """The JSON schema of one call ``{"name": N, "arguments": A}`` to any of ``functions``, ``A`` valid for
    ``functions[N]`` with its objects closed (:func:`~hf_hybridcache.structured.schemas.closed_schema`) and its
    references moved to where ``A`` sits once this schema is at JSON pointer ``at`` of the grammar's schema (a
    tool's ``$defs`` resolve inside its own arguments)."""
    many = len(functions) > 1
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"], "properties": {
        "name": {"const": name},
        "arguments": rebased(closed_schema(parameters), f"{at}{f'/anyOf/{i}' if many else ''}/properties/arguments")}}
        for i, (name, parameters) in enumerate(functions.items())]
    return {"anyOf": calls} if many else calls[0]


def _with_text(fmt: ToolCallFormat, parallel: bool, *rules: str) -> str:
    """The reply's grammar around the rule ``call`` (among ``rules``): text, or text then calls."""
    opening = _regex(fmt.open)
    more = f"more: {json.dumps(fmt.close + fmt.separator + fmt.open)} call\n" if parallel else ""
    return "\n".join([
        f"start: TEXT | HEAD call {'more* ' if parallel else ''}{json.dumps(fmt.close)}",
        *([more.rstrip()] if parallel else []),
        *rules,
        f"TEXT: /{FREE_TEXT}/ & ~/(?s:.*){opening}(?s:.*)/",
        f"HEAD: /{FREE_TEXT}{opening}/ & ~/(?s:.*){opening}(?s:.*){opening}(?s:.*)/",
    ]) + "\n"


def _regex(literal: str) -> str:
    """``literal`` as a regular expression inside a Lark ``/.../`` (newlines written ``\\n``, punctuation escaped)."""
    return "".join("\\n" if ch == "\n" else ch if ch.isalnum() or ch in "_<>= " else "\\" + ch for ch in literal)


#: What a raw string value of the ``"xml"`` format may not hold: the tags that end it (and its call), and whitespace
#: at either end (transformers' and Qwen's parsers strip it).
_RAW_TEXT = r"~/(?s:.*)<\/(parameter|function)>(?s:.*)/ & ~/(?s:\s.*|.*\s)/"
#: The name of a parameter as transformers' ``xml-inline`` pattern reads it.
_KEY = re.compile(r"^[^>\n]+$")


def is_raw_string(schema) -> bool:
    """Whether a parameter of ``schema`` is written (and read) as raw text in the ``"xml"`` format: a string, or an
    enum / const of strings; any other value is JSON."""
    if not isinstance(schema, dict):
        return False
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        return bool(values) and all(isinstance(v, str) for v in values)
    return schema.get("type") == "string"


def _xml_calls(functions: dict[str, dict]) -> list[str]:
    """The rules of one call in the ``"xml"`` format: ``<function=N>\\n``, ``N``'s parameters in its schema's order
    (the required ones always, the others optional), each ``<parameter=K>\\nVALUE\\n</parameter>\\n``, then
    ``</function>``; a string's value is raw text within its length bounds, an enum of strings one of them, any
    other value JSON valid for its schema."""
    rules = [f"call: {' | '.join(f'c{i}' for i in range(len(functions)))}"]
    for i, (name, parameters) in enumerate(functions.items()):
        parameters = closed_schema(parameters)
        properties = parameters.get("properties") or {}
        required = parameters.get("required") or []
        keys = [*properties, *(k for k in required if k not in properties)]
        parts = []
        for j, key in enumerate(keys):
            if not isinstance(key, str) or not _KEY.match(key):
                raise ValueError(f"tools: {name}'s parameter {key!r} cannot be written as <parameter={key}>.")
            rule, schema = f"c{i}_{j}", properties.get(key, {})
            head = json.dumps(f"<parameter={key}>\n")
            if is_raw_string(schema):
                rules += [f"{rule}: {head} C{i}_{j}", f"C{i}_{j}: ({_raw_value(schema)}) \"\\n</parameter>\\n\""]
            else:
                rules.append(f"{rule}: {head} %json {json.dumps({**_JSON_STYLE, **_value_schema(parameters, key)})} "
                             "\"\\n</parameter>\\n\"")
            parts.append(rule if key in required else f"{rule}?")
        rules.append(f"c{i}: {json.dumps(f'<function={name}>{chr(10)}')} {' '.join(parts)} \"</function>\"")
    return rules


def _value_schema(parameters: dict, key: str) -> dict:
    """The schema of parameter ``key``'s JSON value: its own, or, where ``parameters`` holds references (its
    ``$defs``), a reference into a copy of ``parameters`` kept beside it, where they resolve."""
    schema = parameters["properties"].get(key, {})
    if "$ref" not in json.dumps(parameters):
        return schema
    pointer = key.replace("~", "~0").replace("/", "~1")
    return {"$defs": {"parameters": rebased(parameters, "/$defs/parameters")},
            "$ref": f"#/$defs/parameters/properties/{pointer}"}


def unenforced(parameters: dict) -> list[tuple[str, str]]:
    """``(key, "pattern" or "format")`` for each of those keywords on ``parameters``' string values, which the
    ``"xml"`` format writes as raw text and does not enforce."""
    return [(key, word) for key, schema in (parameters.get("properties") or {}).items()
            if is_raw_string(schema) for word in ("pattern", "format") if word in schema]


def _raw_value(schema: dict) -> str:
    """The Lark terminal of a raw string value (JSON schema's ``pattern`` and ``format`` are not enforced)."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        return " | ".join(json.dumps(v) for v in values)
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    return f"/(?s:.{{{low},{'' if high is None else int(high)}}})/ & {_RAW_TEXT}"
