"""A shared second tier behind the local store: Redis or Valkey through redis-py (``pip install redis``, or
``pip install -e '.[redis]'`` in a clone), so several processes and machines serving one model share their prefixes.

Modules, one job each: ``config`` (what ``remote=`` accepts; the client), ``client`` (pipelined operations, circuit
breaker, counters), ``codec`` (keys and self-verifying safetensors values, signed under a secret), ``namespace`` (the hash seed caches of one
model share), ``writer`` (background publishing), ``fetch`` (extending a local hit from the tier) and ``tier``
(:class:`RemoteTier`, which composes them).
"""

from .client import COUNTERS, CircuitBreaker
from .config import SECRET_ENV, RemoteConfig, remote_config
from .tier import RemoteTier, attach

__all__ = ["COUNTERS", "SECRET_ENV", "CircuitBreaker", "RemoteConfig", "RemoteTier", "attach", "remote_config"]
