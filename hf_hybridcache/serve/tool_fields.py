"""A chat request's ``tools``, ``tool_choice`` and ``response_format`` read and checked, before any grammar is built:
each tool's name and ``parameters``, and OpenAI's ``strict``.

``"strict": true`` on a function, or on ``response_format``'s ``json_schema``, asks that the reply follow the schema
exactly. Every grammar here does (objects closed where the schema does not say,
:mod:`~hf_hybridcache.structured.schemas`), so strict changes which schemas are taken, not how: one that breaks
OpenAI's strict-mode rules (objects without ``additionalProperties: false``, a property left out of ``required``, a
root that is not an object, ``allOf`` / ``oneOf`` / ``not`` / ``if``) is a 400 in the words of OpenAI's own (``Invalid
schema for function 'NAME': In context=('properties', 'when'), 'additionalProperties' is required to be supplied and
to be false.``, ``code`` ``invalid_function_parameters`` for a tool), so a client written against OpenAI sees the same
refusal here. A strict tool whose string parameter has a ``pattern`` or ``format`` is refused under ``"auto"`` where
the model's format writes strings as raw text (Qwen3.5's), which the grammar cannot hold to them.
"""

from __future__ import annotations

import re

from ..structured.schemas import strict_violation
from ..structured.tool_grammar import ToolCallFormat, unenforced
from .schema import APIError

#: OpenAI's rule for function names (which keeps them out of JSON escapes).
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: A function sent without ``parameters`` takes none (OpenAI: "Omitting parameters defines a function with an empty
#: parameter list").
NO_PARAMETERS = {"type": "object", "properties": {}, "required": [], "additionalProperties": False}


def functions_of(tools: list | None) -> tuple[dict[str, dict], set[str]]:
    """``{name: parameters schema}`` of OpenAI's ``tools``, and the names of those that say ``"strict": true``.

    Raises:
        APIError: 400 for a malformed tool, or a strict one whose schema breaks OpenAI's strict-mode rules (in
            OpenAI's words, ``code`` ``invalid_function_parameters``).
    """
    functions, strict = {}, set()
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           "\"parameters\": {...}}}}.", param=f"tools[{i}]")
        name, parameters = function.get("name"), function.get("parameters", NO_PARAMETERS)
        if not isinstance(name, str) or not TOOL_NAME.match(name) or name in functions:
            raise APIError(400, f"tools[{i}].function.name must be a new name of 1-64 letters, digits, '_' or '-'; "
                           f"got {name!r}.", param=f"tools[{i}].function.name")
        if not isinstance(parameters, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object.",
                           param=f"tools[{i}].function.parameters")
        functions[name] = parameters
        if _strict(function, f"tools[{i}].function.strict"):
            strict.add(name)
            _refuse_violation(f"function '{name}'", parameters, f"tools[{i}].function.parameters",
                              "invalid_function_parameters")
    return functions, strict


def _strict(spec: dict, param: str) -> bool:
    value = spec.get("strict")
    if value is not None and not isinstance(value, bool):
        raise APIError(400, f"{param} must be true, false or absent; got {value!r}.", param=param)
    return bool(value)


def _refuse_violation(what: str, schema, param: str, code: str | None = None) -> None:
    """A 400 in OpenAI's words when ``schema``, sent with ``"strict": true``, breaks OpenAI's strict-mode rules."""
    violation = strict_violation(schema)
    if violation:
        raise APIError(400, f"Invalid schema for {what}: {violation}", param=param, code=code)


def refuse_raw_strict(fmt: ToolCallFormat, tools: dict[str, dict], strict: set[str]) -> None:
    """A 400 for a strict tool whose string parameter has a ``pattern`` or ``format`` under ``"auto"`` in a format
    that writes strings as raw text, where the grammar cannot enforce them."""
    found = [f"the {word} of {name}'s {key}" for name in strict if fmt.kind == "xml"
             for key, word in unenforced(tools[name])]
    if found:
        raise APIError(400, f"tool_choice 'auto' on this model writes string parameters as raw text ({fmt.name}), "
                       f"where {', '.join(found)} cannot be enforced, and strict: true asks for the schema exactly. "
                       "Send tool_choice 'required' or a named function (JSON arguments, which enforce them), or "
                       "drop strict.", param="tools")


def named(choice) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                       f"{{\"name\": ...}}}}; got {choice!r}.", param="tool_choice")
    return function["name"]


def response_schema(response_format: dict | None) -> tuple[dict | None, str | None]:
    """The schema ``response_format`` asks for (None: any object) and the field to blame; param None: free text."""
    kind = None if response_format is None else response_format.get("type")
    if kind in (None, "text"):
        return None, None
    if kind == "json_object":
        return None, "response_format"
    spec = response_format.get("json_schema")
    if kind != "json_schema" or not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise APIError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}.",
                       param="response_format")
    param = "response_format.json_schema.schema"
    if _strict(spec, "response_format.json_schema.strict"):
        _refuse_violation(f"response_format {spec.get('name')!r}", spec.get("schema"), param)
    return spec.get("schema"), param
