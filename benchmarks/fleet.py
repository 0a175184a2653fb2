"""Replicas of ``python -m hf_hybridcache.serve`` behind SMG (the Shepherd Model Gateway), on loopback ports: what
``benchmarks/scale_out.py`` measures and ``tests/test_scale_out.py`` checks.

Each replica is its own process (one intra-op thread); the gateway is ``smg launch`` with health checks and load polls
every second, so a drained or killed replica leaves the rotation within about a second.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

#: The gateway's settings every fleet uses besides the policy: fast health checks and load polls (a replica that
#: drains or dies leaves the rotation within a second), and its Prometheus listener on loopback.
GATEWAY_FLAGS = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                 "--health-success-threshold", "1", "--load-monitor-interval", "1",
                 "--worker-startup-check-interval", "1", "--log-level", "info")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout_s:.0f} s")
        time.sleep(0.1)


class Replica:
    """One server process; ``log`` collects its stdout and stderr."""

    def __init__(self, logdir: Path, index: int, model: str = "toy:jamba", remote: str | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.port, self.index = free_port(), index
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "hf_hybridcache.serve", "--model", model, "--port", str(self.port),
                     "--dtype", "float32", *(["--remote", remote] if remote else []), *extra]
        self.log = Path(logdir) / f"replica-{index}.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> Replica:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self, timeout_s: float = 180) -> Replica:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"replica {self.index} exited: {self.log.read_text()[-2000:]}")
            return httpx.get(f"{self.url}/readiness", timeout=2).status_code == 200
        wait_until(ready, timeout_s, f"replica {self.index} was not ready")
        return self

    def metric(self, name: str) -> float:
        """A sample of the replica's ``/metrics`` (``name`` with its labels as printed), 0 when absent."""
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def stop(self, sig: int | None = None, timeout_s: float = 60) -> int | None:
        """Send ``sig`` (None: SIGKILL) and wait; the exit status."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        if sig is None:
            self.process.kill()
        else:
            self.process.send_signal(sig)
        return self.process.wait(timeout_s)


class Gateway:
    """``smg launch`` over ``replicas`` with ``policy``; ``log`` collects its output."""

    def __init__(self, logdir: Path, replicas: list[Replica], policy: str, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["smg", "launch", "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
                     "--worker-urls", *[r.url for r in replicas], "--prometheus-host", "127.0.0.1",
                     "--prometheus-port", str(free_port()), *GATEWAY_FLAGS, *extra]
        self.count = len(replicas)
        self.log = Path(logdir) / f"smg-{policy}-{self.port}.log"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120) -> Gateway:
        env = {**os.environ, "NO_COLOR": "1", "RUST_LOG_STYLE": "never"}
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env)

        def registered() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"smg exited: {self.log.read_text()[-3000:]}")
            workers = httpx.get(f"{self.url}/workers", timeout=2).json().get("workers", [])
            return sum(w.get("is_healthy", False) for w in workers) == self.count
        wait_until(registered, timeout_s, "smg did not register every replica")
        return self

    def workers(self) -> list[dict]:
        return httpx.get(f"{self.url}/workers", timeout=5).json()["workers"]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
