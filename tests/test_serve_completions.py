"""Completions as OpenAI defines them and logprobs, through the real ``openai`` client against a server on a loopback
port: prompts as strings, lists of strings, ids and lists of ids (choices numbered across prompts and ``n``);
``echo`` with ``logprobs`` and ``max_tokens: 0``; completion and chat logprobs equal to the model's log-softmax at each
position (fp32, within 1e-4) with and without a prefix hit, streamed and not; a scoring request after a request that
stored the prefix without its logprobs; the fields that are refused by name."""

import httpx
import openai
import pytest
import torch
from test_serve import Server, alone, text_of

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.serve import EngineBackend, build_app, chat_prompt_ids
from hf_hybridcache.toy import build_model, byte_tokenizer

MODEL = "toy:jamba"
TOL = 1e-4
PREAMBLE = "Score these lines as a careful reader would, one after another, and keep to the facts given. " * 2


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
    yield server, cache
    server.close()


def log_softmax(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` float32: the cold model's log-probabilities of the token after each position."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def ids_of(text: str) -> list[int]:
    return byte_tokenizer()(text, add_special_tokens=False)["input_ids"]


def collect_stream(chunks) -> tuple[str, dict, object]:
    """Text, logprobs (lists joined over chunks) and the last usage of a streamed completion with one choice."""
    text, joined, usage = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                for key in joined:
                    joined[key] += getattr(choice.logprobs, key)
    return text, joined, usage


def check_completion_logprobs(logprobs: dict, ids: list[int], reference: torch.Tensor, first: int, k: int) -> None:
    """Token ``i`` of ``logprobs`` is ``ids[first + i]``: its logprob and its top ``k`` equal ``reference`` at the
    position before it (``first + i == 0``: none), and the offsets step by the tokens' texts."""
    texts = [byte_tokenizer().decode([t], skip_special_tokens=False) for t in ids[first:]]
    assert logprobs["tokens"] == texts
    assert logprobs["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    for i, (value, top) in enumerate(zip(logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)):
        position = first + i
        if position == 0:
            assert value is None and top is None
            continue
        row = reference[position - 1]
        assert abs(value - row[ids[position]].item()) < TOL, (position, value, row[ids[position]].item())
        assert top[texts[i]] == value  # the chosen token is always among them
        best = row.topk(k).values if k else row.topk(1).values
        assert len(top) <= k + 1 and abs(max(top.values()) - max(best[0].item(), value)) < TOL, position
        for text, alternative in top.items():  # the others are among the k most likely
            assert text == texts[i] or alternative >= best[-1].item() - TOL, (position, text, alternative)


def test_prompt_forms_number_choices_across_prompts_and_n(served, cold_model):
    server, _ = served
    client = server.client()
    prompts = ["Hello there, how", "General Kenobi, you are"]
    generated = [alone(cold_model, ids_of(p), 6) for p in prompts]
    solo = [text_of(ids) for ids in generated]
    both = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [solo[0], solo[0], solo[1], solo[1]]
    assert both.usage.prompt_tokens == sum(len(ids_of(p)) for p in prompts)
    assert both.usage.completion_tokens == 2 * sum(len(ids) for ids in generated)
    as_ids = client.completions.create(model=MODEL, prompt=[ids_of(p) for p in prompts], max_tokens=6, temperature=0)
    assert [c.text for c in as_ids.choices] == solo
    one = client.completions.create(model=MODEL, prompt=ids_of(prompts[1]), max_tokens=6, temperature=0, echo=True)
    assert one.choices[0].text == prompts[1] + solo[1] and one.choices[0].logprobs is None
    streamed = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True)
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == solo


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_echo_logprobs_equal_the_log_softmax_with_and_without_a_hit(served, cold_model, stream):
    """A scoring request (echo, logprobs, max_tokens 0) and then one that shares the preamble (a hit whose prompt
    logprobs come from the cache): every prompt token's logprob equals the cold model's log-softmax."""
    server, _ = served
    client = server.client()
    tag = "streamed" if stream else "whole"
    suffixes = ["First line: the sky is green.", "Second: water is dry.", "Third: stones float."]
    for turn, suffix in enumerate(suffixes):  # the second keeps a checkpoint where it leaves the first: the third hits
        prompt = f"[{tag}] " + PREAMBLE + suffix
        ids = ids_of(prompt)
        kwargs = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": 0, "temperature": 0}
        if stream:
            text, logprobs, usage = collect_stream(client.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}))
        else:
            reply = client.completions.create(**kwargs)
            (choice,) = reply.choices
            text, logprobs, usage = choice.text, choice.logprobs.model_dump(), reply.usage
            assert choice.finish_reason == "length"
        assert text == prompt and usage.completion_tokens == 0
        check_completion_logprobs(logprobs, ids, log_softmax(cold_model, ids), 0, 3)
        cached = usage.prompt_tokens_details.cached_tokens
        shared = len(ids_of(f"[{tag}] " + PREAMBLE))
        assert cached == {0: 0, 1: cached, 2: shared // 16 * 16}[turn], (turn, cached)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_generated_logprobs_equal_the_log_softmax(served, cold_model, stream):
    """``logprobs: k`` of generated tokens, and with ``echo`` and ``max_tokens`` the prompt's then the reply's, the
    second time with a hit."""
    server, _ = served
    client = server.client()
    prompt = PREAMBLE + f"Now continue ({stream}):"
    for echo in (False, True):
        kwargs = {"model": MODEL, "prompt": prompt, "logprobs": 5, "max_tokens": 8, "temperature": 0, "echo": echo}
        if stream:
            text, logprobs, _ = collect_stream(client.completions.create(**kwargs, stream=True))
        else:
            choice = client.completions.create(**kwargs).choices[0]
            text, logprobs = choice.text, choice.logprobs.model_dump()
        prompt_ids = ids_of(prompt)
        generated = alone(cold_model, prompt_ids, 8)
        ended = generated[-1:] == [byte_tokenizer().eos_token_id]
        assert text == (prompt if echo else "") + text_of(generated)
        full = prompt_ids + generated
        listed = full[: len(full) - ended]  # an ending EOS is not listed (its text is not in the reply)
        first = 0 if echo else len(prompt_ids)
        check_completion_logprobs(logprobs, listed, log_softmax(cold_model, full), first, 5)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_chat_logprobs_equal_the_log_softmax(served, cold_model, stream):
    server, _ = served
    client, tokenizer = server.client(), byte_tokenizer()
    messages = [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": f"Say something ({stream})."}]
    prompt_ids = chat_prompt_ids(tokenizer, messages)
    generated = alone(cold_model, prompt_ids, 10)
    ended = generated[-1:] == [tokenizer.eos_token_id]
    reference = log_softmax(cold_model, prompt_ids + generated)
    for turn in range(2):  # the second time the prompt is a hit
        kwargs = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0, "logprobs": True,
                  "top_logprobs": 4}
        if stream:
            content, entries, cached = "", [], None
            for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
                if chunk.usage is not None:
                    cached = chunk.usage.prompt_tokens_details.cached_tokens
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    entries += choice.logprobs.content if choice.logprobs is not None else []
        else:
            reply = client.chat.completions.create(**kwargs)
            content, entries = reply.choices[0].message.content, reply.choices[0].logprobs.content
            cached = reply.usage.prompt_tokens_details.cached_tokens
        assert content == text_of(generated) and (turn == 0 or cached > 0), (turn, cached)
        assert len(entries) == len(generated) - ended
        for i, entry in enumerate(entries):
            row = reference[len(prompt_ids) - 1 + i]
            token = generated[i]
            assert entry.token == tokenizer.decode([token], skip_special_tokens=False)
            assert entry.bytes == list(entry.token.encode()) and abs(entry.logprob - row[token].item()) < TOL
            best = row.topk(4)
            assert len(entry.top_logprobs) == 4
            for alternative, expected in zip(entry.top_logprobs, best.values.tolist()):
                assert abs(alternative.logprob - expected) < TOL, (i, alternative, expected)


def test_a_scoring_request_after_one_that_kept_no_logprobs(served, cold_model):
    """A plain completion stores the prefix's KV and checkpoints but no logprobs: a scoring request of a longer
    prompt restores only what its logprobs are kept for (reason ``prompt_logprobs``), equals the cold model, and the
    next scoring request that shares the prefix hits."""
    server, cache = served
    client = server.client()
    before = cache.stats.misses_by_reason["prompt_logprobs"]
    prefix = "A prefix first served without logprobs, long enough to store a few blocks of it. " * 2
    plain = client.completions.create(model=MODEL, prompt=prefix, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    for turn, tail in enumerate([" Then scored.", " Then scored again."]):
        ids = ids_of(prefix + tail)
        reply = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=0, temperature=0)
        check_completion_logprobs(reply.choices[0].logprobs.model_dump(), ids, log_softmax(cold_model, ids), 0, 2)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if turn == 0:
            assert cached == 0 and cache.stats.misses_by_reason["prompt_logprobs"] == before + 1
        else:  # the checkpoint the plain request kept, with the logprobs the scoring one kept up to it
            assert cached == len(ids_of(prefix)) // 16 * 16, cached


REFUSED = {
    "best_of": {"best_of": 3},
    "suffix": {"suffix": "and so on"},
    "logit_bias": {"logit_bias": {"5": 10}},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "presence_penalty": {"presence_penalty": -0.5},
    "guided_json": {"guided_json": {"type": "object"}},
    "max_tokens": {"max_tokens": 0},
    "logprobs": {"logprobs": 6},
}


def test_fields_not_implemented_are_refused_by_name(served):
    server, _ = served
    with httpx.Client(base_url=server.url) as http:
        for field, extra in REFUSED.items():
            response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", **extra})
            error = response.json()["error"]
            assert response.status_code == 400 and field in (error["param"] or ""), (field, error)
            assert field in error["message"] or error["param"] == field, (field, error)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        for extra, field in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21},
                                                                       "top_logprobs")):
            response = http.post("/v1/chat/completions", json={**chat, **extra})
            assert response.status_code == 400 and response.json()["error"]["param"] == field, extra
        same = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "best_of": 1, "max_tokens": 1,
                                                  "frequency_penalty": 0, "logit_bias": {}})
        assert same.status_code == 200, same.json()  # the values at which a field does nothing pass
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt="x", best_of=2, n=1)
