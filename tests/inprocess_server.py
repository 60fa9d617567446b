"""A sparrow server on a background thread of the test process (uvicorn, a free port), for
tests that need HTTP but not a separate process."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

from sparrow.server.app import ServerState, create_app


@contextmanager
def serving(state: ServerState, llm, timeout: float = 300):
    """Base URL of a server on `llm` with `state`'s settings, once it is ready; stopped after."""
    import uvicorn

    app = create_app(state)
    state.attach(llm)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + timeout
    while not (server.started and state.ready):
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        state.engine.stop()
