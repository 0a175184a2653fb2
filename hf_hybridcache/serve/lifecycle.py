"""The server's life as ``python -m hf_hybridcache.serve`` runs it: loading, ready, draining, stopped.

- **Loading.** The port is bound first and the model loads in a thread, so probes answer from the start:
  ``/liveness`` 200, ``/readiness`` and ``/health`` 503 ``loading``, every other request a 503 that says so. A
  startup mistake found while loading is still one line on stderr and exit status 2.
- **Ready.** The app of :func:`~hf_hybridcache.serve.app.build_app` serves; its probes read the same :class:`Phase`.
- **Draining**, on SIGTERM or SIGINT: ``/readiness`` and ``/health`` answer 503 ``draining`` at once (a gateway
  stops routing here at its next health check; Kubernetes takes the pod out of its Service), ``/liveness`` stays
  200, and a new generation request is refused with a 503 that a gateway retries on another worker (SMG retries
  408, 429, 500, 502, 503 and 504). The requests in flight run to their end, until ``--drain-timeout`` seconds have
  passed; those still running then are cut (their clients get an error). Then the shared tier's queued writes are
  flushed (up to :data:`FLUSH_S` seconds), so what this worker computed last is there for the others, and the
  process exits with status 0. A second signal exits at once.

Kubernetes: give the pod a ``terminationGracePeriodSeconds`` above ``--drain-timeout`` plus :data:`FLUSH_S`, probe
``/readiness`` for readiness and ``/liveness`` for liveness (with a ``startupProbe`` on ``/liveness`` nothing
restarts a long load).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import sys
import threading
import time

import uvicorn

#: Seconds the shared tier's queued writes may take to flush after a drain.
FLUSH_S = 10.0
#: A generation request arriving while the worker loads or drains is told to retry after this many seconds.
RETRY_AFTER_S = 1
#: ``POST`` paths that start work (gated while loading or draining, counted while in flight).
WORK_PREFIX = "/v1/"


class Phase:
    """Where the server is (``name``: ``loading``, ``ready``, ``draining`` or ``stopped``) and the generation
    requests in flight, shared by the probes (:mod:`~hf_hybridcache.serve.health`) and the runner below."""

    def __init__(self, name: str = "ready") -> None:
        self.name = name
        self.in_flight = 0


class Gate:
    """ASGI middleware: counts the work requests in flight (a stream until its last byte) and refuses new ones with
    a 503 unless the phase is ``ready``. Plain ASGI, so streams and disconnects pass untouched."""

    def __init__(self, app, phase: Phase) -> None:
        self.app, self.phase = app, phase

    async def __call__(self, scope, receive, send) -> None:
        if not _is_work(scope):
            await self.app(scope, receive, send)
            return
        if self.phase.name != "ready":
            await refuse(send, self.phase.name)
            return
        self.phase.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.phase.in_flight -= 1


def _is_work(scope) -> bool:
    return scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith(WORK_PREFIX)


async def refuse(send, phase: str) -> None:
    """A 503 in OpenAI's error shape with ``Retry-After``: the worker is ``loading`` or ``draining``."""
    why = {"loading": "The model is still loading", "draining": "This worker is shutting down"}.get(phase, phase)
    body = {"error": {"message": f"{why}; retry in a moment (a gateway retries on another worker).",
                      "type": "server_error", "param": None, "code": f"worker_{phase}"}}
    await _send_json(send, 503, body, [(b"retry-after", str(RETRY_AFTER_S).encode())])


async def _send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})


class Shell:
    """The ASGI app uvicorn runs: answers probes while ``make_app(args)`` loads in a thread, then hands every
    request to the loaded app (behind a :class:`Gate`) and runs that app's lifespan (the engine's start and stop).

    Attributes:
        failure: the startup mistake found while loading (one line), or None.
        app: the loaded app, None while loading.
    """

    def __init__(self, make_app, args, on_ready=None) -> None:
        self.make_app, self.args, self.on_ready = make_app, args, on_ready
        self.phase = Phase("loading")
        self.app = self.gate = None
        self.failure: str | None = None
        self.server = None  # the uvicorn server, told to exit when loading fails
        self._stack = contextlib.AsyncExitStack()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self.gate is not None:
            await self.gate(scope, receive, send)
        elif scope["type"] == "http":
            await self._while_loading(scope, send)

    async def _while_loading(self, scope, send) -> None:
        if scope["path"] == "/liveness":
            await _send_json(send, 200, {"status": "alive", "phase": self.phase.name})
        elif scope["path"] == "/readiness":
            await _send_json(send, 503, {"status": "not_ready", "reason": self.phase.name})
        elif scope["path"] == "/health":  # the shape of serve/health.py's answer while draining
            await _send_json(send, 503, {"status": self.phase.name, "reason": self.phase.name})
        else:
            await refuse(send, self.phase.name)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                asyncio.get_running_loop().create_task(self._load())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._stack.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _load(self) -> None:
        from .loading import StartupError

        loop = asyncio.get_running_loop()
        loaded = loop.create_future()

        def load() -> None:  # a daemon thread: a signal during a long load does not wait for it
            try:
                result = (self.make_app(self.args), None)
            except (StartupError, ValueError) as problem:
                result = (None, str(problem))
            except BaseException as problem:  # noqa: BLE001 - reported as a startup failure, not a hang
                result = (None, f"{type(problem).__name__}: {problem}")
            loop.call_soon_threadsafe(loaded.set_result, result)

        threading.Thread(target=load, name="hf_hybridcache-load", daemon=True).start()
        app, self.failure = await loaded
        if app is None or self.phase.name != "loading":
            self.server.should_exit = True
            return
        await self._stack.enter_async_context(app.router.lifespan_context(app))
        self.phase = app.state.lifecycle
        self.app, self.gate = app, Gate(app, self.phase)
        if self.on_ready is not None:
            self.on_ready()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work, let the requests in flight end (cut them after ``timeout_s``), flush the tier, exit."""
        started = time.monotonic()
        if self.app is None:  # still loading: nothing runs
            self.phase.name = "stopped"
            self.server.should_exit = True
            return
        self.phase.name = "draining"
        while self.phase.in_flight and time.monotonic() - started < timeout_s:
            await asyncio.sleep(0.05)
        cut = self.phase.in_flight
        backend = self.app.state.backend
        manager = getattr(backend, "manager", None)
        if cut and manager is not None:
            await asyncio.to_thread(manager.stop, True, None, False, True)  # fail what still runs
            while self.phase.in_flight and time.monotonic() - started < timeout_s + 5:
                await asyncio.sleep(0.05)
        cache = getattr(backend, "cache", None)
        tier = None if cache is None else cache.remote
        flushed = True if tier is None else await asyncio.to_thread(tier.flush, FLUSH_S)
        self.phase.name = "stopped"
        print(f"hf_hybridcache.serve: drained in {time.monotonic() - started:.1f} s: "
              f"{cut} request(s) cut at the deadline; "
              + ("no shared tier" if tier is None else "the tier's writes flushed" if flushed else
                 f"the tier's writes not all flushed within {FLUSH_S:.0f} s"), flush=True)
        self.server.should_exit = True


def run(args, make_app) -> str | None:
    """Serve ``make_app(args)`` on ``args.host``:``args.port`` until a signal drains it (see the module docstring).

    Returns:
        None after a drain or a second signal; a startup mistake as one line (the caller prints it and exits 2).
    """
    try:
        sock = listen(args.host, args.port)
    except OSError as problem:
        return f"cannot listen on {args.host}:{args.port} ({problem.strerror or problem}); pass another --port."
    port = sock.getsockname()[1]

    def ready() -> None:
        print(f"hf_hybridcache.serve: {args.served_model_name or args.model} at http://{args.host}:{port}/v1 "
              "(OpenAI API; /health, /metrics)", flush=True)

    shell = Shell(make_app, args, ready)
    config = uvicorn.Config(shell, log_level=args.log_level, lifespan="on", timeout_graceful_shutdown=5)
    server = shell.server = DrainingServer(config, shell, args.drain_timeout)
    server.run(sockets=[sock])
    return shell.failure


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (port 0: a free one), bound before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM or SIGINT drains (:meth:`Shell.drain`) instead of closing at once; a
    second one exits at once, as uvicorn's does."""

    def __init__(self, config, shell: Shell, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.shell, self.drain_timeout_s = shell, drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._draining or self._loop is None:
            self.force_exit = True
            super().handle_exit(sig, frame)
            return
        self._draining = True
        print(f"hf_hybridcache.serve: {signal.Signals(sig).name}: draining (at most {self.drain_timeout_s:g} s for "
              "the requests in flight)", file=sys.stderr, flush=True)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.shell.drain(self.drain_timeout_s)))
