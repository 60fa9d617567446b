"""Request framing (issue 69, transport): a request carrying both Content-Length and
Transfer-Encoding is refused (a proxy trusting Content-Length and the server reading chunks
would see different requests in the same bytes), with both of uvicorn's HTTP parsers; and the
body limits answer in Anthropic's error shape on Anthropic's endpoints."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from fastapi import FastAPI, Request

from sparrow.server.limits import BodyLimit, http_protocol


@contextmanager
def _serve(http):
    import uvicorn

    app = FastAPI()

    @app.post("/{path:path}")
    async def echo(request: Request, path: str):
        return {"body": (await request.body()).decode()}

    app.add_middleware(BodyLimit, max_body=1000)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", http=http))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        t.join(10)


def _raw(port: int, head: bytes, body: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(head + b"\r\n" + body)
        out = b""
        while True:
            try:
                chunk = c.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out and b'"}' in out:
                break
        return out


PARSERS = ["h11", http_protocol()]
try:
    import httptools  # noqa: F401
except ImportError:
    PARSERS = PARSERS[:1]


@pytest.mark.parametrize("http", PARSERS, ids=lambda p: p if isinstance(p, str) else "httptools")
def test_content_length_with_transfer_encoding_is_refused(http):
    chunked = b'7\r\n{"a":1}\r\n0\r\n\r\n'
    with _serve(http) as port:
        both = _raw(
            port, b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n", chunked
        )
        assert both.startswith(b"HTTP/1.1 400"), both[:200]
        assert b"connection: close" in both.lower()
        plain = _raw(
            port, b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n", chunked
        )
        assert plain.startswith(b"HTTP/1.1 200") and b'{\\"a\\":1}' in plain, plain[:300]


def test_body_limit_speaks_anthropic_on_its_endpoints():
    with _serve("h11") as port:
        base = f"http://127.0.0.1:{port}"
        r = httpx.post(base + "/v1/messages", content=b"x" * 2000)
        assert r.status_code == 413 and r.json() == {
            "type": "error",
            "error": {"type": "request_too_large", "message": "request body of 2000 bytes exceeds the limit of 1000"},
        }
        r = httpx.post(base + "/v1/chat/completions", content=b"x" * 2000)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
