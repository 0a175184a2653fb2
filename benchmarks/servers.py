"""HTTP server processes and streamed requests for the serving benchmarks (``serve_multiturn.py``,
``vs_llama_cpp.py``): a free loopback port, a server command run until its ``/health`` answers 200 and stopped on
exit, and one streamed ``/v1/completions`` request timed to its first token."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time

import httpx

#: ``--llama-wait-policy`` choices: llama-server's OpenMP threads as shipped (libgomp spins a while at a barrier, then
#: sleeps), or ``OMP_WAIT_POLICY=PASSIVE`` as ours run (the older runs' setting).
LLAMA_WAIT_POLICIES = ("default", "passive")


def server_env(llama: bool, llama_wait_policy: str = "default") -> dict:
    """The environment of a compared server: 2 OpenMP threads each. Ours with ``OMP_WAIT_POLICY=PASSIVE`` (spinning
    threads stall torch's small ops when two processes share the two cores). llama-server, built with OpenMP (its CPU
    backend links libgomp), keeps its own default unless ``llama_wait_policy="passive"``: PASSIVE puts its threads to
    sleep at every barrier of a token's graph, hundreds per token, which on an otherwise idle machine cut its decode
    to a fraction (toy Jamba, one stream: 112-136 tokens/s PASSIVE, 740 default, 288 ``ACTIVE``; on a loaded machine
    PASSIVE read 336-348), so runs before this option compared against a slowed llama-server."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    if llama and llama_wait_policy == "default":
        env.pop("OMP_WAIT_POLICY")
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server_process(command: list[str], url: str, env: dict | None = None, log=None, timeout_s: float = 300):
    """Run ``command`` (a server listening at ``url``) until ``{url}/health`` answers 200, yield the process, and
    stop it (SIGTERM, then SIGKILL after 60 s) on exit. ``log``: a file object for its stdout and stderr (default:
    inherited).

    Raises:
        RuntimeError: the process exited or was not healthy within ``timeout_s``.
    """
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT if log else None)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]} ... did not start (exit status {process.poll()}): {command}")
            time.sleep(0.2)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def no_keepalive_client() -> httpx.AsyncClient:
    """An ``httpx`` client that opens a new connection per request (llama-server closes a kept-alive connection after
    a streamed reply, which a reused connection then reads as a broken one)."""
    return httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=3600)


async def streamed_completion(client, prompt: str, max_tokens: int, model: str = "bench") -> dict:
    """One greedy ``/v1/completions`` request, streamed, with the ``openai`` client: ``ttft`` (request sent to the
    first chunk with text, seconds), ``prompt`` / ``hit`` / ``completion`` tokens from the usage chunk and the
    ``text`` (and the ``prompt_text``)."""
    sent, first, text, usage = time.perf_counter(), None, "", None
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if first is None and (choice.text or choice.finish_reason):
                first = time.perf_counter()
            text += choice.text or ""
    return {"ttft": first - sent, **usage_counts(usage), "text": text, "prompt_text": prompt}


def usage_counts(usage) -> dict:
    """``prompt``, ``hit`` (cached prompt tokens, 0 when the server does not say) and ``completion`` tokens."""
    details = getattr(usage, "prompt_tokens_details", None)
    return {"prompt": usage.prompt_tokens, "hit": getattr(details, "cached_tokens", None) or 0,
            "completion": usage.completion_tokens}
