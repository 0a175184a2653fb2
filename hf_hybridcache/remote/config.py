"""What ``HybridPrefixCache(model, remote=...)`` accepts, validated, and the redis-py client made from it.

``remote`` is a URL (``redis://host:6379/0``, ``rediss://`` for TLS, ``redis://:password@host/0`` or
``redis://user:password@host/0``; ``redis+cluster://host:port[,host:port...]`` or ``rediss+cluster://`` for a Redis
or Valkey Cluster, naming one or more of its nodes), an existing redis-py client (``redis.Redis`` or
``redis.cluster.RedisCluster``, used as it is: its own timeouts and retries apply), or a :class:`RemoteConfig` for the
tier's other settings. Valkey speaks the same protocol, so the same URL and client serve it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from dataclasses import dataclass, field
from typing import Any

#: Keys of every entry start with this (then the format version); see :mod:`hf_hybridcache.remote.codec`.
DEFAULT_KEY_PREFIX = "hfhc"
#: The environment variable a :class:`RemoteConfig` without ``secret=`` takes its secret from (deployments set it
#: in every worker's environment rather than in code).
SECRET_ENV = "HF_HYBRIDCACHE_REMOTE_SECRET"

#: URL schemes of a cluster: the client discovers every node and its slots from the nodes named.
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")

_NO_REDIS = "HybridPrefixCache(remote=...) needs redis-py: pip install redis (or pip install -e '.[redis]' in a clone)."


@dataclass(frozen=True)
class RemoteConfig:
    """Settings of the shared second tier.

    Attributes:
        target: a ``redis://`` / ``rediss://`` URL or an existing redis-py client.
        connect_timeout_s, timeout_s: socket connect and read timeouts of a client made from a URL. Small: a request
            waits at most about this long for a tier that went away before it runs without it.
        max_pending_writes: entries queued for the background writer; when the queue is full a new entry is dropped
            (and counted) rather than stalling the request.
        breaker_errors: consecutive failed operations that open the circuit breaker (the tier is skipped).
        retry_after_s: how long the breaker stays open before one operation tries the tier again.
        min_flops_per_byte: fetch a remote chain only when the prefill FLOPs it saves per byte transferred reach this
            (0: no floor). Compare with your accelerator's FLOP/s divided by the network's bytes/s.
        compute_flops_per_s: the prefill FLOP/s this process sustains, against which a chain's measured transfer
            time (latency + bytes / bandwidth, :mod:`~hf_hybridcache.remote.rate`) is weighed: it is fetched only
            when that is below the time to recompute it. None (the default): the rate measured on the cache's own
            forwards. See :func:`~hf_hybridcache.remote.fetch.worth_fetching`.
        key_prefix: first part of every key (several deployments can share one server under different prefixes).
        secret: bytes or a str (UTF-8) shared by every process that should share entries; None (the default): the
            value of the environment variable ``HF_HYBRIDCACHE_REMOTE_SECRET`` when it is set and not empty, else no
            secret. Under a secret every value written carries an HMAC-SHA256 under it, a value read without a
            valid one is a miss (counted in ``remote_corrupt_entries``) and removed, and keys live in a namespace
            named after the secret (:mod:`~hf_hybridcache.remote.codec`), so processes with another secret or none
            neither share entries nor touch each other's keys. Without a secret, anyone who can write to the server
            can make every process serve states of their choosing. Use a long random value (``python -c "import
            secrets; print(secrets.token_hex(32))"``). It is kept out of ``repr()``.
    """

    target: Any
    connect_timeout_s: float = 0.25
    timeout_s: float = 0.5
    max_pending_writes: int = 256
    breaker_errors: int = 3
    retry_after_s: float = 5.0
    min_flops_per_byte: float = 0.0
    compute_flops_per_s: float | None = None
    key_prefix: str = DEFAULT_KEY_PREFIX
    secret: bytes | str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "secret", _secret_bytes(self.secret))
        if isinstance(self.target, str):
            if not self.target.startswith(("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES)):
                raise ValueError(
                    f"`remote` must be a redis:// or rediss:// URL (e.g. 'redis://localhost:6379/0'), a redis-py "
                    f"client or a RemoteConfig; got the string {self.target!r}."
                )
        elif not callable(getattr(self.target, "pipeline", None)):
            raise TypeError(
                f"`remote` must be a redis:// URL, a redis-py client (redis.Redis, RedisCluster) or a RemoteConfig; "
                f"got {type(self.target).__name__}."
            )
        for name in ("connect_timeout_s", "timeout_s", "retry_after_s"):
            if not getattr(self, name) > 0:
                value = getattr(self, name)
                raise ValueError(f"RemoteConfig.{name} must be a positive number of seconds, got {value}.")
        for name in ("max_pending_writes", "breaker_errors"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RemoteConfig.{name} must be an int >= 1, got {value!r}.")
        if self.compute_flops_per_s is not None and not self.compute_flops_per_s > 0:
            raise ValueError(f"RemoteConfig.compute_flops_per_s must be None or > 0, got {self.compute_flops_per_s}.")
        if not self.min_flops_per_byte >= 0:
            raise ValueError(f"RemoteConfig.min_flops_per_byte must be >= 0, got {self.min_flops_per_byte}.")
        if not isinstance(self.key_prefix, str) or not self.key_prefix:
            raise ValueError(f"RemoteConfig.key_prefix must be a non-empty string, got {self.key_prefix!r}.")


def _secret_bytes(secret: bytes | str | None) -> bytes | None:
    """``secret`` as bytes, or the environment's when it is None (see :class:`RemoteConfig`)."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
        if secret is None:
            return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"RemoteConfig.secret must be bytes, a str or None, got {type(secret).__name__}.")
    if not secret:
        raise ValueError(f"RemoteConfig.secret must not be empty; pass None for no secret (and leave {SECRET_ENV} "
                         "unset).")
    return bytes(secret)


def remote_config(remote: Any) -> RemoteConfig | None:
    """``remote`` as a :class:`RemoteConfig` (None stays None: no tier).

    Raises:
        ValueError, TypeError: ``remote`` is not a URL, a client or a RemoteConfig (see :class:`RemoteConfig`).
        ImportError: a URL is given but redis-py is not installed.
    """
    config = remote if remote is None or isinstance(remote, RemoteConfig) else RemoteConfig(remote)
    if config is not None and isinstance(config.target, str) and importlib.util.find_spec("redis") is None:
        raise ImportError(_NO_REDIS)
    return config


def make_client(config: RemoteConfig):
    """A redis-py client for ``config.target``: a URL gets the small timeouts and no retries (the circuit breaker
    decides when to try again); a given client is used as it is.

    Raises:
        ImportError: redis-py is not installed (``pip install redis``).
    """
    if not isinstance(config.target, str):
        return config.target
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as error:
        raise ImportError(_NO_REDIS) from error
    if config.target.startswith(CLUSTER_SCHEMES):
        return LazyCluster(functools.partial(_cluster_client, config))
    return redis.from_url(
        config.target,
        socket_connect_timeout=config.connect_timeout_s,
        socket_timeout=config.timeout_s,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )


def _cluster_client(config: RemoteConfig):
    """A ``RedisCluster`` for a ``redis+cluster://`` URL: the nodes it names are where it starts; a failed command
    is tried once more after the client re-reads the cluster's slots (a primary that failed over moved its slots to
    its replica), with the small timeouts, and no more than that (the breaker decides when to try again)."""
    from urllib.parse import unquote, urlsplit

    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    url = urlsplit(config.target)
    nodes = []
    for address in url.netloc.rpartition("@")[2].split(","):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"`remote` {config.target!r}: each node must be host:port, got {address!r}.")
        nodes.append(ClusterNode(host.strip("[]"), int(port)))
    return RedisCluster(
        startup_nodes=nodes,
        username=unquote(url.username) if url.username else None,
        password=unquote(url.password) if url.password else None,
        ssl=url.scheme.startswith("rediss"),
        socket_connect_timeout=config.connect_timeout_s,
        socket_timeout=config.timeout_s,
        retry=Retry(NoBackoff(), 1),
        health_check_interval=0,
    )


class LazyCluster:
    """A cluster client made at its first use, and made again after that failed: ``RedisCluster`` reads the
    cluster's slots when it is made, so one made while the cluster is down would raise in the cache's constructor,
    where a standalone client just fails its first command (the tier then counts an error, as for any failure)."""

    def __init__(self, make) -> None:
        self._make, self._client, self._lock = make, None, threading.Lock()

    @property
    def client(self):
        with self._lock:
            if self._client is None:
                self._client = self._make()
            return self._client

    def pipeline(self, transaction: bool = False):
        return self.client.pipeline(transaction=transaction)

    def __getattr__(self, name: str):
        return getattr(self.client, name)
