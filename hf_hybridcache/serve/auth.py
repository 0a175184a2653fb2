"""An API key for the server (``--api-key`` or ``$HF_HYBRIDCACHE_API_KEY``): every ``/v1/`` request must send
``Authorization: Bearer KEY`` (the ``openai`` client's ``api_key=``), as vLLM's and llama-server's ``--api-key`` ask;
``/health`` and ``/metrics`` stay open for load balancers and Prometheus. It is a shared secret, not TLS: expose the
server beyond loopback behind a TLS proxy (docs/serving.md)."""

from __future__ import annotations

import hmac
import json

from .schema import APIError

#: The environment variable read when ``--api-key`` is not given.
API_KEY_ENV = "HF_HYBRIDCACHE_API_KEY"


class RequireAPIKey:
    """ASGI middleware: a ``/v1/`` request without ``Authorization: Bearer <key>`` gets a 401 ``invalid_api_key``
    (OpenAI's error shape). Plain ASGI, so streaming responses and disconnects pass through untouched.

    Args:
        app: the ASGI app behind it.
        api_key: the key clients must send (a non-empty string).

    Raises:
        ValueError: ``api_key`` is empty.
    """

    def __init__(self, app, api_key: str) -> None:
        if not api_key:
            raise ValueError("--api-key must not be empty; omit it to serve without a key.")
        self.app, self._expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        sent = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(sent, self._expected):
            await self.app(scope, receive, send)
            return
        message = "Missing API key: send Authorization: Bearer <key>." if not sent else "Incorrect API key provided."
        body = json.dumps(APIError(401, message, code="invalid_api_key").body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
