"""A real `sparrow serve` under load and faults: a KV budget too small for the requests sent at
once, a bounded queue (503 + Retry-After), a second chat turn served from the prefix cache, and
SIGTERM mid-stream. Seeded answers are compared with in-process solo runs (sparrow.api)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
from test_server import _free_port

from sparrow.server.metrics import parse_prometheus

openai = pytest.importorskip("openai")
KV_PER_TOKEN = 30 * 2 * 3 * 64 * 4 + 30 * 4  # default model, f32: K and V of 30 layers x 3 heads x 64, importance


def start_server(*args):
    port = _free_port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparrow.cli", "serve", "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"server exited: {log.read()}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return proc, base, log
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "server did not become ready"
        time.sleep(0.25)


def stop_server(proc, log):
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.seek(0)
    text = log.read()
    log.close()
    return text


@pytest.fixture(scope="module")
def ref():
    import sparrow.api

    return sparrow.api.load()


@pytest.fixture(scope="module")
def tight():
    """Room for about 136 positions of KV: two requests at admission, not two grown ones."""
    proc, base, log = start_server(
        "--kv-budget", str(136 * KV_PER_TOKEN), "--max-queue", "2", "--max-batch", "4", "--request-timeout", "300"
    )
    yield base
    text = stop_server(proc, log)
    assert "Traceback" not in text and "internal error" not in text, text[-3000:]


def _messages(i):
    """Prompts of 44-54 tokens: two fit the budget at admission (64 positions each), but not once
    one has grown past 64 with its 30 new tokens."""
    story = " ".join(f"w{j}" for j in range(4 + i))
    return [{"role": "user", "content": f"Request {i}. Continue: {story}"}]


def test_tiny_budget_serves_every_request_as_a_solo_run(tight, ref):
    n = 6
    client = openai.OpenAI(base_url=tight + "/v1", api_key="x", timeout=600, max_retries=50)
    model = client.models.list().data[0].id
    got, errors = [None] * n, []

    def one(i):
        try:
            stream = client.chat.completions.create(
                model=model,
                messages=_messages(i),
                max_tokens=30,
                temperature=0.9,
                seed=10 + i,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            got[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert errors == []
    for i in range(n):
        kw = dict(chat=True, max_tokens=30, temperature=0.9, seed=10 + i, ignore_eos=True)
        assert got[i] == "".join(o.text for o in ref.stream(_messages(i), **kw)), i
    m = parse_prometheus(httpx.get(tight + "/metrics").text)
    assert m["sparrow_preemptions_total"] > 0
    assert 0 < m["sparrow_kv_cache_bytes_peak"] <= m["sparrow_kv_cache_bytes_budget"] == 136 * KV_PER_TOKEN


def test_full_queue_answers_503_with_retry_after(tight):
    results = []

    def one(i):
        r = httpx.post(
            tight + "/v1/completions",
            json={"prompt": f"Count: {i}", "max_tokens": 20, "temperature": 0, "ignore_eos": True},
            timeout=600,
        )
        results.append((r.status_code, r.headers.get("retry-after"), r.json()))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    codes = sorted(c for c, _, _ in results)
    assert 503 in codes and 200 in codes and set(codes) <= {200, 503}
    for code, retry, body in results:
        if code == 503:
            assert int(retry) >= 1 and body["error"]["code"] == "server_busy"


def test_too_large_for_the_budget_is_a_400(tight):
    r = httpx.post(tight + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1000}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "KV budget" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def plain():
    """A server with the default budget; the SIGTERM test (last) ends it."""
    proc, base, log = start_server("--drain-timeout", "4")
    yield proc, base, log
    stop_server(proc, log)


def test_second_chat_turn_is_served_from_the_prefix_cache(plain, ref):
    _, base, _ = plain
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=600, max_retries=0)
    model = client.models.list().data[0].id
    system = "You are a careful assistant. " * 90  # > 512 tokens: one whole prefill chunk
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]
    r1 = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "Why?"}]
    before = parse_prometheus(httpx.get(base + "/metrics").text)["sparrow_prefill_tokens_total"]
    r2 = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0)
    m = parse_prometheus(httpx.get(base + "/metrics").text)
    assert r2.usage.prompt_tokens_details.cached_tokens == 512
    assert m["sparrow_prefill_tokens_total"] - before == r2.usage.prompt_tokens - 512  # only the new tokens
    assert m["sparrow_prefix_cache_hits_total"] == 1
    want = "".join(o.text for o in ref.stream(msgs, chat=True, max_tokens=4, temperature=0))
    assert r2.choices[0].message.content == want


def _sse(base, body):
    """Opens a stream; returns (response, line iterator)."""
    client = httpx.Client(timeout=600)
    request = client.build_request("POST", base + "/v1/completions", json={**body, "stream": True})
    resp = client.send(request, stream=True)
    return resp, resp.iter_lines()


def test_sigterm_drains_in_flight_streams_and_exits_cleanly(plain):
    proc, base, log = plain
    short = {"prompt": "One", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    long = {"prompt": "Two", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    streams = [_sse(base, short), _sse(base, long)]
    for _, lines in streams:  # both are generating
        assert next(line for line in lines if line.startswith("data:"))
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    late = httpx.post(base + "/v1/completions", json={"prompt": "Three", "max_tokens": 2}, timeout=60)
    assert late.status_code == 503 and late.headers["retry-after"]
    ends = []
    for _, lines in streams:
        events = [line[6:] for line in lines if line.startswith("data: ")]
        ends.append((events[-1], json.loads(events[-2])))
    assert ends[0][0] == "[DONE]" and ends[0][1]["choices"][0]["finish_reason"] == "length"  # finished in grace
    assert ends[1][0] == "[DONE]" and "shutting down" in ends[1][1]["error"]["message"]  # cut at the grace end
    assert proc.wait(60) == 0
    log.seek(0)
    assert "Traceback" not in log.read()
