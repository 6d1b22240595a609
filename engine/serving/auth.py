"""API keys: who may call the server, and the rule that a server reachable from other machines needs one.

:func:`resolve_api_key` applies the start-up rule: a key comes from ``--api-key`` or an
environment variable, and listening beyond loopback (any host but 127.0.0.1, localhost, ::1)
without one is refused. :class:`APIKeyGuard` checks the key on every API route (``/v1/...``,
``/metrics``, FastAPI's schema pages); ``/health`` stays open for probes, and other mounted apps
(the web page) do their own checks.

- HTTP: ``Authorization: Bearer KEY`` (what the OpenAI SDKs send); otherwise a 401 with an
  OpenAI-shaped error body (``code: invalid_api_key``).
- WebSocket: the same header (the official ``openai`` Python SDK sends it on Realtime
  connections), or the ``openai-insecure-api-key.KEY`` subprotocol (OpenAI's browser form);
  otherwise HTTP 401 before the handshake completes.
"""

from __future__ import annotations

import hmac
import json
import os

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.serving.openai_protocol import APIError

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
GUARDED_PREFIXES = ("/v1", "/metrics", "/docs", "/redoc", "/openapi.json")
SUBPROTOCOL_PREFIX = "openai-insecure-api-key."


class MissingAPIKey(ValueError):
    """The server would listen beyond loopback without an API key; the message says how to give one."""


def resolve_api_key(host: str, key: str | None, env_var: str) -> str | None:
    """The key to require (``key``, else ``$env_var``, else None); MissingAPIKey when ``host`` is
    not loopback and there is none."""
    key = key or os.environ.get(env_var) or None
    if key is None and host not in LOOPBACK_HOSTS:
        raise MissingAPIKey(f"listening on {host} lets other machines in, so an API key is required: "
                            f"pass --api-key KEY or set {env_var}=KEY (clients send Authorization: Bearer KEY), "
                            "or listen on 127.0.0.1")  # fmt: skip
    return key


class APIKeyGuard:
    """ASGI middleware: requests to :data:`GUARDED_PREFIXES` must carry ``key`` (see the module doc)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not _guarded(scope["path"]) or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "Incorrect or missing API key: send Authorization: Bearer KEY.", code="invalid_api_key")
        body = json.dumps(error.body().model_dump()).encode()
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        elif "websocket.http.response" in scope.get("extensions", {}):  # a real 401 instead of the handshake
            await receive()  # websocket.connect
            await send({"type": "websocket.http.response.start", "status": 401, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:  # the server cannot send a response of its own: a plain refusal (HTTP 403)
            await receive()
            await send({"type": "websocket.close", "code": 1008})

    def _allowed(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                if hmac.compare_digest(value[7:].strip(), self._key):
                    return True
            elif name == b"sec-websocket-protocol" and scope["type"] == "websocket":
                for offered in value.split(b","):
                    offered = offered.strip()
                    if offered.startswith(SUBPROTOCOL_PREFIX.encode()) and hmac.compare_digest(
                        offered[len(SUBPROTOCOL_PREFIX) :], self._key
                    ):
                        return True
        return False


def _guarded(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in GUARDED_PREFIXES)
