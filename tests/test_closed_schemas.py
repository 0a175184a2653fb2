"""JSON schemas as the grammars read them (hf_hybridcache/structured/schemas.py): objects that declare their keys are
closed where the schema does not say (nested, under ``$defs``, ``anyOf`` and ``allOf``, a tuple's items too), and
``additionalProperties: true`` keeps them open; the compiled grammars (``GrammarCompiler.json_schema``, both
``tool_choice: "auto"`` formats) refuse an undeclared key at every depth and take the declared ones, ``$defs``
resolving inside a tool's arguments; OpenAI's strict-mode rules in OpenAI's words, and the server's 400s for them.
"""

import asyncio

import pytest

from hf_hybridcache.serve.schema import APIError, ChatRequest
from hf_hybridcache.serve.structured import Grammars, structure_of
from hf_hybridcache.structured import GrammarCompiler, tool_grammar
from hf_hybridcache.structured.schemas import closed_schema, rebased, strict_violation
from hf_hybridcache.toy import byte_tokenizer
from hf_hybridcache.toy.tool_template import hermes_tool_tokenizer, qwen3_5_tool_tokenizer

pytest.importorskip("llguidance")

INT = {"type": "integer"}
NESTED = {"type": "object", "required": ["a"], "properties": {
    "a": INT, "when": {"type": "object", "properties": {"day": INT}}, "f": {"$ref": "#/$defs/F"},
    "sort": {"anyOf": [{"type": "object", "properties": {"by": INT}}, {"type": "null"}]}},
    "$defs": {"F": {"type": "object", "properties": {"site": INT}}}}
SHUT = {"additionalProperties": False}


def test_objects_that_declare_keys_are_closed_at_every_depth():
    assert closed_schema(NESTED) == {"type": "object", "required": ["a"], **SHUT, "properties": {
        "a": INT, "when": {"type": "object", "properties": {"day": INT}, **SHUT}, "f": {"$ref": "#/$defs/F"},
        "sort": {"anyOf": [{"type": "object", "properties": {"by": INT}, **SHUT}, {"type": "null"}]}},
        "$defs": {"F": {"type": "object", "properties": {"site": INT}, **SHUT}}}
    assert closed_schema(closed_schema(NESTED)) == closed_schema(NESTED)
    assert "additionalProperties" not in NESTED  # the schema given is not changed


@pytest.mark.parametrize("schema,closed", [
    ({"type": "object"}, {"type": "object"}),  # declares no keys: any object, as llama.cpp and outlines read it
    ({"type": "object", "properties": {}}, {"type": "object", "properties": {}, **SHUT}),  # no keys at all
    ({"properties": {"a": INT}, "additionalProperties": True},
     {"properties": {"a": INT}, "additionalProperties": True}),
    ({"properties": {"a": INT}, "additionalProperties": INT}, {"properties": {"a": INT}, "additionalProperties": INT}),
    ({"properties": {"a": INT}, "required": ["a", "b"]},  # a required key is declared too (any value)
     {"properties": {"a": INT, "b": {}}, "required": ["a", "b"], **SHUT}),
    ({"properties": {"k": INT}, "anyOf": [{"properties": {"a": INT}}, {"properties": {"b": INT}}]},
     {"properties": {"k": INT, "a": {}, "b": {}}, **SHUT, "anyOf": [{"properties": {"a": INT, "k": {}}, **SHUT},
                                                                  {"properties": {"b": INT, "k": {}}, **SHUT}]}),
    ({"allOf": [{"$ref": "#/$defs/B"}, {"properties": {"x": INT}}], "$defs": {"B": {"properties": {"a": INT}}}},
     {"allOf": [{"properties": {"a": INT, "x": {}}, **SHUT}, {"properties": {"x": INT, "a": {}}, **SHUT}],
      "$defs": {"B": {"properties": {"a": INT}, **SHUT}}}),
    ({"properties": {"k": INT}, "additionalProperties": True, "anyOf": [{"properties": {"a": INT}}]},
     {"properties": {"k": INT}, "additionalProperties": True, "anyOf": [{"properties": {"a": INT}}]}),
    ({"type": "array", "prefixItems": [INT]}, {"type": "array", "prefixItems": [INT], "items": False}),
    ({"type": "array", "items": [INT]}, {"type": "array", "items": [INT], "additionalItems": False}),
    ({"const": {"properties": {"a": 1}}, "default": {"properties": {}}},  # data is never read as a schema
     {"const": {"properties": {"a": 1}}, "default": {"properties": {}}}),
])
def test_what_is_closed_and_what_stays_open(schema, closed):
    assert closed_schema(schema) == closed


def accepts(grammar, text: str, tokenizer) -> bool:
    matcher = grammar.matcher()
    return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and matcher.is_complete


@pytest.mark.parametrize("text,closed_takes,open_takes", [
    ('{"a": 1, "when": {"day": 2}, "f": {"site": 3}, "sort": {"by": 4}}', True, True),
    ('{"a": 1, "zz": 1}', False, True),
    ('{"a": 1, "when": {"day": 2, "zz": 1}}', False, True),
    ('{"a": 1, "f": {"zz": 1}}', False, True),
    ('{"a": 1, "sort": {"zz": 1}}', False, True),
])
def test_the_compiled_grammar_refuses_an_undeclared_key_at_every_depth_unless_asked_not_to(text, closed_takes,
                                                                                             open_takes):
    tokenizer = byte_tokenizer()
    compiler = GrammarCompiler(tokenizer)
    assert accepts(compiler.json_schema(NESTED), text, tokenizer) is closed_takes
    assert accepts(compiler.json_schema(NESTED, closed=False), text, tokenizer) is open_takes


def test_opened_objects_allof_halves_and_oneof_compile_as_the_peers_read_them():
    tokenizer = byte_tokenizer()
    compiler = GrammarCompiler(tokenizer)
    opened = compiler.json_schema({"properties": {"a": INT}, "additionalProperties": True})
    assert accepts(opened, '{"a": 1, "zz": [true]}', tokenizer)
    halves = compiler.json_schema({"allOf": [{"$ref": "#/$defs/B"}, {"properties": {"x": INT}}],
                                   "$defs": {"B": {"properties": {"a": INT}}}})
    assert accepts(halves, '{"a": 1, "x": 2}', tokenizer) and not accepts(halves, '{"a": 1, "y": 2}', tokenizer)
    union = compiler.json_schema({"oneOf": [{"properties": {"cat": INT}}, {"properties": {"dog": INT}}]})  # pydantic's
    assert accepts(union, '{"dog": 1}', tokenizer) and not accepts(union, '{"cat": 1, "dog": 1}', tokenizer)
    tuple_ = compiler.json_schema({"type": "array", "prefixItems": [INT]})
    assert accepts(tuple_, "[1]", tokenizer) and not accepts(tuple_, "[1, 2]", tokenizer)


FILTERED = {"type": "object", "required": ["q"], "properties": {"q": INT, "f": {"$ref": "#/$defs/F"},
                                                                "w": {"type": "object", "properties": {"d": INT}}},
            "$defs": {"F": {"type": "object", "properties": {"site": INT}}}}


@pytest.mark.parametrize("name,make,call", [
    ("hermes", hermes_tool_tokenizer, '<tool_call>\n{{"name": "find", "arguments": {}}}\n</tool_call>'),
    ("qwen3_5", qwen3_5_tool_tokenizer, "<tool_call>\n<function=find>\n{}</function>\n</tool_call>"),
])
def test_auto_grammars_close_tool_arguments_and_resolve_their_defs(name, make, call):
    tokenizer = make()
    fmt = tool_grammar.tool_call_format(tokenizer)
    grammar = GrammarCompiler(tokenizer).lark(tool_grammar.tool_call_lark(fmt, {"find": FILTERED}))

    def write(arguments: dict) -> str:
        if name == "hermes":
            return call.format('{' + ", ".join(f'"{k}": {v}' for k, v in arguments.items()) + '}')
        return call.format("".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items()))

    assert accepts(grammar, write({"q": 1, "f": '{"site": 2}', "w": '{"d": 3}'}), tokenizer)
    for wrong in ({"q": 1, "f": '{"zz": 2}'}, {"q": 1, "w": '{"d": 3, "zz": 4}'}, {"q": 1, "zz": 5}):
        assert not accepts(grammar, write(wrong), tokenizer), (name, wrong)


def test_a_tools_defs_resolve_where_its_arguments_sit():
    assert rebased(FILTERED, "/items/properties/arguments")["properties"]["f"] == {
        "$ref": "#/items/properties/arguments/$defs/F"}
    assert rebased({"const": {"$ref": "#/x"}}, "/p") == {"const": {"$ref": "#/x"}}
    assert tool_grammar.call_schema({"a": FILTERED, "b": FILTERED}, "/items")["anyOf"][1]["properties"]["arguments"][
        "properties"]["f"] == {"$ref": "#/items/anyOf/1/properties/arguments/$defs/F"}


STRICT = {"type": "object", "properties": {"a": INT}, "required": ["a"], **SHUT}


@pytest.mark.parametrize("schema,rule", [
    (STRICT, None),
    ({"type": "object", "properties": {"a": {"anyOf": [STRICT, {"type": "null"}]}}, "required": ["a"], **SHUT}, None),
    ({"type": "object", "properties": {"a": INT}, "required": ["a"]},
     "In context=(), 'additionalProperties' is required to be supplied and to be false."),
    ({**STRICT, "properties": {"a": INT, "b": INT}},
     "In context=(), 'required' is required to be supplied and to be an array including every key in properties. "
     "Missing 'b'."),
    ({**STRICT, "properties": {"a": {"type": "array", "items": {"type": "object", "properties": {"x": INT}}}}},
     "In context=('properties', 'a', 'items'), 'additionalProperties' is required to be supplied and to be false."),
    ({**STRICT, "$defs": {"D": {"type": "object", "properties": {}}}},
     "In context=('$defs', 'D'), 'additionalProperties' is required to be supplied and to be false."),
    ({**STRICT, "properties": {"a": {"oneOf": [INT]}}}, "In context=('properties', 'a'), 'oneOf' is not permitted."),
    ({**STRICT, "allOf": [STRICT]}, "In context=(), 'allOf' is not permitted."),
    ({"anyOf": [STRICT]}, "schema must be a JSON Schema of 'type: \"object\"', got 'type: \"None\"'."),
    ({"type": "array", "items": INT}, "schema must be a JSON Schema of 'type: \"object\"', got 'type: \"array\"'."),
])
def test_openai_strict_mode_rules_in_openai_words(schema, rule):
    assert strict_violation(schema) == rule


def structure(tokenizer, **body):
    request = ChatRequest(model="m", messages=[{"role": "user", "content": "Hi"}], **body)
    return asyncio.run(structure_of(request, Grammars(tokenizer, 262, [tokenizer.eos_token_id])))


def tool(parameters, strict=True, name="find"):
    return {"type": "function", "function": {"name": name, "parameters": parameters, "strict": strict}}


@pytest.mark.parametrize("body,param,code,message", [
    ({"tools": [tool(STRICT), tool({"type": "object", "properties": {"a": INT}}, name="bad")],
      "tool_choice": "required"}, "tools[1].function.parameters", "invalid_function_parameters",
     "Invalid schema for function 'bad': In context=(), 'additionalProperties' is required to be supplied and to be "
     "false."),
    ({"tools": [tool(STRICT, strict="yes")]}, "tools[0].function.strict", None, "must be true, false or absent"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
        "type": "object", "properties": {"a": INT}, **SHUT}}}}, "response_format.json_schema.schema", None,
     "Invalid schema for response_format 'p': In context=(), 'required' is required to be supplied and to be an "
     "array including every key in properties. Missing 'a'."),
])
def test_the_server_refuses_a_strict_schema_that_breaks_the_rules_by_name(body, param, code, message):
    with pytest.raises(APIError) as caught:
        structure(byte_tokenizer(), **body)
    error = caught.value
    assert (error.status, error.param, error.code) == (400, param, code) and message in error.message, error.message


def test_strict_under_auto_is_refused_where_the_format_cannot_enforce_a_string_pattern():
    pattern = {**STRICT, "properties": {"a": {"type": "string", "pattern": "^x+$"}}}
    with pytest.raises(APIError) as caught:
        structure(qwen3_5_tool_tokenizer(), tools=[tool(pattern)], tool_choice="auto")
    assert caught.value.param == "tools" and "the pattern of find's a" in caught.value.message
    assert structure(qwen3_5_tool_tokenizer(), tools=[tool(pattern, strict=False)], tool_choice="auto").grammar
    assert structure(hermes_tool_tokenizer(), tools=[tool(pattern)], tool_choice="auto").grammar  # JSON enforces it
    assert structure(qwen3_5_tool_tokenizer(), tools=[tool(pattern)], tool_choice="required").grammar
