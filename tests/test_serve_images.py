"""Images in chat messages through the real ``openai`` client against a server on a loopback port (issue 34), serving a
tiny Qwen3.5 wrapper saved as a checkpoint is published (``hf_hybridcache.toy.vision.save_vlm``: weights, and a
processor made in code that ``AutoProcessor`` loads with ``--trust-remote-code``): a base64 image chat equals a solo
greedy ``generate()`` of the processor's own prompt; the second turn about the same image reports cached tokens past
the image; 8 clients at once with different images and questions equal their solo runs; PNG, JPEG and WebP data
URLs, ``detail`` accepted; every bad image part is a 400 that says what is wrong, and the server keeps serving;
remote URLs refused without ``--allow-remote-images`` and fetched with it (a loopback HTTP server), within the size
and time limits.
"""

import asyncio
import base64
import io
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
import torch
from speculation_runs import serve_flags
from test_serve import Server

from hf_hybridcache.serve import ReplyMemory, SequentialBackend, build_app, image_prompt
from hf_hybridcache.serve.__main__ import make_app, parse_args
from hf_hybridcache.serve.loading import load, load_processor
from hf_hybridcache.toy import build_model, byte_tokenizer
from hf_hybridcache.toy.vision import IMAGE, save_vlm, toy_image

MODEL = "toy-qwen3_5-vl"
MAX_TOKENS = 6
#: The server's --max-image-bytes: the toy images take about 5 KB as PNG, a 160 x 160 noise PNG about 77 KB.
LIMIT = 32 * 1024


def data_url(image, kind: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=kind)
    return f"data:image/{kind.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def user(text: str, *urls: str, detail: str | None = None) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}
             for url in urls]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("vlm") / "qwen3_5"
    save_vlm(path, "qwen3_5", seed=0)
    return path


@pytest.fixture(scope="module")
def served(folder, speculation):  # built again for the speculation runs
    args = parse_args(["--model", str(folder), "--trust-remote-code", "--served-model-name", MODEL,
                       "--max-image-bytes", str(LIMIT), "--max-running-requests", "8", "--max-batch-tokens", "1024",
                       *serve_flags(speculation)])
    server = Server(make_app(args))
    yield server
    server.close()


@pytest.fixture(scope="module")
def solo(folder):
    """Greedy generate() without a cache on the same checkpoint, on the prompt the processor gives."""
    model, _ = load(str(folder), trust_remote_code=True)
    processor = load_processor(str(folder), trust_remote_code=True)

    def run(messages: list[dict], images: list, memory: ReplyMemory) -> tuple[str, list[int]]:
        ids, inputs, key = image_prompt(processor, messages, images, memory)
        prompt = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **inputs, max_new_tokens=MAX_TOKENS,
                                 do_sample=False, eos_token_id=processor.tokenizer.eos_token_id, pad_token_id=0)
        reply = out[0, len(ids):].tolist()
        text = processor.tokenizer.decode(reply, skip_special_tokens=True)
        ended = reply[-1:] == [processor.tokenizer.eos_token_id]
        memory.remember(None, ids, text, reply[:-1] if ended else reply, key)
        run.reply = reply[:-1] if ended else reply
        return text, ids

    run.processor = processor
    return run


def template_form(message: dict) -> dict:
    """A chat message as the processor's template takes it (image parts as ``{"type": "image"}``)."""
    if isinstance(message["content"], str):
        return message
    return {"role": message["role"], "content": [{"type": "image"} if p["type"] == "image_url" else p
                                                 for p in message["content"]]}


def test_an_image_chat_equals_its_solo_run_and_the_second_turn_hits_past_the_image(served, solo):
    client, image = served.client(), toy_image(5)
    messages = [user("What is on this screen?", data_url(image))]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    memory = ReplyMemory()
    expected, ids = solo([template_form(m) for m in messages], [image], memory)
    # The prompt is the processor's own (its chat template with the image, then the processor).
    reference = solo.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text":
                                                                          "What is on this screen?"}]}],
        add_generation_prompt=True, tokenize=True, return_dict=True)
    assert reference["input_ids"][0] == ids and ids.count(IMAGE) == 24
    assert first.choices[0].message.content == expected and first.usage.prompt_tokens == len(ids)
    reply = solo.reply
    messages += [{"role": "assistant", "content": expected}, user("And what colour is the box?")]
    before = served.metrics()
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    grew = {name: value - before[name] for name, value in served.metrics().items() if "_cache_images" in name}
    # The hit holds the image: the vision tower does not run for it.
    assert grew == {"hf_hybridcache_cache_images_encoded_total": 0, "hf_hybridcache_cache_images_skipped_total": 1}
    expected, second_ids = solo([template_form(m) for m in messages], [image], memory)
    assert second_ids[: len(ids) + len(reply)] == ids + reply  # the reply as generated, not re-encoded
    assert second.choices[0].message.content == expected and second.usage.prompt_tokens == len(second_ids)
    last_placeholder = max(i for i, t in enumerate(second_ids) if t == IMAGE)
    assert second.usage.prompt_tokens_details.cached_tokens > last_placeholder


def test_another_image_with_the_same_question_is_another_reply_and_no_hit_past_it(served, solo):
    """Power of the tests above: the image reaches the reply (two images, same ids, different replies), and equal ids
    with another image do not hit past the image's first block."""
    client = served.client()
    replies, hits = [], []
    for seed in (11, 12):
        reply = client.chat.completions.create(model=MODEL, messages=[user("Describe it.", data_url(toy_image(seed)))],
                                               max_tokens=MAX_TOKENS, temperature=0)
        replies.append(reply.choices[0].message.content)
        hits.append(reply.usage.prompt_tokens_details.cached_tokens)
    assert replies[0] != replies[1]
    ids = solo.processor.apply_chat_template([{"role": "user", "content": [{"type": "image", "image": toy_image(12)},
                                                                            {"type": "text", "text": "Describe it."}]}],
                                             add_generation_prompt=True, tokenize=True)[0]
    assert hits[1] <= ids.index(IMAGE)


def test_a_new_image_in_a_later_turn_equals_its_solo_run_whole_and_streamed(served, solo):
    """Images in two user messages (the second after a remembered reply): the prompt's pieces each get their own
    image, the turn equals its solo run, streamed too, and hits past the first image."""
    client, first_image, second_image = served.client(), toy_image(21), toy_image(22, width=64)
    messages = [user("Look at this one.", data_url(first_image))]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    memory = ReplyMemory()
    solo([template_form(m) for m in messages], [first_image], memory)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 user("Now compare it with this one.", data_url(second_image))]
    expected, ids = solo([template_form(m) for m in messages], [first_image, second_image], memory)
    # The pieces' pixel tensors, concatenated, are the processor's for both images at once.
    _, inputs, _ = image_prompt(solo.processor, [template_form(m) for m in messages], [first_image, second_image])
    whole = solo.processor(text=solo.processor.image_token * 2, images=[first_image, second_image],
                           return_tensors="pt")
    assert all(torch.equal(inputs[name], whole[name]) for name in ("pixel_values", "image_grid_thw"))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    usage = chunks[-1].usage
    placeholders = [i for i, t in enumerate(ids) if t == IMAGE]
    assert usage.prompt_tokens == len(ids) and len(placeholders) == 24 + 32
    assert placeholders[23] < usage.prompt_tokens_details.cached_tokens <= placeholders[24]  # past the first only


def test_the_reply_memory_keys_replies_by_their_images(solo):
    """Equal prompt ids and reply text after another image are another reply: its ids are not spliced in."""
    first = [template_form(user("Which one?", data_url(toy_image(41))))]
    ids, _, key = image_prompt(solo.processor, first, [toy_image(41)])
    memory, generated = ReplyMemory(), [65, 66, 67]  # ids that "same" does not encode to
    memory.remember(None, ids, "same", generated, key)
    chat = [*first, {"role": "assistant", "content": "same"}, {"role": "user", "content": "Why?"}]
    for seed, spliced in ((41, True), (42, False)):  # image 42 has the size, so the ids, of image 41
        prompt, _, _ = image_prompt(solo.processor, chat, [toy_image(seed)], memory)
        assert (prompt[len(ids) : len(ids) + 3] == generated) is spliced, seed


def test_a_reply_that_holds_a_placeholder_id_is_not_spliced_into_the_next_turn(solo):
    """A reply whose generated ids hold an image or video placeholder id (the tiny model samples them) is taken from
    its text: spliced in, the id stood for an image the request does not hold, and the next turn failed with a 500
    (the engine refuses the prompt; --no-cache's generate() raised TypeError). Fails without the filter."""
    first = [template_form(user("Which one?", data_url(toy_image(43))))]
    ids, _, key = image_prompt(solo.processor, first, [toy_image(43)])
    video = solo.processor.tokenizer.convert_tokens_to_ids(solo.processor.video_token)
    memory = ReplyMemory()
    memory.remember(None, ids, "ok", [111, 107, video], key)  # decoded without the special token: "ok"
    chat = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "Why?"}]
    prompt, _, _ = image_prompt(solo.processor, chat, [toy_image(43)], memory)
    assert video not in prompt and IMAGE not in prompt[len(ids) :]
    assert prompt == image_prompt(solo.processor, chat, [toy_image(43)])[0]  # as without the memory


def test_replicas_share_reply_ids_by_their_images_through_the_tier():
    """Behind a gateway the next turn may reach another replica: it finds the reply's ids in the tier under the same
    prompt, text and images, and not under other images (a text prompt's key is the one it had)."""
    from redis_server import RedisServer, require_redis

    from hf_hybridcache import HybridPrefixCache
    from hf_hybridcache.serve.reply_tier import reply_memory

    require_redis()
    server = RedisServer().start()
    try:
        writer, reader = (reply_memory(HybridPrefixCache(build_model("jamba", seed=0), remote=server.url))
                          for _ in range(2))
        writer.remember(None, [1, 2, 3], "reply", [9, 8], b"image a")
        writer.remember(None, [1, 2, 3], "reply", [5])
        assert reader.lookup(None, [1, 2, 3], "reply", b"image a") == [9, 8]
        assert reader.lookup(None, [1, 2, 3], "reply", b"image b") is None
        assert reader.lookup(None, [1, 2, 3], "reply") == [5]
    finally:
        server.stop()


async def _chat(client, index: int) -> list[tuple[str, int, int]]:
    image = toy_image(100 + index, width=32 + 16 * (index % 3))
    messages, record = [user(f"Client {index}: what is in the picture?", data_url(image))], []
    for turn in range(2):
        reply = await client.chat.completions.create(model=MODEL, messages=list(messages), max_tokens=MAX_TOKENS,
                                                     temperature=0)
        content = reply.choices[0].message.content
        record.append((content, reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens))
        messages += [{"role": "assistant", "content": content}, user(f"Client {index}, question {turn + 1}: why?")]
    return record, messages, image


def test_eight_clients_at_once_with_their_own_images_equal_their_solo_runs(served, solo):
    async def everyone():
        async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(_chat(client, i) for i in range(8)))

    for index, (record, messages, image) in enumerate(asyncio.run(everyone())):
        memory, asked = ReplyMemory(), []
        for turn, (content, prompt_tokens, cached) in enumerate(record):
            asked = [template_form(m) for m in messages[: 2 * turn + 1]]
            expected, ids = solo(asked, [image], memory)
            assert (content, prompt_tokens) == (expected, len(ids)), (index, turn)
            if turn:  # the first turn's prompt and reply, image included
                assert cached > max(i for i, t in enumerate(ids) if t == IMAGE), (index, cached)


@pytest.mark.parametrize("kind", ["JPEG", "WEBP"])
def test_jpeg_and_webp_parts_and_detail_are_taken(served, solo, kind):
    from PIL import Image

    url = data_url(toy_image(31), kind)
    decoded = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")  # lossy: as sent
    expected, _ = solo([template_form(user("Read it.", url))], [decoded], ReplyMemory())
    for detail in (None, "low", "high", "auto"):
        reply = served.client().chat.completions.create(model=MODEL, messages=[user("Read it.", url, detail=detail)],
                                                        max_tokens=MAX_TOKENS, temperature=0)
        assert reply.choices[0].message.content == expected, detail


def _noise_png(side: int) -> str:
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (side, side, 3), dtype=torch.uint8, generator=generator)
    return data_url(Image.fromarray(pixels.numpy()))


#: Bad image parts: (message, what the 400 says, the param it names).
BAD_PARTS = {
    "bad base64": (user("x", "data:image/png;base64,@@not base64@@"), "not valid base64", "content[0].image_url.url"),
    "not an image": (user("x", "data:image/png;base64," + base64.b64encode(b"hello there").decode()),
                     "not an image", "content[0].image_url.url"),
    "not an image type": (user("x", "data:text/plain;base64,aGVsbG8="), "not an image", "content[0].image_url.url"),
    "no base64": (user("x", "data:image/png,rawbytes"), "base64", "content[0].image_url.url"),
    "too large": (user("x", _noise_png(160)), "--max-image-bytes", "content[0].image_url.url"),
    "remote off": (user("x", "http://127.0.0.1:9/cat.png"), "--allow-remote-images", "content[0].image_url.url"),
    "other scheme": (user("x", "ftp://example.com/cat.png"), "data: URL", "content[0].image_url.url"),
    "in an assistant message": ({"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": data_url(toy_image(1))}}]}, "not in an assistant message", "image_url"),
    "bad detail": (user("x", data_url(toy_image(1)), detail="ultra"), "detail", None),
}


def test_every_bad_image_part_is_a_400_that_says_what_and_where(served, solo):
    with httpx.Client(base_url=served.url) as http:
        for name, (message, says, param) in BAD_PARTS.items():
            messages = [message] if message["role"] == "user" else [user("hi"), message, user("and?")]
            response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
            error = response.json()["error"]
            assert response.status_code == 400 and says in error["message"], (name, error)
            assert param is None or param in (error["param"] or ""), (name, error)
    image = toy_image(7)  # the server still serves images
    expected, _ = solo([template_form(user("Still there?", data_url(image)))], [image], ReplyMemory())
    reply = served.client().chat.completions.create(model=MODEL, messages=[user("Still there?", data_url(image))],
                                                    max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].message.content == expected


def test_a_completions_prompt_with_a_placeholder_token_is_a_400_and_the_server_keeps_serving(served):
    """/v1/completions takes text: a prompt holding the image placeholder (as text or as an id) was a 500 from the
    engine ('no images were passed'); now a 400 naming the token (fails without the check: InternalServerError)."""
    client = served.client()
    for prompt in ("Describe <|image_pad|> please", [72, 105, IMAGE]):
        with pytest.raises(openai.BadRequestError, match="placeholder token '<\\|image_pad\\|>'"):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt="Describe it", max_tokens=2, temperature=0)
    assert again.choices[0].finish_reason == "length"


def test_a_text_only_model_refuses_image_parts_with_a_400():
    model, tokenizer = build_model("jamba", seed=0), byte_tokenizer()
    server = Server(build_app(SequentialBackend(model, [tokenizer.eos_token_id]), tokenizer, "toy:jamba"))
    try:
        with pytest.raises(openai.BadRequestError, match="takes text only") as refused:
            server.client().chat.completions.create(model="toy:jamba", messages=[user("hi", data_url(toy_image(1)))],
                                                    max_tokens=2)
        assert refused.value.body["param"] == "messages[0].content[0].image_url.url"
        text = server.client().chat.completions.create(model="toy:jamba", messages=[user("hi")], max_tokens=2)
        assert text.choices[0].finish_reason in ("stop", "length")
    finally:
        server.close()


class Images(BaseHTTPRequestHandler):
    """Loopback image host: ``/cat.png`` (a toy PNG), ``/big.png`` (over the limit, no Content-Length), ``/slow.png``
    (its body after 3 s), anything else 404."""

    def do_GET(self):
        if self.path not in ("/cat.png", "/big.png", "/slow.png"):
            self.send_error(404)
            return
        body = base64.b64decode((_noise_png(160) if self.path == "/big.png" else data_url(toy_image(9))).split(",")[1])
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        if self.path == "/slow.png":
            time.sleep(3)
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_remote_urls_are_fetched_only_with_the_flag_within_size_and_time(folder, solo):
    host = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{host.server_address[1]}"
    args = parse_args(["--model", str(folder), "--trust-remote-code", "--served-model-name", MODEL, "--no-cache",
                       "--allow-remote-images", "--max-image-bytes", str(LIMIT), "--image-fetch-timeout", "1"])
    server = Server(make_app(args))
    try:
        client = server.client()
        image = toy_image(9)
        expected, _ = solo([template_form(user("Fetched?", data_url(image)))], [image], ReplyMemory())
        reply = client.chat.completions.create(model=MODEL, messages=[user("Fetched?", f"{base}/cat.png")],
                                               max_tokens=MAX_TOKENS, temperature=0)
        assert reply.choices[0].message.content == expected
        for path, says in (("/big.png", "--max-image-bytes"), ("/slow.png", "within 1 s"), ("/none.png", "HTTP 404")):
            started = time.perf_counter()
            with pytest.raises(openai.BadRequestError, match=says):
                client.chat.completions.create(model=MODEL, messages=[user("x", f"{base}{path}")], max_tokens=2)
            assert time.perf_counter() - started < 2.5, path  # the slow one is cut at the limit, not at 3 s
    finally:
        server.close()
        host.shutdown()


def test_the_docs_image_chat_runs_as_written(served, capsys):
    """docs/serving.md's client example, against this module's server: the second turn restores the image."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("## Images") :], re.S).group(1)
    code = code.replace("http://127.0.0.1:8000", served.url).replace('"./toy-qwen3_5-vl"', repr(MODEL))
    # The comment states both runs' numbers; the bounds alone (24 < cached < prompt) let "73 48" stand after the
    # server's output changed, and a second run prints more: its second turn is stored by then.
    first, again = re.search(r"# (\d+ \d+) \(run again: (\d+ \d+)\)", code).groups()
    for documented in (first, again):
        exec(compile(code, "docs/serving.md", "exec"), {})
        assert capsys.readouterr().out.split() == documented.split()
    assert 24 < int(first.split()[1])  # past the image's 24 placeholders
