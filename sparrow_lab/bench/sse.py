"""The client side of the server's streamed answers, for the benches that drive `sparrow serve`
over HTTP (bench/serve.py, serve_load.py, sparse_trace.py)."""

import json


def events(response):
    """The JSON messages of a server-sent event stream (an open HTTP response: bench.serve._post), in order;
    the closing `data: [DONE]` and blank lines are skipped."""
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: {"):
            yield json.loads(line[6:])
