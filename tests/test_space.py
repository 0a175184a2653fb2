"""The Spaces demo (examples/space/app.py) end to end: started as a user starts it, driven through its API with
gradio_client and in a real browser (headless Debian Chromium through Playwright).

The demo extra (``pip install -e ".[demo]"``) and /usr/bin/chromium are required in CI (``.ci/run`` installs both);
elsewhere the tests that need them are skipped with a reason. ``SPACE_SCREENSHOT=docs/space.png`` copies the browser
test's screenshot there (that is how the README's screenshot is made).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "space" / "app.py"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
BLOCK_SIZE = 16  # the app builds its cache with the default block size
TURN_TIMEOUT_MS = 120_000


def _need(module: str):
    """Import ``module``; in CI a missing one fails the test, elsewhere it skips it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"needs {module.split('.')[0]}: pip install -e '.[dev]'")


def _app_module():
    """examples/space/app.py imported as the module ``space_app`` (once)."""
    _need("gradio")
    if "space_app" not in sys.modules:
        spec = importlib.util.spec_from_file_location("space_app", APP)
        module = importlib.util.module_from_spec(spec)
        sys.modules["space_app"] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules["space_app"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    """``python examples/space/app.py --port N`` in a subprocess; the URL it prints once it serves."""
    yield from _serving(tmp_path_factory)


@pytest.fixture(scope="module")
def vision_url(tmp_path_factory):
    """The app with ``--vision`` (the built-in vision-language model), as :func:`app_url`."""
    yield from _serving(tmp_path_factory, "--vision")


def _serving(tmp_path_factory, *args: str):
    """``python examples/space/app.py --port N *args`` in a subprocess: yields its URL once it serves, then stops it."""
    _need("gradio")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("space") / "app.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRADIO_ANALYTICS_ENABLED": "False"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, str(APP), "--port", str(port), *args],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while f"Running on local URL:  {url}" not in log_path.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the app did not start (exit code {process.poll()}):\n{log_path.read_text()}")
            time.sleep(0.25)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _decode_end_boundary(turn: dict) -> int:
    """The block boundary the next turn's hit reaches at least: the model saw prompt + new - 1 tokens."""
    return (turn["prompt_tokens"] + turn["new_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE


# ---------------------------------------------------------------------- gradio_client


def test_api_two_turns_reuse_the_first_and_match_cold(app_url):
    client_module = _need("gradio_client")
    client = client_module.Client(app_url, verbose=False)
    first = client.predict(message="API visitor here: what is a checkpoint?", compare=True, api_name="/send")
    second = client.predict(message="Thanks. And a block?", compare=True, api_name="/send")
    turn1, turn2 = first[4], second[4]  # outputs without the states: chat, box, system prompt, table, last turn, ...

    assert turn1["identical_to_cold"] and turn2["identical_to_cold"]
    assert turn2["hit_tokens"] >= _decode_end_boundary(turn1) > 0, (turn1, turn2)
    # The first turn found nothing stored; the second reaches the end of the first turn's stored path and goes on.
    assert (turn1["reason"], turn2["reason"]) == ("new_tokens", "new_tokens"), (turn1, turn2)
    assert turn2["detail"].startswith(f"the stored path ends at {turn2['hit_tokens']:,} tokens"), turn2
    assert turn2["replayed_tokens"] == turn2["prompt_tokens"] - turn2["hit_tokens"]
    assert turn2["prompt_tokens"] > turn1["prompt_tokens"] + turn1["new_tokens"]
    chat = second[0]
    assert [m["role"] for m in chat if not m["metadata"]] == ["user", "assistant", "user", "assistant"]
    assert "identical to cold" in chat[-1]["metadata"]["title"]

    panel_html = client.predict(api_name="/clear_cache")[0]
    assert "No cache yet" in panel_html
    cold = client_module.Client(app_url, verbose=False).predict(message="After the clear", api_name="/send")[4]
    assert cold["hit_tokens"] == 0 and cold["cold_ttft_ms"] is None
    assert cold["reason"] == "new_tokens" and "holds nothing yet" in cold["detail"]


# ---------------------------------------------------------------------- the browser


def _is_loopback(url: str) -> bool:
    host = urlparse(url).hostname
    return url.startswith(("data:", "blob:")) or host in ("127.0.0.1", "localhost", "::1")


def _turn_rows(page) -> list[dict[str, str]]:
    headers = page.locator("#turns table thead th").all_inner_texts()
    return [
        dict(zip(headers, row.locator("td").all_inner_texts())) for row in page.locator("#turns table tbody tr").all()
    ]


def _send(page, text: str) -> None:
    box = page.locator("#msg textarea")
    box.fill(text)
    box.press("Enter")


def _wait_turns(page, count: int) -> list[dict[str, str]]:
    page.wait_for_function(
        "n => document.querySelectorAll('#turns table tbody tr').length >= n", arg=count, timeout=TURN_TIMEOUT_MS
    )
    return _turn_rows(page)


def _open(context, url: str):
    page = context.new_page()
    page.goto(url)
    page.locator("#msg textarea").wait_for(timeout=60_000)
    page.locator("#compare input[type=checkbox]").check()
    return page


def _browser():
    """Playwright's sync API, once /usr/bin/chromium is there (in CI both must be; elsewhere the test skips)."""
    sync_api = _need("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: .ci/run installs it with apt-get")
        pytest.skip(f"needs {CHROMIUM}: apt-get install chromium")
    return sync_api


def test_browser_chat_shows_the_cache_at_work(app_url, tmp_path):
    sync_api = _browser()

    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a fresh user-data dir
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1440, "height": 1100},
        )
        # The page must work offline: nothing but the app itself is reached.
        context.route("**/*", lambda route: route.continue_() if _is_loopback(route.request.url) else route.abort())
        try:
            page = _open(context, app_url)
            assert "gibberish" in page.locator("body").inner_text()

            _send(page, "Hello! What makes a hybrid model hybrid?")
            first = _wait_turns(page, 1)[0]
            _send(page, "And why does the second turn start sooner?")
            rows = _wait_turns(page, 2)
            second = rows[1]
            assert [row["identical to cold"] for row in rows] == ["yes", "yes"], rows
            prompt1, hit2 = int(first["prompt tokens"]), int(second["hit tokens"])
            # The second turn reuses at least the whole first prompt (down to a block boundary), plus the reply.
            assert hit2 >= prompt1 // BLOCK_SIZE * BLOCK_SIZE > 0, rows
            assert int(second["replayed tokens"]) == int(second["prompt tokens"]) - hit2
            assert second["why"] == "new_tokens", rows  # the first turn's stored path ends, the prompt goes on
            chat_text = page.locator("#chatbot").inner_text()
            assert chat_text.count("identical to cold ✓") == 2, chat_text
            panel = page.locator("#cache-panel")
            assert int(panel.locator("[data-stat='requests']").inner_text()) >= 2
            assert "new_tokens" in panel.locator("[data-stat='why']").inner_text()
            page.locator("#hit-plot canvas, #hit-plot svg").first.wait_for(timeout=30_000)
            assert page.locator("#retention input").is_disabled()  # settings are fixed once the cache exists

            # Table headers wrap between words, never inside one, even in a narrow window.
            page.set_viewport_size({"width": 760, "height": 1100})
            assert _words_broken_across_lines(page, "#turns th") == [], "a header breaks inside a word"
            page.set_viewport_size({"width": 1440, "height": 1100})
            page.get_by_role("tab", name="How it works").click()
            how = page.locator("#how-it-works").inner_text()
            assert "HybridPrefixCache" in how and ":class:" not in how and "``" not in how
            page.get_by_role("tab", name="Chat").click()

            screenshot = tmp_path / "space.png"
            page.screenshot(path=str(screenshot), full_page=True)
            assert screenshot.stat().st_size > 10_000
            if os.environ.get("SPACE_SCREENSHOT"):
                target = ROOT / os.environ["SPACE_SCREENSHOT"]
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(screenshot, target)

            # A second visitor (its own Gradio session) and the first one send at the same time: the engine runs
            # both, each history stays its own, both match cold, and the second visitor's first turn hits the shared
            # system prompt.
            other = _open(context, app_url)
            _send(other, "A second visitor says hello.")
            _send(page, "A third turn while someone else is waiting.")
            other_rows = _wait_turns(other, 1)
            rows = _wait_turns(page, 3)
            assert other_rows[0]["identical to cold"] == "yes" and rows[2]["identical to cold"] == "yes"
            assert int(other_rows[0]["hit tokens"]) > 0, other_rows
            assert len(other_rows) == 1
            other_chat = other.locator("#chatbot").inner_text()
            assert "second visitor" in other_chat and "hybrid model hybrid" not in other_chat
        finally:
            context.close()


def test_browser_image_chat_skips_the_encoder_on_the_second_question(vision_url, tmp_path):
    """With ``--vision``, an image uploaded from the page: the first turn encodes it, the second question about it
    restores the chat past the image and encodes nothing (images skipped 1, encoder 0 ms); both equal cold runs."""
    sync_api = _browser()
    from hf_hybridcache.toy.vision import toy_image

    picture = tmp_path / "screen.png"
    toy_image(3, width=96, height=64).save(picture)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            context = browser.new_context(viewport={"width": 1440, "height": 1100})
            context.route("**/*", lambda route: route.continue_() if _is_loopback(route.request.url) else route.abort())
            page = _open(context, vision_url)
            page.locator("#msg input[type=file]").set_input_files(str(picture))
            page.locator("#msg img").first.wait_for(timeout=30_000)  # the upload's preview: it reached the server
            _send(page, "What is on this screen?")
            first = _wait_turns(page, 1)[0]
            _send(page, "And what colour is the box?")
            rows = _wait_turns(page, 2)
            second = rows[1]
            shown_images = page.locator("#chatbot img").count()
            panel = page.locator("#cache-panel [data-stat='images skipped']").inner_text()
        finally:
            browser.close()
    assert [row["identical to cold"] for row in rows] == ["yes", "yes"], rows
    assert (first["images encoded"], first["images skipped"]) == ("1", "0") and float(first["encoder (ms)"]) > 0
    assert (second["images encoded"], second["images skipped"], second["encoder (ms)"]) == ("0", "1", "0.0"), rows
    # The image lies inside the first prompt: the second turn restores at least that prompt's blocks.
    assert int(second["hit tokens"]) >= int(first["prompt tokens"]) // BLOCK_SIZE * BLOCK_SIZE > 0, rows
    assert shown_images >= 1 and panel.startswith("1 "), (shown_images, panel)


def _words_broken_across_lines(page, selector: str) -> list[str]:
    """The words of the elements matching ``selector`` whose letters lie on more than one line."""
    return page.evaluate(
        """selector => {
            const broken = [];
            for (const cell of document.querySelectorAll(selector)) {
                const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
                for (let node = walker.nextNode(); node; node = walker.nextNode()) {
                    for (const match of node.textContent.matchAll(/\\S+/g)) {
                        const range = document.createRange();
                        range.setStart(node, match.index);
                        range.setEnd(node, match.index + match[0].length);
                        const tops = new Set([...range.getClientRects()].map(r => Math.round(r.top)));
                        if (tops.size > 1) broken.push(match[0]);
                    }
                }
            }
            return broken;
        }""",
        selector,
    )


def test_empty_reply_and_how_it_works_text():
    """A reply that is empty (the first token was the end of sequence) says so; "How it works" is Markdown without
    Sphinx roles."""
    app = _app_module()
    shown = app.render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}], [])
    assert shown[1]["content"] == app.EMPTY_REPLY and "empty reply" in app.EMPTY_REPLY
    how = app.how_it_works()
    assert "`HybridPrefixCache`" in how and ":class:" not in how and "``" not in how


def test_three_browser_sessions_chat_at_once(app_url, tmp_path):
    """Three pages send at the same moment: the engine runs their turns in the same steps, and each page's reply is
    the one its prompt gets alone, from greedy ``generate()`` without a cache in this process."""
    sync_api = _browser()
    app = _app_module()
    reference = app.ChatEngine.builtin()
    messages = [
        f"Visitor {name} asks about {topic}."
        for name, topic in [("one", "checkpoints"), ("two", "paged blocks"), ("three", "replaying the tail")]
    ]

    def alone(message: str) -> str:
        chat = [{"role": "system", "content": app.DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": message}]
        ids = reference.prompt_ids(chat)
        reply = reference.model.generate(ids, **reference.generation_kwargs)[0, ids.shape[1] :]
        return " ".join(reference.tokenizer.decode(reply, skip_special_tokens=True).split())

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            pages = []
            for _ in messages:  # one context each: three visitors with their own sessions
                context = browser.new_context(viewport={"width": 1200, "height": 900})
                context.route(
                    "**/*", lambda route: route.continue_() if _is_loopback(route.request.url) else route.abort()
                )
                pages.append(_open(context, app_url))
            boxes = [page.locator("#msg textarea") for page in pages]
            for box, message in zip(boxes, messages):
                box.fill(message)
            # Typed first, then sent at one moment of the clock the pages share: pressing Enter page by page spread
            # the three sends over more time than a quiet machine takes to answer one alone (they ran one by one).
            at = int(time.time() * 1000) + 500
            for page in pages:
                page.evaluate("at => setTimeout(() => document.querySelector('#send').click(), at - Date.now())", at)
            rows = [_wait_turns(page, 1)[0] for page in pages]
            chats = [" ".join(page.locator("#chatbot").inner_text().split()) for page in pages]
        finally:
            browser.close()

    assert [row["identical to cold"] for row in rows] == ["yes"] * 3, rows
    assert max(int(row["requests at once"]) for row in rows) >= 2, rows  # they ran together, not one by one
    for message, chat, row in zip(messages, chats, rows):
        expected = alone(message)
        assert expected and expected in chat, (message, expected, chat)
        assert sum(other in chat for other in messages) == 1, chat  # each page shows its own visitor only
    # The shared system prompt: stored by earlier turns, or by the first of the three (the others wait for its blocks).
    assert sum(int(row["hit tokens"]) > 0 for row in rows) >= 2, rows


# ---------------------------------------------------------------------- loading a checkpoint (MODEL_ID)


def test_engine_loads_a_saved_checkpoint_and_chats(tmp_path):
    app = _app_module()
    from hf_hybridcache.toy import build_model, byte_tokenizer

    build_model("jamba", seed=1).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    engine = app.ChatEngine.from_pretrained(str(tmp_path), max_new_tokens=8)
    settings = app.CacheSettings()
    messages = [{"role": "system", "content": "s" * 60}, {"role": "user", "content": "first question"}]

    updates = list(engine.chat(messages, settings, compare=True))
    turn1, reply = updates[-1].turn, updates[-1].text
    assert [u.text for u in updates if u.status == "generating"][-1] == reply  # the stream adds up to the reply
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "second"}]
    turn2 = list(engine.chat(messages, settings, compare=True))[-1].turn

    assert turn1.identical_to_cold and turn2.identical_to_cold
    assert turn1.hit_tokens == 0 and turn2.hit_tokens > 0
    assert engine.cache.stats.requests == 2


def test_engine_loads_a_saved_vision_language_checkpoint_and_skips_the_image_on_the_second_question(tmp_path):
    """A wrapper saved with its processor (``save_vlm``) loads as published; an image question, then a second one
    about the same image: both equal cold, and the second restores the image without encoding it."""
    app = _app_module()
    from hf_hybridcache.toy.vision import save_vlm, toy_image

    save_vlm(tmp_path / "vlm", "qwen3_5", seed=0)
    toy_image(4, width=64, height=48).save(tmp_path / "screen.png")
    engine = app.ChatEngine.from_pretrained(str(tmp_path / "vlm"), max_new_tokens=8, trust_remote_code=True)
    settings = app.CacheSettings()
    messages = [{"role": "user", "content": "What is this?", "images": [str(tmp_path / "screen.png")]}]
    first = list(engine.chat(messages, settings, compare=True))[-1]
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Why?"}]
    second = list(engine.chat(messages, settings, compare=True))[-1].turn
    engine.clear_cache()
    assert first.turn.identical_to_cold and second.identical_to_cold
    assert (first.turn.images_encoded, first.turn.images_skipped) == (1, 0)
    assert (second.images_encoded, second.images_skipped, second.encoder_ms) == (0, 1, 0.0)
    assert second.hit_tokens >= first.turn.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE > 0


def test_engine_refuses_an_unsupported_checkpoint(tmp_path):
    app = _app_module()
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_hybridcache.toy import VOCAB_SIZE, byte_tokenizer

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'llama' model; hf_hybridcache supports"):
        app.ChatEngine.from_pretrained(str(tmp_path))


def test_engine_keeps_the_chat_as_token_ids(tmp_path):
    # The demo re-tokenized the whole chat each turn, so a reply whose text re-tokenizes to other ids missed the
    # cache inside it. The next prompt now starts with the previous prompt's ids and the reply's generated ids.
    app = _app_module()
    engine = app.ChatEngine.builtin(max_new_tokens=12)
    settings = app.CacheSettings()
    messages = [{"role": "system", "content": "s" * 60}, {"role": "user", "content": "first question"}]
    done = list(engine.chat(messages, settings, compare=False))[-1]
    first_prompt = engine.prompt_ids(messages)[0].tolist()
    assert done.token_ids[: len(first_prompt)] == first_prompt and len(done.token_ids) > len(first_prompt)
    messages += [
        {"role": "assistant", "content": done.text, "token_ids": done.token_ids},
        {"role": "user", "content": "second"},
    ]
    second_prompt = engine.prompt_ids(messages)[0].tolist()
    assert second_prompt[: len(done.token_ids)] == done.token_ids
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = engine.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    assert engine.tokenizer.decode(second_prompt) == text  # the same conversation, kept as the ids the model saw
    turn = list(engine.chat(messages, settings, compare=True))[-1].turn
    assert turn.identical_to_cold and turn.hit_tokens >= (len(done.token_ids) - 1) // 16 * 16 - 16
