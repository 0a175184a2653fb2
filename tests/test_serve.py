"""The OpenAI-compatible server through the real ``openai`` client, on a loopback port: completions and chat (JSON and
SSE), multi-turn hits, 16 concurrent conversations equal to each alone with greedy generate() and no cache,
cancellation by disconnect, every bad input (4xx JSON errors beside a request that keeps running), a failing forward
(500 for that request only), tenants, and /metrics parsed."""

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.serve import EngineBackend, ReplyMemory, SequentialBackend, build_app, chat_prompt_ids
from hf_hybridcache.serve.app import COMPLETION_MAX_TOKENS, reply_tokens
from hf_hybridcache.serve.schema import APIError
from hf_hybridcache.toy import build_model, byte_tokenizer

MODEL = "toy:jamba"
SYSTEM = "You are a terse assistant. Answer in one short line, and never repeat the question back. " * 2


class Server:
    """A uvicorn server of ``app`` in a thread, on a free loopback port."""

    def __init__(self, app) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)

    def metrics(self) -> dict:
        text = httpx.get(f"{self.url}/metrics").text
        return {s.name + s.labels.get("le", ""): s.value for f in text_string_to_metric_families(text)
                for s in f.samples if not s.labels or "le" in s.labels}

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def cold_model():
    return build_model("jamba", seed=0)


@pytest.fixture(scope="module")
def served(speculation):  # built again for the speculation runs
    model = build_model("jamba", seed=0)
    tokenizer = byte_tokenizer()
    cache = HybridPrefixCache(model)
    backend = EngineBackend(cache, [tokenizer.eos_token_id], max_running_requests=16, max_batch_tokens=256)
    server = Server(build_app(backend, tokenizer, MODEL, cache))
    yield server, model, cache
    server.close()


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def alone(cold_model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy generate() without a cache, stopped at the byte tokenizer's EOS (as the server stops); the mask keeps a
    generated pad token that a later turn sends back from being masked."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = cold_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                  do_sample=False, eos_token_id=2, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def text_of(ids: list[int]) -> str:
    return byte_tokenizer().decode(ids, skip_special_tokens=True)


def test_completions_and_chat_json_and_streams_equal_generate(server, cold_model):
    client, tokenizer = server.client(), byte_tokenizer()
    prompt = "The quick brown fox jumps over the lazy dog, and then"
    expected = text_of(alone(cold_model, tokenizer(prompt)["input_ids"], 12))
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected and whole.object == "text_completion"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    expected = text_of(alone(cold_model, chat_prompt_ids(tokenizer, messages), 10))
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == expected and reply.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_stop_n_and_tenants(server, cold_model):
    client, tokenizer = server.client(), byte_tokenizer()
    prompt = "Once upon a time, in a land far away"
    expected = text_of(alone(cold_model, tokenizer(prompt)["input_ids"], 16))
    stop = expected[5:7]
    assert stop and expected.find(stop) >= 0
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "\x00\x01"])
    assert cut.choices[0].text == expected[: expected.find(stop)] and cut.choices[0].finish_reason == "stop"
    both = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, n=2)
    assert [c.text for c in both.choices] == [expected, expected] and both.usage.completion_tokens == 32
    sampled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.3, top_p=0.9, seed=3)
    assert sampled.choices[0].finish_reason in ("stop", "length")
    # The same seed again, now beside two more choices in the same steps (seeds 4 and 5): the same text.
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.3, top_p=0.9, seed=3,
                                      n=3)
    assert again.choices[0].text == sampled.choices[0].text
    assert len({c.text for c in again.choices}) > 1

    long = "A tenant's own long preamble that nobody else sends. " * 3
    first = client.completions.create(model=MODEL, prompt=long, max_tokens=2, temperature=0, user="tenant-a")
    other = client.completions.create(model=MODEL, prompt=long, max_tokens=2, temperature=0, user="tenant-b")
    again = client.completions.create(model=MODEL, prompt=long, max_tokens=2, temperature=0,
                                      extra_headers={"X-Tenant-Id": "tenant-a"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # tenant b never reuses tenant a's prefixes
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the header names the same tenant as `user`
    assert first.choices[0].text == other.choices[0].text == again.choices[0].text


def conversation(client_index: int, turn: int) -> str:
    return f"Client {client_index} asks question number {turn}: what comes after {client_index * 7 + turn}?"


async def converse(client: openai.AsyncOpenAI, index: int, turns: int, max_tokens: int) -> list:
    messages, record = [{"role": "system", "content": SYSTEM}], []
    for turn in range(turns):
        messages.append({"role": "user", "content": conversation(index, turn)})
        reply = await client.chat.completions.create(model=MODEL, messages=list(messages), max_tokens=max_tokens,
                                                     temperature=0)
        content = reply.choices[0].message.content
        record.append((content, reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens))
        messages.append({"role": "assistant", "content": content})
    return record


def test_sixteen_clients_six_turns_equal_each_alone_and_reuse_the_previous_turn(server, cold_model):
    clients, turns, max_tokens = 16, 6, 8

    async def everyone():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(converse(client, i, turns, max_tokens) for i in range(clients)))

    records = asyncio.run(everyone())
    tokenizer = byte_tokenizer()
    for index, record in enumerate(records):
        memory, messages = ReplyMemory(), [{"role": "system", "content": SYSTEM}]
        previous_prompt = 0
        for turn, (content, prompt_tokens, cached) in enumerate(record):
            messages.append({"role": "user", "content": conversation(index, turn)})
            prompt = chat_prompt_ids(tokenizer, messages, memory)
            reply_ids = alone(cold_model, prompt, max_tokens)
            ended = reply_ids[-1:] == [tokenizer.eos_token_id]
            memory.remember(None, prompt, text_of(reply_ids), reply_ids[:-1] if ended else reply_ids)
            assert (content, prompt_tokens) == (text_of(reply_ids), len(prompt)), (index, turn)
            if turn:  # at least the previous prompt (block-aligned), here also the reply
                assert cached >= previous_prompt // 16 * 16, (index, turn, cached, previous_prompt)
            previous_prompt = prompt_tokens
            messages.append({"role": "assistant", "content": content})


def test_replies_with_the_same_text_keep_their_own_ids():
    """Different invalid bytes decode to the same U+FFFD text: each conversation must get back its own reply ids (a
    memory keyed by the text alone gave the later reply's ids to both conversations)."""
    tokenizer, memory = byte_tokenizer(), ReplyMemory()
    byte_ff, byte_fe = tokenizer.convert_tokens_to_ids(["ÿ", "þ"])  # byte-level symbols of 0xff and 0xfe
    assert tokenizer.decode([byte_ff]) == tokenizer.decode([byte_fe]) == "\ufffd"
    turns = {}
    for name, reply in (("a", [byte_ff]), ("b", [byte_fe])):
        messages = [{"role": "user", "content": f"conversation {name}"}]
        prompt = chat_prompt_ids(tokenizer, messages, memory)
        memory.remember(None, prompt, "\ufffd", reply)
        turns[name] = (prompt, reply, messages)
    for prompt, reply, messages in turns.values():
        follow_up = [*messages, {"role": "assistant", "content": "\ufffd"}, {"role": "user", "content": "and?"}]
        assert chat_prompt_ids(tokenizer, follow_up, memory)[: len(prompt) + 1] == prompt + reply
        assert chat_prompt_ids(tokenizer, follow_up, memory, salt="other")[: len(prompt) + 1] != prompt + reply


def test_disconnect_mid_stream_cancels(server):
    client = server.client()
    # Greedy: this prompt's reply has no EOS in its first 400 tokens (sampled, an EOS among the first tokens ended
    # the stream before the disconnect about once in 50 runs).
    stream = client.completions.create(model=MODEL, prompt="Tell me a very long story about", max_tokens=3000,
                                       temperature=0, stream=True)
    pieces = [next(stream) for _ in range(3)]
    assert all(p.choices[0].finish_reason is None for p in pieces)
    assert server.metrics()["hf_hybridcache_running_requests"] == 1
    generated = server.metrics()["hf_hybridcache_generation_tokens_total"]
    stream.close()
    deadline = time.time() + 20
    while server.metrics()["hf_hybridcache_running_requests"] and time.time() < deadline:
        time.sleep(0.05)
    metrics = server.metrics()
    assert metrics["hf_hybridcache_running_requests"] == 0
    assert metrics["hf_hybridcache_generation_tokens_total"] - generated < 500
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=2).choices[0].text is not None


def test_a_non_streaming_client_that_goes_away_cancels_its_request():
    """A client that times out on a long non-streaming request: the server notices the disconnect and cancels the
    request, which frees its place (without it, the request ran to its max_tokens). The server of this test never
    ends a reply at EOS, so the request would run its 3,000 tokens."""
    tokenizer, cache = byte_tokenizer(), HybridPrefixCache(build_model("jamba", seed=0))
    server = Server(build_app(EngineBackend(cache, []), tokenizer, MODEL, cache))
    try:
        client = server.client()
        errors, seen_running = [], False

        def leave_early():
            try:
                client.with_options(timeout=1.5).completions.create(
                    model=MODEL, prompt="Tell me a very long story about", max_tokens=3000, temperature=1.0)
            except openai.APITimeoutError as error:
                errors.append(error)

        caller = threading.Thread(target=leave_early)
        caller.start()
        while caller.is_alive():  # seen running while the client waits (a check after it left races the cancel)
            seen_running |= server.metrics()["hf_hybridcache_running_requests"] == 1
            time.sleep(0.02)
        caller.join()
        assert len(errors) == 1 and seen_running
        deadline = time.time() + 20
        while server.metrics()["hf_hybridcache_running_requests"] and time.time() < deadline:
            time.sleep(0.05)
        metrics = server.metrics()
        assert metrics["hf_hybridcache_running_requests"] == 0
        assert metrics["hf_hybridcache_generation_tokens_total"] < 1000
        assert client.completions.create(model=MODEL, prompt="still here", max_tokens=2).choices[0].text is not None
    finally:
        server.close()


@pytest.mark.plain_only("reads the command's first line and /health only (the speculation flags' startup: "
                        "test_serve_speculative.py)")
def test_the_command_says_where_it_serves():
    """``python -m hf_hybridcache.serve`` prints the URL clients use (uvicorn's own line is below its log level)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "hf_hybridcache.serve", "--model", "toy:jamba", "--port",
                                str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = process.stdout.readline()
        assert line.strip() == (f"hf_hybridcache.serve: toy:jamba at http://127.0.0.1:{port}/v1 (OpenAI API; "
                                "/health, /metrics)"), line
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                assert process.poll() is None and time.time() < deadline, "the server did not start"
                time.sleep(0.2)
    finally:
        process.terminate()
        process.wait(timeout=60)


BAD_BODIES = {
    "unknown model": ({"model": "gpt-4", "prompt": "x"}, 404, "model_not_found"),
    "temperature out of range": ({"model": MODEL, "prompt": "x", "temperature": 2.5}, 400, None),
    "negative temperature": ({"model": MODEL, "prompt": "x", "temperature": -0.1}, 400, None),
    "top_p zero": ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, None),
    "n zero": ({"model": MODEL, "prompt": "x", "n": 0}, 400, None),
    "max_tokens zero": ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, None),
    "too many stops": ({"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, None),
    "empty prompt": ({"model": MODEL, "prompt": ""}, 400, None),
    "token outside the vocabulary": ({"model": MODEL, "prompt": [5, 10**6]}, 400, None),
    "over the limits": ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "context_length_exceeded"),
    "seed not an int": ({"model": MODEL, "prompt": "x", "seed": "s"}, 400, None),
    "no model": ({"prompt": "x"}, 400, None),
}
BAD_CHATS = {
    "no messages": ({"model": MODEL, "messages": []}, 400),
    "unknown role": ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    "content not text": ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    "unknown chat model": ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404),
}


def test_every_bad_input_gets_its_json_error_and_disturbs_no_one(server, cold_model):
    client, tokenizer = server.client(), byte_tokenizer()
    prompt = "A request that keeps running while others fail:"
    expected = text_of(alone(cold_model, tokenizer(prompt)["input_ids"], 40))
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True)
    text = next(stream).choices[0].text
    with httpx.Client(base_url=server.url) as http:
        for name, (body, status, code) in BAD_BODIES.items():
            response = http.post("/v1/completions", json=body)
            error = response.json()["error"]
            assert response.status_code == status and error["message"] and error["type"], name
            assert code is None or error["code"] == code, name
        for name, (body, status) in BAD_CHATS.items():
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == status and response.json()["error"]["message"], name
        for raw, says in ((b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object"), (b"", "JSON")):
            response = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            error = response.json()["error"]
            assert response.status_code == 400 and says in error["message"] and error["param"] is None, (raw, error)
        assert http.get("/v1/nothing").status_code == 404 and http.get("/v1/nothing").json()["error"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=9)
    text += "".join(chunk.choices[0].text for chunk in stream)
    assert text == expected


FIELD_MISTAKES = {  # endpoint, body, the field the 400 names, words of its message
    "max_tokens true": ("completions", {"prompt": "x", "max_tokens": True}, "max_tokens", "not a boolean"),
    "n true": ("completions", {"prompt": "x", "n": True}, "n", "not a boolean"),
    "a boolean token id": ("completions", {"prompt": [True, 2]}, "prompt", "not booleans"),
    "a boolean in a batch of ids": ("completions", {"prompt": [[5, 6], [7, False]]}, "prompt", "not booleans"),
    "chat max_completion_tokens true": ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                             "max_completion_tokens": True},
                                        "max_completion_tokens", "not a boolean"),
    "an empty stop string": ("completions", {"prompt": "x", "stop": [""]}, "stop", "must not be empty"),
    "stop empty": ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": ""}, "stop",
                   "must not be empty"),
    "null user content": ("chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0",
                          "user message needs `content`"),
    "null system content": ("chat/completions", {"messages": [{"role": "system", "content": None},
                                                              {"role": "user", "content": "hi"}]}, "messages.0",
                            "system message needs `content`"),
}


@pytest.mark.plain_only("every request is refused before it reaches the engine: nothing is decoded")
def test_a_boolean_integer_an_empty_stop_and_null_content_are_400s_naming_the_field(server):
    with httpx.Client(base_url=server.url) as http:
        for name, (endpoint, body, param, says) in FIELD_MISTAKES.items():
            response = http.post(f"/v1/{endpoint}", json={"model": MODEL, **body})
            error = response.json()["error"]
            assert (response.status_code, error["param"]) == (400, param) and says in error["message"], (name, error)
        messages = [{"role": "user", "content": "What is 2 + 2?"},
                    {"role": "assistant", "content": None,
                     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "4"}]
        response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
        assert response.status_code == 200, response.json()


@pytest.mark.plain_only("every request is refused before it reaches the engine: nothing is decoded")
def test_a_prompt_that_leaves_no_room_is_a_400_whoever_computed_max_tokens(served):
    """A prompt at or over the engine's limit is a 400 ``context_length_exceeded`` whether the client sent
    ``max_tokens`` or the server computed it (chat's default capped by the room left reached the engine as 0 and -9, a
    500): chat and completions, JSON and streams, ``n`` > 1. A seed whose ``seed + k`` (choice k) torch cannot seed a
    generator with is a 400 too (choice 1 of seed 2**64 - 1 was a 500)."""
    server = served[0]
    limit = server.server.config.app.state.backend.max_request_tokens
    client, tokenizer = server.client(), byte_tokenizer()
    template = len(chat_prompt_ids(tokenizer, [{"role": "user", "content": ""}]))

    def chat(prompt_tokens: int) -> list[dict]:
        return [{"role": "user", "content": "x" * (prompt_tokens - template)}]

    for prompt_tokens in (limit, limit + 9):  # exactly at the limit (room 0), and over it (room -9)
        assert len(chat_prompt_ids(tokenizer, chat(prompt_tokens))) == prompt_tokens
        cases = [
            (client.chat.completions.create, {"messages": chat(prompt_tokens)}),
            (client.chat.completions.create, {"messages": chat(prompt_tokens), "stream": True}),
            (client.chat.completions.create, {"messages": chat(prompt_tokens), "n": 2}),
            (client.chat.completions.create, {"messages": chat(prompt_tokens), "max_completion_tokens": 1}),
            (client.completions.create, {"prompt": [5] * prompt_tokens}),
            (client.completions.create, {"prompt": "x" * prompt_tokens, "stream": True}),
            (client.completions.create, {"prompt": [5] * prompt_tokens, "n": 3, "seed": 1}),
            (client.completions.create, {"prompt": [5] * prompt_tokens, "max_tokens": 1}),
        ]
        for create, kwargs in cases:
            with pytest.raises(openai.BadRequestError) as refused:
                create(model=MODEL, temperature=0, **kwargs)
            error, case = refused.value.body, (prompt_tokens, sorted(kwargs))
            assert error["code"] == "context_length_exceeded", case
            assert error["param"] == ("messages" if "messages" in kwargs else "prompt"), case
            assert f"prompt ({prompt_tokens} tokens)" in error["message"] and str(limit) in error["message"], case
    for seed in (2**64 - 1, 2**63, -(2**63) - 1):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2, seed=seed)
        assert refused.value.body["param"] == "seed", seed
    edge = client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2, seed=2**63 - 1)
    assert [c.finish_reason in ("stop", "length") for c in edge.choices] == [True, True]


def test_a_computed_max_tokens_is_the_default_capped_by_the_room_left():
    """The values :func:`reply_tokens` gives the engine (a prompt one token short of the limit gets one token; a
    completion sent without ``max_tokens`` 5 tokens short of it gets 5, not a 400 for OpenAI's default 16), and a
    server built with no default room at all is refused when built."""
    assert reply_tokens(99, None, 256, 100, "messages") == 1
    assert reply_tokens(95, None, COMPLETION_MAX_TOKENS, 100, "prompt") == 5
    assert reply_tokens(10, None, COMPLETION_MAX_TOKENS, 100, "prompt") == 16
    assert reply_tokens(10, 90, COMPLETION_MAX_TOKENS, 100, "prompt") == 90
    for prompt_tokens, max_tokens in ((100, None), (109, None), (100, 1), (91, 10)):
        with pytest.raises(APIError) as refused:
            reply_tokens(prompt_tokens, max_tokens, 256, 100, "prompt")
        assert (refused.value.status, refused.value.code) == (400, "context_length_exceeded")
    for default in (0, -1, True):
        with pytest.raises(ValueError, match="default_max_tokens must be a positive int"):
            build_app(None, byte_tokenizer(), MODEL, default_max_tokens=default)


def test_a_failing_forward_is_a_500_for_that_request_only(served, cold_model):
    server, model, _ = served
    client, tokenizer = server.client(), byte_tokenizer()
    poison = tokenizer("\x07\x07\x07")["input_ids"]

    def raise_on_poison(module, args):
        ids = args[0][0].tolist()
        if any(ids[i : i + 3] == poison for i in range(len(ids) - 2)):
            raise RuntimeError("poisoned input")

    handle = model.get_input_embeddings().register_forward_pre_hook(raise_on_poison)
    try:
        good = "A good request beside a bad one"
        expected = text_of(alone(cold_model, tokenizer(good)["input_ids"], 12))
        stream = client.completions.create(model=MODEL, prompt=good, max_tokens=12, temperature=0, stream=True)
        with pytest.raises(openai.InternalServerError) as failed:
            client.completions.create(model=MODEL, prompt="bad \x07\x07\x07 bad", max_tokens=4)
        assert "poisoned input" in failed.value.body["message"] and failed.value.body["type"] == "server_error"
        assert "".join(chunk.choices[0].text for chunk in stream) == expected
    finally:
        handle.remove()
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_metrics_parse_and_add_up(server):
    client = server.client()
    before = server.metrics()
    reply = client.completions.create(model=MODEL, prompt="Counting tokens for the metrics " * 3, max_tokens=5,
                                      temperature=0)
    after = server.metrics()
    grew = {name: after[name] - before.get(name, 0) for name in after}
    assert grew["hf_hybridcache_prompt_tokens_total"] == reply.usage.prompt_tokens
    assert grew["hf_hybridcache_generation_tokens_total"] == reply.usage.completion_tokens
    assert grew["hf_hybridcache_hit_tokens_total"] == reply.usage.prompt_tokens_details.cached_tokens
    assert grew["hf_hybridcache_time_to_first_token_seconds_count"] == 1
    assert grew["hf_hybridcache_time_per_output_token_seconds_count"] == reply.usage.completion_tokens - 1
    assert after["hf_hybridcache_cache_stored_bytes"] > 0 and after["hf_hybridcache_waiting_requests"] == 0
    for name in ("hf_hybridcache_cache_evicted_kv_blocks_total", "hf_hybridcache_cache_remote_hit_tokens_total"):
        assert name in after


@pytest.mark.plain_only("--no-cache's sequential baseline has no engine (--speculative with --no-cache is refused)")
def test_the_sequential_baseline_serves_the_same_text(cold_model):
    tokenizer = byte_tokenizer()
    server = Server(build_app(SequentialBackend(cold_model, [tokenizer.eos_token_id]), tokenizer, MODEL))
    try:
        prompt = "The baseline server answers"
        expected = text_of(alone(cold_model, tokenizer(prompt)["input_ids"], 10))
        reply = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
        assert reply.choices[0].text == expected and reply.usage.prompt_tokens_details.cached_tokens == 0
        assert json.loads(httpx.get(f"{server.url}/health").text)["status"] == "ok"
    finally:
        server.close()


def test_chat_fields_not_implemented_are_refused_by_name(server):
    """OpenAI chat fields the server does not implement, and unknown fields, are a 400 naming the field; the value at
    which such a field does nothing, and OpenAI's bookkeeping labels, are accepted."""
    client = server.client()
    messages = [{"role": "user", "content": "hi"}]
    refused = [({"frequency_penalty": 0.5}, "frequency_penalty"), ({"presence_penalty": -1.0}, "presence_penalty"),
               ({"logit_bias": {"5": 10}}, "logit_bias"), ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
               ({"modalities": ["text", "audio"]}, "modalities"), ({"store": True}, "store"),
               ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
               ({"functions": [{"name": "f"}]}, "functions"), ({"extra_body": {"colour": "red"}}, "colour")]
    for kwargs, field in refused:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **kwargs)
        assert error.value.param == field and field in error.value.message, (field, error.value.message)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, frequency_penalty=0,
                                           modalities=["text"], metadata={"run": "7"}, store=False)
    assert reply.choices[0].message.content is not None
