"""Request bodies before FastAPI sees them: a size limit (413) and JSON whatever the Content-Type.

FastAPI reads a whole body before validating it, so the limit is enforced here, in front: an
oversized body is read and dropped (up to _DRAIN) so the client gets the 413 instead of a reset
connection. The API only takes JSON, and `curl -d` labels it as a form: the body is handed on
as application/json so FastAPI parses it either way.
"""

from __future__ import annotations

import json

from .protocol import error_body

MAX_BODY = 8 * 1024 * 1024  # bytes; larger bodies get 413
_DRAIN = 64 * 1024 * 1024  # read and drop up to this much of an oversized body so the client sees the 413
_JSON = b"application/json"


class BodyLimit:
    """Pure ASGI: reads a POST body up front (at most MAX_BODY bytes), then replays it; later
    receive() calls (a disconnect while generating) pass straight through."""

    def __init__(self, app, max_body: int = MAX_BODY):
        self.app, self.max_body = app, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        size = headers.get(b"content-length", b"").decode("latin-1")
        if size.isdigit() and int(size) > self.max_body:
            if int(size) <= _DRAIN:
                await _read(receive, _DRAIN)
            return await _too_large(send, f"request body of {size} bytes exceeds the limit of {self.max_body}")
        body, n = await _read(receive, self.max_body)
        if n > self.max_body:
            return await _too_large(send, f"request body exceeds the limit of {self.max_body} bytes")
        if not headers.get(b"content-type", b"").lower().startswith(_JSON):
            hs = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = dict(scope, headers=hs + [(b"content-type", _JSON)])
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _read(receive, limit: int) -> tuple[bytes, int]:
    """The body, if it fits in `limit`, and its length (reading stops once past `_DRAIN`)."""
    chunks, n = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        n += len(chunk)
        if n <= limit:
            chunks.append(chunk)
        if not message.get("more_body", False) or n > _DRAIN:
            break
    return (b"".join(chunks) if n <= limit else b""), n


async def _too_large(send, message: str) -> None:
    body = json.dumps(error_body(message, code="request_too_large")).encode()
    headers = [(b"content-type", _JSON), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})
