"""The server's life (serve/lifecycle.py, serve/health.py): probes while the model loads, what a gateway reads
(``/server_info``, ``/model_info``, ``/v1/loads``), and a drain on SIGTERM: not ready at once, alive throughout, new
requests refused with a 503 a gateway retries, the request in flight streamed to its end, the tier's writes flushed,
and requests still running at the deadline cut. Each server runs in a thread on a free loopback port (uvicorn installs
no signal handlers there; the test calls the handler the signal would)."""

import argparse
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from redis_server import RedisServer, require_redis

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.serve import EngineBackend, build_app
from hf_hybridcache.serve.lifecycle import DrainingServer, Shell
from hf_hybridcache.toy import build_model, byte_tokenizer

MODEL = "toy:jamba"
PROMPT = "A long question that the worker answers slowly, token by token, while it drains. " * 2


@pytest.fixture(scope="module")
def tier():
    require_redis()
    server = RedisServer().start()
    yield server
    server.stop()


class Running:
    """A :class:`DrainingServer` over a :class:`Shell` in a thread; ``loaded`` gates the model's loading."""

    def __init__(self, remote: str | None, drain_timeout_s: float) -> None:
        self.loaded = threading.Event()
        self.cache = None
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.shell = Shell(self._make_app, argparse.Namespace(remote=remote))
        import uvicorn

        config = uvicorn.Config(self.shell, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = self.shell.server = DrainingServer(config, self.shell, drain_timeout_s)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while self.server._loop is None or not self.server.started:
            time.sleep(0.02)

    def _make_app(self, args):
        self.loaded.wait(60)
        tokenizer = byte_tokenizer()
        self.cache = HybridPrefixCache(build_model("jamba", seed=0), remote=args.remote)
        # No EOS: a request runs its max_tokens, so the one in flight during a drain is still running while the
        # probes are read (the toy model sampled EOS early enough once that the drain had ended before them).
        backend = EngineBackend(self.cache, [], max_running_requests=8, max_batch_tokens=256)
        return build_app(backend, tokenizer, MODEL, self.cache)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=10)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while self.get("/readiness").status_code != 200:
            assert time.monotonic() < deadline, "not ready"
            time.sleep(0.05)


def test_probes_while_loading_then_what_a_gateway_reads(tier):
    running = Running(tier.url, drain_timeout_s=10)
    try:
        assert running.get("/liveness").json() == {"status": "alive", "phase": "loading"}
        assert running.get("/readiness").status_code == running.get("/health").status_code == 503
        with pytest.raises(openai.APIStatusError) as refused:
            running.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
        assert refused.value.status_code == 503 and refused.value.code == "worker_loading"
        assert refused.value.response.headers["retry-after"] == "1"

        running.loaded.set()
        running.wait_ready()
        assert running.get("/health").json() == {"status": "ok"}
        info = running.get("/server_info").json()
        assert info["served_model_name"] == MODEL and info["engine"] == "hf_hybridcache" and info["remote_tier"]
        assert info["max_running_requests"] == 8 and info["page_size"] == 16 and info["max_total_tokens"] > 0
        assert running.get("/model_info").json()["model_type"] == "jamba"

        stream = running.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0,
                                                     stream=True)
        next(iter(stream))  # the request runs
        loads = running.get("/v1/loads").json()
        assert loads["dp_rank_count"] == 1
        load = loads["loads"][0]
        assert load["num_running_reqs"] == 1 and load["max_running_requests"] == 8
        assert 0 < load["num_used_tokens"] <= load["max_total_num_tokens"] and 0 < load["token_usage"] < 1
        assert 0 < load["num_waiting_uncached_tokens"] <= 400  # the tokens it may still generate
        stream.close()
    finally:
        running.loaded.set()
        running.server.handle_exit(signal.SIGTERM, None)
        running.thread.join(30)


def test_sigterm_drains_the_request_in_flight_and_flushes_the_tier(tier, capsys):
    running = Running(tier.url, drain_timeout_s=30)
    running.loaded.set()
    running.wait_ready()
    client = running.client()
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    running.server.handle_exit(signal.SIGTERM, None)
    time.sleep(0.2)
    assert running.get("/readiness").json() == {"status": "not_ready", "reason": "draining"}
    assert running.get("/health").status_code == 503
    assert running.get("/liveness").json() == {"status": "alive", "phase": "draining"}
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert refused.value.status_code == 503 and refused.value.code == "worker_draining"
    rest = list(chunks)  # the request in flight runs to its end
    assert rest[-1].choices[0].finish_reason == "length"
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
    running.thread.join(30)
    assert not running.thread.is_alive()
    out = capsys.readouterr().out
    assert "0 request(s) cut at the deadline; the tier's writes flushed" in out
    # Every entry the drained worker stored is on the server: a fresh cache restores the whole prompt from there.
    assert running.cache.remote.counters["remote_dropped_writes"] == 0
    assert running.cache.stats.kv_blocks > 0 and tier.client().dbsize() >= running.cache.stats.kv_blocks
    assert text


def test_the_deadline_cuts_what_still_runs(tier, capsys):
    running = Running(None, drain_timeout_s=0.5)
    running.loaded.set()
    running.wait_ready()
    stream = running.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4000, temperature=0,
                                                 stream=True)
    chunks = iter(stream)
    next(chunks)
    started = time.monotonic()
    running.server.handle_exit(signal.SIGTERM, None)
    finished = []
    try:
        finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    except (openai.APIError, httpx.HTTPError):  # the engine's error event, or the connection closed
        pass
    assert finished == [], "the request ran to its end past the deadline"
    running.thread.join(30)
    assert time.monotonic() - started < 10
    assert "1 request(s) cut at the deadline; no shared tier" in capsys.readouterr().out
