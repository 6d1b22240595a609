"""The request body limit: a body over ``max_bytes`` is answered 413 before it is parsed or tokenized.

An ASGI middleware on the routes given (the generation routes; an app mounted beside them, such as
a page with its own uploads, keeps its own rules). A declared ``Content-Length`` over the limit is
refused before a byte of the body is read; a chunked body is read only up to the limit. Under the
limit the body is handed on whole, then the client's own messages follow (a route that watches for
the client going away still sees its disconnect).
"""

from __future__ import annotations

from collections.abc import Collection

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.serving.openai_protocol import APIError


class BodyLimit:
    """413 ``request_too_large`` (OpenAI's error body) for a body over ``max_bytes`` on ``paths``."""

    def __init__(self, app: ASGIApp, max_bytes: int, paths: Collection[str]) -> None:
        self.app, self.max_bytes, self.paths = app, max_bytes, frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, declared)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone before the body was whole
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, None)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else "larger than that"
        err = APIError(413, f"The request body is {size}; this server accepts at most {self.max_bytes} bytes.",
                       code="request_too_large")  # fmt: skip
        await JSONResponse(err.body().model_dump(), status_code=413)(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
