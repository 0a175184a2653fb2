"""Structured output and tool calls through the real ``openai`` client against a server on a loopback port:
``response_format`` with a JSON schema for 20 requests running in one engine batch (greedy and sampled) beside
requests without a grammar, which equal their runs alone; ``json_object``; ``tool_choice`` ``"required"`` and a named
function, whole and streamed (OpenAI's ``delta.tool_calls``); a reply cut by ``max_tokens`` (``"length"``); a grammar
request hits and stores prefixes as any other; the refusals. With the mask off the replies do not validate (power).
"""

import asyncio
import json
import threading
import time

import jsonschema
import openai
import pytest
from test_serve import Server, alone, text_of

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.engine import grammar as engine_grammar
from hf_hybridcache.serve import EngineBackend, SequentialBackend, build_app, chat_prompt_ids
from hf_hybridcache.toy import build_model, byte_tokenizer

pytest.importorskip("llguidance")

MODEL = "toy:jamba"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "member": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "member", "color"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 8},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["query", "limit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": SEARCH}}]
PARAMETERS = {"get_weather": WEATHER, "search": SEARCH}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MAX_TOKENS = 160  # enough for any reply of these schemas (strings hold at most 8 characters of up to 4 bytes)


@pytest.fixture(scope="module")
def cold_model():
    return build_model("jamba", seed=0)


@pytest.fixture(scope="module")
def served():
    model, tokenizer = build_model("jamba", seed=0), byte_tokenizer()
    cache = HybridPrefixCache(model)
    backend = EngineBackend(cache, [tokenizer.eos_token_id], max_running_requests=32, max_batch_tokens=2048)
    server = Server(build_app(backend, tokenizer, MODEL, cache))
    yield server, backend
    server.close()


def ask(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe person number {i} as JSON."}]


class Peak:
    """The most requests the engine ran at once while in use (polled)."""

    def __init__(self, backend) -> None:
        self.backend, self.peak, self.done = backend, 0, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, self.backend.load()[0])
            time.sleep(0.002)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def test_twenty_json_schema_replies_in_one_batch_validate_and_free_requests_beside_them_equal_their_runs_alone(
        served, cold_model):
    server, backend = served
    tokenizer = byte_tokenizer()

    async def everyone():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            structured = [client.chat.completions.create(
                model=MODEL, messages=ask(i), response_format=FORMAT, max_tokens=MAX_TOKENS,
                **({"temperature": 0} if i < 10 else {"temperature": 1.0, "seed": i})) for i in range(20)]
            free = [client.chat.completions.create(model=MODEL, messages=ask(100 + i), max_tokens=24, temperature=0)
                    for i in range(4)]
            return await asyncio.gather(*structured, *free)

    with Peak(backend) as peak:
        replies = asyncio.run(everyone())
    parsed = validated = 0
    for reply in replies[:20]:
        choice = reply.choices[0]
        document = json.loads(choice.message.content)
        parsed += 1
        jsonschema.validate(document, PERSON)
        validated += 1
        assert choice.finish_reason == "stop"
    print(f"\n20 json_schema replies (10 greedy, 10 sampled), {peak.peak} requests running at once: "
          f"{parsed} parsed, {validated} validated; e.g. {replies[0].choices[0].message.content}")
    assert (parsed, validated) == (20, 20) and peak.peak >= 20
    assert len({r.choices[0].message.content for r in replies[10:20]}) > 1  # sampled replies differ
    for i, reply in enumerate(replies[20:]):
        prompt = chat_prompt_ids(tokenizer, ask(100 + i))
        assert reply.choices[0].message.content == text_of(alone(cold_model, prompt, 24)), i


def test_json_object_and_streamed_json_schema(served):
    client = served[0].client()
    whole = client.chat.completions.create(model=MODEL, messages=ask(1), response_format={"type": "json_object"},
                                           max_tokens=MAX_TOKENS, temperature=0)
    if whole.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(whole.choices[0].message.content), dict)
    else:  # an object of any keys may run past max_tokens: what came is a prefix of one
        assert whole.choices[0].finish_reason == "length" and whole.choices[0].message.content.startswith("{")
    for temperature in (0, 1.0):
        chunks = list(client.chat.completions.create(model=MODEL, messages=ask(2), response_format=FORMAT,
                                                     max_tokens=MAX_TOKENS, temperature=temperature, seed=5,
                                                     stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        jsonschema.validate(json.loads(content), PERSON)
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_reply_cut_by_max_tokens_ends_with_length(served):
    reply = served[0].client().chat.completions.create(model=MODEL, messages=ask(3), response_format=FORMAT,
                                                       max_tokens=5, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content == '{"nam'  # the grammar's first bytes, then the budget ends


def test_tool_choice_required_returns_tool_calls_that_validate(served):
    client = served[0].client()
    seen = []
    for i in range(6):
        reply = client.chat.completions.create(
            model=MODEL, messages=ask(200 + i), tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS * 2,
            temperature=0 if i < 3 else 1.0, seed=i, parallel_tool_calls=i % 2 == 0)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls
        assert calls and (len(calls) == 1 or i % 2 == 0)
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
            seen.append((call.function.name, call.function.arguments))
    print(f"\ntool_choice required: {len(seen)} calls validated, e.g. {seen[:2]}")


def test_a_named_function_and_streamed_tool_calls_equal_the_whole_reply(served):
    client = served[0].client()
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in (choice, "required"):
        kwargs = {"model": MODEL, "messages": ask(300), "tools": TOOLS, "tool_choice": tool_choice,
                  "max_tokens": MAX_TOKENS * 2, "temperature": 0}
        whole = client.chat.completions.create(**kwargs).choices[0]
        chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
        calls = {}
        for chunk in chunks:
            assert not chunk.choices[0].delta.content
            for delta in chunk.choices[0].delta.tool_calls or []:
                if delta.index not in calls:
                    assert delta.id.startswith("call_") and delta.type == "function" and delta.function.name
                    calls[delta.index] = [delta.function.name, ""]
                calls[delta.index][1] += delta.function.arguments or ""
        assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "tool_calls"
        assert [tuple(calls[k]) for k in sorted(calls)] == [(c.function.name, c.function.arguments)
                                                          for c in whole.message.tool_calls]
        if tool_choice is choice:
            assert [c.function.name for c in whole.message.tool_calls] == ["get_weather"]
        for call in whole.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_request_with_a_grammar_hits_and_stores_as_any_other(served):
    client = served[0].client()
    messages = [{"role": "system", "content": "A long shared instruction that every request here starts with. " * 3},
                {"role": "user", "content": "Describe one person."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, response_format=FORMAT,
                                           max_tokens=MAX_TOKENS, temperature=0)
    free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, response_format=FORMAT,
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert free.usage.prompt_tokens_details.cached_tokens > 0  # the grammar request stored the prompt
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content


def test_what_cannot_be_done_is_refused_by_name(served):
    client = served[0].client()
    cases = [
        ({"tools": TOOLS}, "tool_choice", "auto"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "auto"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"},
         "tools[0].function.name", "letters"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format.json_schema.schema", "cannot be compiled"),
    ]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=ask(0), max_tokens=4, **kwargs)
        error = caught.value.body
        assert error["param"] == param and words in error["message"], (kwargs, error)
    none = client.chat.completions.create(model=MODEL, messages=ask(0), max_tokens=4, temperature=0, tools=TOOLS,
                                          tool_choice="none")
    assert none.choices[0].message.tool_calls is None


def test_the_sequential_baseline_follows_the_grammar_too(cold_model):
    tokenizer = byte_tokenizer()
    server = Server(build_app(SequentialBackend(cold_model, [tokenizer.eos_token_id]), tokenizer, MODEL))
    try:
        reply = server.client().chat.completions.create(model=MODEL, messages=ask(4), response_format=FORMAT,
                                                        max_tokens=MAX_TOKENS, temperature=0)
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    finally:
        server.close()


def test_power_without_the_mask_the_replies_do_not_parse(served, monkeypatch):
    """The same requests with the engine's grammar masks off: none of the replies is JSON of the schema."""
    monkeypatch.setattr(engine_grammar, "grammar_rows", lambda requests: None)
    monkeypatch.setattr(engine_grammar, "advance", lambda requests, tokens: None)
    client = served[0].client()
    valid = 0
    for i in range(4):
        content = client.chat.completions.create(model=MODEL, messages=ask(i), response_format=FORMAT,
                                                 max_tokens=MAX_TOKENS, temperature=0).choices[0].message.content
        try:
            jsonschema.validate(json.loads(content), PERSON)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    assert valid == 0
