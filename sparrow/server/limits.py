"""Requests before FastAPI sees them: a size limit (413) and a read timeout (408) for bodies, JSON
whatever the Content-Type, and a timeout for the request head (the HTTP protocol class).

FastAPI reads a whole body before validating it, so the limit is enforced here, in front: an
oversized body is read and dropped (up to _DRAIN) so the client gets the 413 instead of a reset
connection. The API only takes JSON, and `curl -d` labels it as a form: the body is handed on
as application/json so FastAPI parses it either way.

Slow clients: uvicorn only times out an idle keep-alive connection, and any byte received resets
that timer, so a client sending a header line (or a body byte) every few seconds held its
connection, and a worker's memory, for good. The head must now arrive within HEADER_TIMEOUT of
the connection opening (or of the previous response) and the body within BODY_TIMEOUT of the head.
"""

from __future__ import annotations

import asyncio
import json

from .protocol import error_body

MAX_BODY = 8 * 1024 * 1024  # bytes; larger bodies get 413
HEADER_TIMEOUT = 10.0  # seconds for a request's head (request line and headers); then the connection closes
BODY_TIMEOUT = 60.0  # seconds for a whole body once its head is in (8 MiB at ~140 KB/s); then 408
_DRAIN = 64 * 1024 * 1024  # read and drop up to this much of an oversized body so the client sees the 413
_JSON = b"application/json"


class BodyLimit:
    """Pure ASGI: reads a POST body up front (at most MAX_BODY bytes), then replays it; later
    receive() calls (a disconnect while generating) pass straight through."""

    def __init__(self, app, max_body: int = MAX_BODY, timeout: float | None = BODY_TIMEOUT):
        self.app, self.max_body, self.timeout = app, max_body, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        names = [k for k, _ in scope["headers"]]
        if b"transfer-encoding" in names and b"content-length" in names:
            # RFC 9112 6.3: a proxy that trusts Content-Length and this server (chunked) would read
            # different requests from the same bytes (request smuggling); httptools refuses these
            # itself, h11 did not
            message = "a request may not carry both Content-Length and Transfer-Encoding"
            return await _refuse(send, 400, message, "invalid_framing", close=True, path=scope.get("path", ""))
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers, path = dict(scope["headers"]), scope.get("path", "")
        size = headers.get(b"content-length", b"").decode("latin-1")
        try:
            async with asyncio.timeout(self.timeout):
                if size.isdigit() and int(size) > self.max_body:
                    if int(size) <= _DRAIN:
                        await _read(receive, _DRAIN)
                    message = f"request body of {size} bytes exceeds the limit of {self.max_body}"
                    return await _refuse(send, 413, message, "request_too_large", path=path)
                body, n = await _read(receive, self.max_body)
        except TimeoutError:
            message = f"the request body did not arrive within {self.timeout:g} s"
            return await _refuse(send, 408, message, "request_timeout", close=True, path=path)
        if n > self.max_body:
            message = f"request body exceeds the limit of {self.max_body} bytes"
            return await _refuse(send, 413, message, "request_too_large", path=path)
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


async def _refuse(send, status: int, message: str, code: str, close: bool = False, path: str = "") -> None:
    if path.startswith("/v1/messages"):  # Anthropic's API answers in Anthropic's error shape
        kind = {413: "request_too_large"}.get(status, "invalid_request_error")
        body = json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()
    else:
        body = json.dumps(error_body(message, code=code)).encode()
    headers = [(b"content-type", _JSON), (b"content-length", str(len(body)).encode())]
    if close:  # the rest of the body may still be on its way: this connection carries no next request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def http_protocol(header_timeout: float | None = HEADER_TIMEOUT):
    """uvicorn's HTTP protocol class (httptools when installed, else h11), closing a connection
    whose next request head has not arrived header_timeout seconds after the connection opened or
    the previous response ended. None: uvicorn's own class, with no such limit."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    if header_timeout is None:
        return AutoHTTPProtocol

    class HeaderTimeoutProtocol(AutoHTTPProtocol):
        # Both of uvicorn's protocols make a new `cycle` object when a request head is complete, so
        # "the cycle is still the one seen when the timer was set" means no head arrived since.
        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_head_timer()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm_head_timer()

        def connection_lost(self, exc):
            self._disarm_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self):
            self._disarm_head_timer()
            if not self.transport.is_closing():
                self._head_timer = self.loop.call_later(header_timeout, self._head_timeout, self.cycle)

        def _disarm_head_timer(self):
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
                self._head_timer = None

        def _head_timeout(self, cycle_then):
            self._head_timer = None
            if self.cycle is cycle_then and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
