"""Starting the server: every startup mistake is one line on stderr and exit status 2 (no traceback), ``--help``
shows every default, ``--tokenizer`` loads a tokenizer from elsewhere, and ``--max-model-len`` bounds a request
(a 400 ``context_length_exceeded`` through the ``openai`` client). Every server here listens on a free loopback port
(``--port 0``), so a server of the user's on the default port 8000 changes nothing."""

import contextlib
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from test_serve import Server

from hf_hybridcache.serve.__main__ import main, make_app, parse_args
from hf_hybridcache.serve.loading import load
from hf_hybridcache.toy import build_model, byte_tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A saved model without a tokenizer, and a folder with only the tokenizer."""
    root = tmp_path_factory.mktemp("startup")
    build_model("jamba", seed=0).save_pretrained(root / "model")
    byte_tokenizer().save_pretrained(root / "tokenizer")
    return root


def _startup_error(capsys, monkeypatch, *argv: str) -> str:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--port", "0"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf_hybridcache.serve: error: "), err
    return err[0]


def test_each_startup_mistake_is_one_line_and_exit_2(folders, capsys, monkeypatch):
    model, missing = str(folders / "model"), str(folders / "nowhere")
    assert "holds no tokenizer" in _startup_error(capsys, monkeypatch, "--model", model)
    assert "--tokenizer PATH" in _startup_error(capsys, monkeypatch, "--model", model)
    assert "no such folder" in _startup_error(capsys, monkeypatch, "--model", missing)
    assert "--tokenizer" in _startup_error(capsys, monkeypatch, "--model", model, "--tokenizer", missing)
    hub = _startup_error(capsys, monkeypatch, "--model", "no-such-org/no-such-model")
    assert "could not be loaded from the Hugging Face Hub" in hub and "--model no-such-org/no-such-model" in hub
    assert "--max-model-len must be at least 2" in _startup_error(capsys, monkeypatch, "--model", "toy:jamba",
                                                                 "--max-model-len", "1")
    assert "over what this model and memory allow" in _startup_error(capsys, monkeypatch, "--model", "toy:jamba",
                                                                    "--max-model-len", str(10**9))
    assert "No tiny config for family 'nothing'" in _startup_error(capsys, monkeypatch, "--model", "toy:nothing")


def test_an_untested_transformers_is_refused_before_the_model_loads(folders, capsys, monkeypatch):
    """The version check runs before loading (minutes on a real checkpoint): the model folder here is never read."""
    import hf_hybridcache._compat as compat

    monkeypatch.setattr(compat, "TRANSFORMERS_VERSION", "9.0.0")
    monkeypatch.delenv("HF_HYBRIDCACHE_ALLOW_UNTESTED_TRANSFORMERS", raising=False)
    loads = []
    monkeypatch.setattr("hf_hybridcache.serve.loading.load", lambda *args: loads.append(args))
    error = _startup_error(capsys, monkeypatch, "--model", str(folders / "model"))
    assert "transformers 9.0.0 is installed" in error and "pip install" in error and not loads


def test_an_unsupported_model_is_refused_from_its_config_before_its_weights_load(folders, tmp_path, capsys,
                                                                                monkeypatch):
    """A saved Llama: refused by name from config.json (its weights, minutes on a real checkpoint, never load), with
    --no-cache as the way to serve it anyway."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    llama = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=262, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(llama)
    byte_tokenizer().save_pretrained(llama)
    capsys.readouterr()  # save_pretrained's progress bar
    loads = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: loads.append(args))
    error = _startup_error(capsys, monkeypatch, "--model", str(llama))
    assert "does not support LlamaForCausalLM" in error and "--no-cache" in error and not loads


def test_a_toy_model_takes_a_tokenizer_from_a_folder(folders):
    model, tokenizer = load("toy:jamba", tokenizer_id=str(folders / "tokenizer"))
    assert model.config.model_type == "jamba" and tokenizer("hi").input_ids == byte_tokenizer()("hi").input_ids


def test_the_command_itself_prints_one_line_without_a_traceback(folders):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "hf_hybridcache.serve", "--model", str(folders / "model"), "--port", "0"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]


def test_a_server_on_the_default_port_changes_no_startup_error(folders, capsys, monkeypatch):
    """Port 8000 held by someone else (bound here when it is free): the mistakes are still the ones reported."""
    with socket.socket() as held:
        with contextlib.suppress(OSError):  # taken already: by the user's own server, the case this test is about
            held.bind(("127.0.0.1", 8000))
            held.listen()
        assert "holds no tokenizer" in _startup_error(capsys, monkeypatch, "--model", str(folders / "model"))
        assert "No tiny config" in _startup_error(capsys, monkeypatch, "--model", "toy:nothing")


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--help"])
    assert stopped.value.code == 0
    options = re.split(r"\n  (?=-)", capsys.readouterr().out.split("options:", 1)[1])  # one block per option
    described = {block.split()[0].rstrip(","): " ".join(block.split()) for block in options if block.strip()}
    assert len(described) > 15
    for option, text in described.items():
        if option not in ("-h", "--model"):
            assert "(default:" in text, text
    assert "(default: 8000)" in described["--port"] and "(default: 256)" in described["--max-tokens"]


def test_tokenizer_from_another_folder_and_max_model_len(folders):
    args = parse_args(["--model", str(folders / "model"), "--tokenizer", str(folders / "tokenizer"),
                       "--max-model-len", "64", "--dtype", "float32"])
    server = Server(make_app(args))
    try:
        client = server.client()
        name = str(folders / "model")
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x" * 80}])
        assert refused.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=name, prompt="y" * 60, max_tokens=10)
        assert refused.value.code == "context_length_exceeded"
        fits = client.completions.create(model=name, prompt="y" * 60, temperature=0)  # the room left: 4 tokens
        assert fits.usage.completion_tokens <= 4
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.id.startswith("chatcmpl-") and fits.id.startswith("cmpl-")
    finally:
        server.close()


def _client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def test_api_key(monkeypatch):
    """With --api-key (or $HF_HYBRIDCACHE_API_KEY) /v1/ needs the key; /health and /metrics stay open."""
    monkeypatch.setenv("HF_HYBRIDCACHE_API_KEY", "from-env")
    server = Server(make_app(parse_args(["--model", "toy:jamba", "--api-key", "s3cret", "--no-cache"])))
    try:
        for key in ("wrong", "from-env"):
            with pytest.raises(openai.AuthenticationError) as refused:
                _client(server, key).models.list()
            assert refused.value.code == "invalid_api_key"
        reply = _client(server, "s3cret").completions.create(model="toy:jamba", prompt="ab", max_tokens=2)
        assert reply.usage.completion_tokens <= 2
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/v1/models").status_code == 401  # no Authorization header at all
    finally:
        server.close()
    server = Server(make_app(parse_args(["--model", "toy:jamba", "--no-cache"])))  # the environment's key
    try:
        assert _client(server, "from-env").models.list().data
        with pytest.raises(openai.AuthenticationError):
            _client(server, "unused").models.list()
    finally:
        server.close()


def test_the_docs_options_table_lists_every_flag(capsys):
    """docs/serving.md's options table and ``--help`` name the same flags."""
    table = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text().split("## Options", 1)[1]
    documented = set(re.findall(r"^\| (`--[^|]*)\|", table.split("\n\n|", 1)[1].split("\n\n", 1)[0], re.M))
    documented = {flag for cell in documented for flag in re.findall(r"`(--[\w-]+)`", cell)}
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    flags = set(re.findall(r"^  (--[\w-]+)", capsys.readouterr().out, re.M))
    assert len(flags) > 15 and documented == flags - {"--help"}
