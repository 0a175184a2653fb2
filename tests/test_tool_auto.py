"""``tool_choice: "auto"`` through the real ``openai`` client against a server on a loopback port, on a toy Jamba with
a chat template that writes tool calls as Qwen3 / Qwen3-Next do (hermes) or as Qwen3.5 does (``<function=NAME>``
markup; ``hf_hybridcache.toy.tool_template``), each test run for both formats: the format is read from the response
template or the chat template; the reader agrees with transformers' ``parse_response`` on crafted replies (Qwen3.5's
values read as Qwen's parser reads them) and streams prefixes of the whole; a random model under the text-or-calls
grammar writes text (its calls would need 12 exact bytes),
and with the text part of the grammar pinned to a preamble it must call: ``content`` plus ``tool_calls`` whose
arguments validate, streamed as OpenAI streams them; requests without tools beside them equal their runs alone. With
the reader off, or the masks off, the call assertions fail (power).
"""

import asyncio
import json
from dataclasses import replace

import jsonschema
import openai
import pytest
from test_serve import Server, alone, text_of
from test_structured import MODEL, PARAMETERS, TOOLS, ask

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.engine import grammar as engine_grammar
from hf_hybridcache.serve import EngineBackend, build_app, chat_prompt_ids, tool_calls
from hf_hybridcache.serve import structured as serve_structured
from hf_hybridcache.structured import GrammarCompiler, tool_grammar
from hf_hybridcache.toy import build_model, byte_tokenizer
from hf_hybridcache.toy.tool_template import hermes_tool_tokenizer, qwen3_5_tool_tokenizer

pytest.importorskip("llguidance")

PREAMBLE = "Let me check."
#: Each format's toy tokenizer, and the tokens of a preamble and one call (strings of up to 8 characters of up to 4
#: bytes; the markup of Qwen3.5's calls is longer).
FORMATS = {"hermes": (hermes_tool_tokenizer, 160), "qwen3_5": (qwen3_5_tool_tokenizer, 256)}


@pytest.fixture(scope="module", params=list(FORMATS))
def served(request):
    model, tokenizer = build_model("jamba", seed=0), FORMATS[request.param][0]()
    cache = HybridPrefixCache(model)
    backend = EngineBackend(cache, [tokenizer.eos_token_id], max_running_requests=16, max_batch_tokens=2048)
    server = Server(build_app(backend, tokenizer, MODEL, cache))
    server.tokenizer, server.max_tokens, server.format = tokenizer, FORMATS[request.param][1], request.param
    yield server
    server.close()


@pytest.fixture
def must_call(monkeypatch):
    """The grammar with its text part pinned to :data:`PREAMBLE` and no text-only branch: the reply must call."""
    monkeypatch.setattr(tool_grammar, "FREE_TEXT", PREAMBLE.replace(".", r"\.") + " ")
    build = tool_grammar.tool_call_lark
    monkeypatch.setattr(serve_structured, "tool_call_lark",
                        lambda *args: build(*args).replace("start: TEXT | ", "start: "))


def check_calls(message, finish_reason, parallel: bool) -> list[tuple[str, str]]:
    assert finish_reason == "tool_calls" and message.tool_calls, (finish_reason, message)
    assert message.content == PREAMBLE and (parallel or len(message.tool_calls) == 1)
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


def test_the_format_is_read_from_the_response_template_or_the_chat_template():
    assert tool_grammar.tool_call_format(hermes_tool_tokenizer()) is tool_grammar.HERMES
    assert tool_grammar.tool_call_format(hermes_tool_tokenizer(response_template=False)) is tool_grammar.HERMES
    assert tool_grammar.tool_call_format(qwen3_5_tool_tokenizer()) is tool_grammar.QWEN3_5
    assert tool_grammar.tool_call_format(qwen3_5_tool_tokenizer(response_template=False)) is tool_grammar.QWEN3_5
    assert tool_grammar.tool_call_format(byte_tokenizer()) is None  # no tool-call format in its template
    qwen3_5 = hermes_tool_tokenizer(response_template=False)
    qwen3_5.chat_template += "<tool_call>\n<function=example_function_name>"
    assert tool_grammar.tool_call_format(qwen3_5) is None
    xml_inline = hermes_tool_tokenizer()
    xml_inline.response_template = {**xml_inline.response_template, "fields": {"tool_calls": {
        "open_pattern": r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>", "content": "xml-inline"}}}
    assert tool_grammar.tool_call_format(xml_inline) is None
    assert "Qwen3-Next" in serve_structured.AUTO_REFUSED and "required" in serve_structured.AUTO_REFUSED
    assert "Qwen3.5" in serve_structured.AUTO_REFUSED


PLAN = {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "string"}},
                                         "fast": {"type": "boolean"}, "meta": {"type": "object"}},
        "required": ["steps"]}
QWEN3_5_CALL = "<tool_call>\n<function={}>\n{}</function>\n</tool_call>"
CRAFTED = {
    "hermes": [
        "Just text, no call.",
        (f'{PREAMBLE}\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Oslo", "unit": "celsius"}}}}\n'
         "</tool_call>"),
        ('<tool_call>\n{"name": "search", "arguments": {"query": "a\\"b}", "limit": 3}}\n</tool_call>\n<tool_call>\n'
         '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "fahrenheit"}}\n</tool_call>'),
    ],
    "qwen3_5": [
        "Just text, no call.",
        f"{PREAMBLE}\n\n" + QWEN3_5_CALL.format("get_weather", "<parameter=city>\nOslo\n</parameter>\n"
                                                 "<parameter=unit>\ncelsius\n</parameter>\n"),
        QWEN3_5_CALL.format("search", '<parameter=query>\na"b}\n<x> ü\n</parameter>\n'
                                      '<parameter=limit>\n3\n</parameter>\n')
        + "\n" + QWEN3_5_CALL.format("plan", '<parameter=steps>\n["go", "see"]\n</parameter>\n<parameter=fast>\nTrue\n'
                                     '</parameter>\n<parameter=meta>\n{"a": [1, null]}\n</parameter>\n'),
    ],
}


def as_qwen_reads(arguments: dict, schema: dict) -> dict:
    """transformers' ``xml-inline`` values (text) read as Qwen's parser reads them: a string's as it is, others JSON
    (Python's True / False as JSON's)."""
    return {k: v if tool_grammar.is_raw_string(schema["properties"].get(k)) else
            json.loads({"True": "true", "False": "false"}.get(v, v)) for k, v in arguments.items()}


@pytest.mark.parametrize("name,text", [(name, text) for name, texts in CRAFTED.items() for text in texts])
def test_the_reader_agrees_with_transformers_parse_response(name, text):
    tokenizer = FORMATS[name][0]()
    functions = {**PARAMETERS, "plan": PLAN}
    fmt = replace(tool_grammar.tool_call_format(tokenizer), functions=functions)
    parsed = tokenizer.parse_response(text, prefix="")
    reply = tool_calls.read_reply(text, fmt, final=True)
    assert (reply.content or None) == (parsed.get("content") or None) if reply.calls else reply.content == text
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.get("tool_calls", [])]
    if fmt.kind == "xml":
        expected = [(n, as_qwen_reads(arguments, functions[n])) for n, arguments in expected]
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == expected
    assert reply.whole == bool(reply.calls) and all(c.complete for c in reply.calls)
    cut = tool_calls.read_reply(text[:-20], fmt, final=True)  # as max_tokens cuts it
    assert not cut.whole and [c.name for c in cut.calls] == [c.name for c in reply.calls][:len(cut.calls)]
    for end in range(len(text)):  # streamed: what each prefix reads is a prefix of the whole
        part = tool_calls.read_reply(text[:end], fmt, final=False)
        assert reply.content.startswith(part.content) and len(part.calls) <= len(reply.calls)
        assert all(c.arguments.startswith(p.arguments) for p, c in zip(part.calls, reply.calls)), (end, part)


def test_the_qwen3_5_grammar_takes_the_templates_own_calls_and_refuses_others():
    tokenizer = qwen3_5_tool_tokenizer()
    grammar = GrammarCompiler(tokenizer).lark(tool_grammar.tool_call_lark(tool_grammar.QWEN3_5, PARAMETERS))
    calls = [{"type": "function", "function": {"name": "search", "arguments": {"query": "Oslo", "limit": 4}}},
             {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "a<b", "unit": "celsius"}}}]
    written = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ok.",
                                             "tool_calls": calls}], tools=TOOLS, tokenize=False)
    reply = written[written.rindex("<|assistant|>") + len("<|assistant|>"):-len("</s>")]

    def takes(text: str) -> bool:
        matcher = grammar.matcher()
        return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and \
            matcher.accept(tokenizer.eos_token_id)

    assert takes(reply) and takes("Just text.")
    for wrong in [("limit>\n4", "limit>\n10"), ("Oslo", " Oslo"), ("Oslo", "Oslo-Gardermoen"), ("celsius", "kelvin"),
                  ("<parameter=query>\nOslo\n</parameter>\n", ""), ("search", "browse")]:
        assert not takes(reply.replace(*wrong)), wrong


def test_auto_without_a_call_is_text_and_free_requests_beside_it_equal_their_runs_alone(served):
    cold, tokenizer = build_model("jamba", seed=0), served.tokenizer

    async def everyone():
        async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0) as client:
            auto = [client.chat.completions.create(
                model=MODEL, messages=ask(400 + i), tools=TOOLS, max_tokens=24,
                **({"tool_choice": "auto"} if i % 2 else {}), **({"temperature": 0} if i < 2 else {"seed": i}))
                for i in range(4)]
            free = [client.chat.completions.create(model=MODEL, messages=ask(500 + i), max_tokens=16, temperature=0)
                    for i in range(3)]
            return await asyncio.gather(*auto, *free)

    replies = asyncio.run(everyone())
    for reply in replies[:4]:  # a random model does not spell out <tool_call>\n: the text branch
        choice = reply.choices[0]
        assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
        assert "<tool_call>\n" not in choice.message.content
    for i, reply in enumerate(replies[4:]):
        prompt = chat_prompt_ids(tokenizer, ask(500 + i))
        assert reply.choices[0].message.content == text_of(alone(cold, prompt, 16)), i


def test_auto_that_calls_returns_content_and_tool_calls_whole_and_streamed(served, must_call):
    client, seen = served.client(), []
    for i, parallel in enumerate([False, False, True]):  # greedy, this toy writes calls until max_tokens
        kwargs = {"model": MODEL, "messages": ask(600 + i), "tools": TOOLS, "tool_choice": "auto",
                  "max_tokens": served.max_tokens * (3 if parallel else 1), "parallel_tool_calls": parallel,
                  **({"temperature": 0} if i == 0 else {"temperature": 1.0, "seed": i})}
        whole = client.chat.completions.create(**kwargs).choices[0]
        seen += check_calls(whole.message, whole.finish_reason, parallel)
        chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
        content, calls = "", {}
        for chunk in chunks:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                if piece.index not in calls:
                    assert piece.id.startswith("call_") and piece.type == "function" and piece.function.name
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls" and content == PREAMBLE
        if kwargs["temperature"] == 0:
            assert [tuple(calls[k]) for k in sorted(calls)] == seen[:len(calls)]
    print(f"\ntool_choice auto, {served.format} (text pinned to a preamble): {len(seen)} calls validated, "
          f"e.g. {seen[:2]}")


def test_power_without_the_reader_or_the_masks_the_calls_fail(served, must_call, monkeypatch):
    client = served.client()
    kwargs = {"model": MODEL, "messages": ask(700), "tools": TOOLS, "tool_choice": "auto",
              "max_tokens": served.max_tokens, "temperature": 0, "parallel_tool_calls": False}
    with monkeypatch.context() as patch:
        patch.setattr(tool_calls, "read_reply", lambda text, fmt, final: tool_calls.Reply(text, [], False))
        choice = client.chat.completions.create(**kwargs).choices[0]
        with pytest.raises(AssertionError):
            check_calls(choice.message, choice.finish_reason, False)
    with monkeypatch.context() as patch:
        patch.setattr(engine_grammar, "grammar_rows", lambda requests: None)
        patch.setattr(engine_grammar, "advance", lambda requests, tokens: None)
        choice = client.chat.completions.create(**kwargs).choices[0]
        with pytest.raises(AssertionError):
            check_calls(choice.message, choice.finish_reason, False)
    choice = client.chat.completions.create(**kwargs).choices[0]  # and back on, they pass
    check_calls(choice.message, choice.finish_reason, False)


def test_a_tokenizer_without_a_known_format_still_refuses_auto():
    tokenizer = byte_tokenizer()
    backend = EngineBackend(HybridPrefixCache(build_model("jamba", seed=0)), [tokenizer.eos_token_id])
    server = Server(build_app(backend, tokenizer, MODEL))
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            server.client().chat.completions.create(model=MODEL, messages=ask(0), max_tokens=4, tools=TOOLS)
        assert caught.value.body["param"] == "tool_choice" and "Qwen3-Next" in caught.value.body["message"]
    finally:
        server.close()
