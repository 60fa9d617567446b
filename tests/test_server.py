"""The OpenAI-compatible server, end to end: a real `sparrow serve` process, the official client.

Generated text is compared with the in-process reference `sparrow.api.LLM.stream` (same
sampler, same seed), so the HTTP layer and the batching engine must not change a single token.
max_tokens stays tiny: the machine is shared and the model decodes a few tokens per second.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from sparrow.engine.runner import decode_groups
from sparrow.request import GenerationRequest
from sparrow.server.metrics import parse_prometheus
from sparrow.server.protocol import APIError, ReasoningSplitter, parse_chat, parse_completion, starts_in_reasoning

openai = pytest.importorskip("openai")

KEY = "test-key"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]


# ---------------------------------------------------------------------- no server needed
def test_decode_groups_cap_rows():
    for n in range(0, 40):
        for rows in (1, 4, 8):
            groups = decode_groups(n, rows)
            assert [i for g in groups for i in g] == list(range(n))
            assert all(1 <= len(g) <= rows for g in groups)
            assert len(groups) == -(-n // rows)
    assert [len(g) for g in decode_groups(9, 8)] == [5, 4]


@pytest.mark.parametrize("start", [False, True])
def test_reasoning_splitter_any_split(start):
    text = ("" if start else "<think>") + "\nLet me see. a<b\n</think>\n\nThe answer."
    whole = ReasoningSplitter(start).push(text, final=True)
    assert whole == ("Let me see. a<b\n", "The answer.")
    for cut in range(len(text) + 1):  # every two-piece split, tags cut anywhere
        s = ReasoningSplitter(start)
        parts = [s.push(text[:cut]), s.push(text[cut:], final=True)]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == whole
    s = ReasoningSplitter(start)
    parts = [s.push(c) for c in text] + [s.push("", final=True)]
    assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == whole


def test_reasoning_splitter_plain_and_unterminated():
    assert ReasoningSplitter().push("Hello <think> there", final=True) == ("", "Hello <think> there")
    s = ReasoningSplitter()
    assert s.push("<think>still going") == ("still going", "")
    assert s.push("</th", final=True) == ("</th", "")
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_parse_validation():
    r = parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 7,
            "stop": "x",
            "seed": -1,
            "top_k": -1,
            "whatever": {"x": 1},
            "logprobs": True,
            "top_logprobs": 2,
            "sparse_attn": True,
            "sparse_k": 4,
            "sparse_select": "v2",
            "stop_token_ids": [5],
        }
    )
    assert r.messages == [{"role": "user", "content": "a\nb"}]
    assert (r.max_tokens, r.params.stop, r.params.seed, r.params.top_k, r.params.logprobs) == (
        7,
        ["x"],
        2**64 - 1,
        0,
        2,
    )
    assert (r.sparse.k, r.sparse.block, r.sparse.select, r.params.stop_token_ids) == (4, 32, "v2", [5])
    assert parse_completion({"prompt": [[1, 2, 3]]}).prompts == [[1, 2, 3]]
    assert parse_completion({"prompt": ["a", "b"], "n": 2, "echo": True}).prompts == ["a", "b"]
    bad = [
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": []}, "messages"),
        ({"messages": CHAT, "max_tokens": -1}, "max_tokens"),
        ({"messages": CHAT, "max_tokens": 2.5}, "max_tokens"),
        ({"messages": CHAT, "temperature": "hot"}, "temperature"),
        ({"messages": CHAT, "kv_dtype": "q4"}, "kv_dtype"),
        ({"messages": CHAT, "temperature": True}, "temperature"),
        ({"messages": CHAT, "temperature": float("nan")}, "temperature"),
        ({"messages": CHAT, "top_p": float("inf")}, "top_p"),
        ({"messages": CHAT, "n": 129}, "n"),
        ({"messages": CHAT, "n": 0}, "n"),
        ({"messages": CHAT, "stop": [1]}, "stop"),
        ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": CHAT, "sparse_attn": True, "sparse_k": 0}, "sparse_k"),
        ({"messages": CHAT, "sparse_attn": True, "sparse_select": "quest"}, "sparse_select"),
        ({"messages": CHAT, "stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ]
    for body, param in bad:
        with pytest.raises(APIError) as e:
            parse_chat(body)
        assert (e.value.status, e.value.param) == (400, param), body
    for prompt in ([], [["a"]], ["a", [1]], ["a"] * 2049):
        with pytest.raises(APIError) as e:
            parse_completion({"prompt": prompt})
        assert e.value.param == "prompt", prompt
    with pytest.raises(APIError) as e:
        parse_completion({"prompt": ["a"] * 17, "n": 128})  # 2176 sequences
    assert e.value.param == "n"


# ---------------------------------------------------------------------- server fixtures
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    log = tempfile.TemporaryFile("w+")  # not a pipe: a full pipe would block the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparrow.cli", "serve", "--port", str(port), "--api-key", KEY],
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    saw_503 = False
    try:
        deadline = time.time() + 600
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"server exited: {log.read()}")
            try:
                code = httpx.get(base + "/health", timeout=5).status_code
                saw_503 |= code == 503
                if code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "server did not become ready"
            time.sleep(0.25)
        state = {"base": base, "saw_503": saw_503, "log": log, "log_seen": 0}
        yield state
        # What tests after test_server_log_has_no_tracebacks (in any order) made the server log.
        problem = _log_problem(state)
        if problem:
            pytest.fail(problem)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _log_problem(server) -> str | None:
    """The server log since the last look, when it shows a traceback or an internal error."""
    log = server["log"]
    log.seek(server["log_seen"])
    text = log.read()
    server["log_seen"] = log.tell()
    if "Traceback" in text or "internal error" in text:
        return "the server logged an internal error:\n" + text[-3000:]
    return None


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, timeout=600, max_retries=0)


@pytest.fixture(scope="module")
def ref():
    import sparrow.api

    return sparrow.api.load()


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def _ref_text(ref, prompt, **kw):
    outs = list(ref.stream(prompt, **kw))
    return "".join(o.text for o in outs), outs


def _metrics(server) -> dict:
    r = httpx.get(server["base"] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    return parse_prometheus(r.text)  # with --api-key, /metrics needs it (unless --metrics-public)


def _post(server, path, body=None, content=None, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server["base"] + path, json=body, content=content, headers=headers, timeout=600, **kw)


# ---------------------------------------------------------------------- generation
def test_health_and_models(server, client, ref):
    assert server["saw_503"]  # uvicorn answers while the model loads
    assert httpx.get(server["base"] + "/health").json()["status"] == "ok"
    models = client.models.list().data
    assert [m.id for m in models] == [ref.name]


def test_chat_matches_reference_and_stream(client, ref, model_id):
    text, outs = _ref_text(ref, CHAT, chat=True, max_tokens=5, temperature=0)
    r = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=5, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == model_id
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == outs[-1].finish_reason
    n_prompt = len(ref.prompt_ids(CHAT, chat=True))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        n_prompt,
        len(outs),
        n_prompt + len(outs),
    )

    chunks = list(
        client.chat.completions.create(
            model=model_id,
            messages=CHAT,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == outs[-1].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()


def test_completion_stop_strings(client, ref, model_id):
    prompt = "The capital of France is"
    text, _ = _ref_text(ref, prompt, max_tokens=6, temperature=0)
    r = client.completions.create(model=model_id, prompt=prompt, max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == text
    stop = text.strip()[2:4]  # something inside the greedy text: generation must end just before it
    want = text[: text.index(stop)]
    r = client.completions.create(model=model_id, prompt=prompt, max_tokens=6, temperature=0, stop=[stop, "zzz"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = list(
        client.completions.create(model=model_id, prompt=prompt, max_tokens=6, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def seeded(client, model_id):
    kw = dict(
        model=model_id,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=6,
        temperature=0.8,
        seed=1234,
        top_p=0.95,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        extra_body={"top_k": 50, "min_p": 0.02, "repetition_penalty": 1.1},
    )
    return kw, client.chat.completions.create(**kw).choices[0].message.content


def test_seed_reproducible(client, ref, seeded):
    kw, first = seeded
    assert client.chat.completions.create(**kw).choices[0].message.content == first
    text, _ = _ref_text(
        ref,
        kw["messages"],
        chat=True,
        max_tokens=6,
        temperature=0.8,
        seed=1234,
        top_p=0.95,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        top_k=50,
        min_p=0.02,
        repetition_penalty=1.1,
    )
    assert first == text


def test_logprobs(client, ref, model_id):
    _, outs = _ref_text(ref, CHAT, chat=True, max_tokens=4, temperature=0, logprobs=3)
    r = client.chat.completions.create(
        model=model_id, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    shown = [o for o in outs if o.token_id not in ref.tokenizer.eos_token_ids]
    assert len(content) == len(shown)
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c, o in zip(content, shown):
        assert c.logprob == pytest.approx(o.logprob, abs=1e-5)
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([lp for _, lp in o.top_logprobs], abs=1e-5)
        assert c.top_logprobs[0].token == c.token  # greedy picks the best
        assert bytes(c.bytes).decode() == c.token
    chunks = list(
        client.chat.completions.create(
            model=model_id, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    r = client.completions.create(model=model_id, prompt="Hello", max_tokens=2, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 2
    assert lp.text_offset == [0, len(lp.tokens[0])] and "".join(lp.tokens) == r.choices[0].text


def test_per_request_kv_dtype_is_applied(client, ref, model_id):
    """A request's kv_dtype reaches the engine: its logprobs are those of that cache, not the server's f32."""
    for kv in ("int8", "f16"):
        _, outs = _ref_text(ref, CHAT, chat=True, max_tokens=3, temperature=0, logprobs=0, kv_dtype=kv)
        _, f32 = _ref_text(ref, CHAT, chat=True, max_tokens=3, temperature=0, logprobs=0)
        assert [o.logprob for o in outs] != [o.logprob for o in f32]  # the check below can tell them apart
        r = client.chat.completions.create(
            model=model_id, messages=CHAT, max_tokens=3, temperature=0, logprobs=True, extra_body={"kv_dtype": kv}
        )
        got = [c.logprob for c in r.choices[0].logprobs.content]
        want = [o.logprob for o in outs if o.token_id not in ref.tokenizer.eos_token_ids]
        assert got == pytest.approx(want, abs=1e-6)


def test_concurrent_streams_and_batch_invariance(server, client, seeded):
    kw, alone = seeded
    before = _metrics(server)
    results, errors = {}, []

    def stream(i):
        try:
            chunks = list(
                client.chat.completions.create(
                    model=kw["model"],
                    messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                    max_tokens=12,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            )
            results[i] = (
                "".join(c.choices[0].delta.content or "" for c in chunks),
                chunks[-1].choices[0].finish_reason,
            )
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    under_load = client.chat.completions.create(**kw).choices[0].message.content
    for t in threads:
        t.join(600)
    assert not errors and len(results) == 8
    assert all(reason == "length" for _, reason in results.values())
    assert under_load == alone
    after = _metrics(server)
    # Batching really happened: more decoded tokens than decode forwards.
    d_tok = after["sparrow_decode_tokens_total"] - before["sparrow_decode_tokens_total"]
    d_fwd = after["sparrow_decode_forwards_total"] - before["sparrow_decode_forwards_total"]
    assert d_tok > d_fwd


def test_cancelled_stream_stops(server, model_id):
    before = _metrics(server)
    body = {
        "model": model_id,
        "prompt": "Once upon a time",
        "max_tokens": 500,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", server["base"] + "/v1/completions", json=body, timeout=600, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 2:
                    break
    deadline = time.time() + 120
    while True:
        m = _metrics(server)
        if (
            m["sparrow_requests_cancelled_total"] > before["sparrow_requests_cancelled_total"]
            and m["sparrow_num_requests_running"] == 0
        ):
            break
        assert time.time() < deadline, m
        time.sleep(0.2)
    assert m["sparrow_generation_tokens_total"] - before["sparrow_generation_tokens_total"] < 100
    assert m.get('sparrow_request_finished_total{finish_reason="length"}') == before.get(
        'sparrow_request_finished_total{finish_reason="length"}'
    )


def test_engine_batches_match_solo(ref, monkeypatch):
    """Decode rows are split into forwards of at most SMALL_T and each sequence's tokens equal its solo run.

    SMALL_T is lowered to 2 so that four concurrent sequences need split forwards."""
    from sparrow.engine.engine import Engine
    from sparrow.kernels import linear
    from sparrow.params import SamplingParams

    monkeypatch.setattr(linear, "SMALL_T", 2)
    prompts = [ref.tokenizer.encode(t) for t in ("Hi there", "The sky is", "One, two,", "Paris is the")]
    solo = [[o.token_id for o in ref.stream(p, max_tokens=6, temperature=0.9, seed=i)] for i, p in enumerate(prompts)]
    sizes, forward = [], ref.model.forward

    def spy(segments, **kw):
        if segments[0].decode:
            sizes.append(len(segments))
        return forward(segments, **kw)

    monkeypatch.setattr(ref.model, "forward", spy)
    got = [[] for _ in prompts]
    done = threading.Semaphore(0)

    def emitter(i):
        def emit(kind, out):
            assert kind == "token", out
            got[i].append(out.token_id)
            if out.finish_reason:
                done.release()

        return emit

    engine = Engine(ref.handle, max_batch=16)
    for i, p in enumerate(prompts):
        engine.submit(GenerationRequest(p, SamplingParams(max_tokens=6, temperature=0.9, seed=i)), emitter(i))
    engine.start(warmup=False)
    try:
        for _ in prompts:
            assert done.acquire(timeout=600)
    finally:
        engine.stop()
    assert got == solo
    assert max(sizes) == 2 and len(sizes) > 6  # batched, and never more than SMALL_T rows


# ---------------------------------------------------------------------- errors
def _err(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_errors(server, client, model_id, ref):
    ok = {"model": model_id, "messages": CHAT, "max_tokens": 1}
    _err(
        _post(
            server,
            "/v1/chat/completions",
            content=b'{"model": "x", "messages": [',
        ),
        400,
    )
    _err(_post(server, "/v1/chat/completions", content=b"\xff\xfe"), 400)
    _err(_post(server, "/v1/chat/completions", body=[1, 2]), 400)
    assert _err(_post(server, "/v1/chat/completions", {**ok, "max_tokens": -5}), 400)["param"] == "max_tokens"
    assert _err(_post(server, "/v1/chat/completions", {**ok, "temperature": "hot"}), 400)["param"] == "temperature"
    assert _err(_post(server, "/v1/chat/completions", {**ok, "messages": [{"role": "wizard", "content": "hi"}]}), 400)
    assert _err(_post(server, "/v1/chat/completions", {**ok, "messages": "hi"}), 400)["param"] == "messages"
    assert _err(_post(server, "/v1/chat/completions", {**ok, "n": 129}), 400)["param"] == "n"
    assert _err(_post(server, "/v1/completions", {"model": model_id, "prompt": 5}), 400)["param"] == "prompt"
    n_prompt = len(ref.prompt_ids(CHAT, chat=True))
    err = _err(_post(server, "/v1/chat/completions", {**ok, "max_tokens": 9000}), 400)
    assert str(n_prompt) in err["message"] and "9000" in err["message"] and str(ref.ctx) in err["message"]
    assert err["code"] == "context_length_exceeded"
    assert _err(_post(server, "/v1/chat/completions", {**ok, "model": "gpt-17"}), 404)["code"] == "model_not_found"
    _err(_post(server, "/v1/chat/completions", ok, key=None), 401)
    _err(_post(server, "/v1/chat/completions", ok, key="wrong"), 401)
    _err(httpx.get(server["base"] + "/v1/models"), 401)
    big = json.dumps({**ok, "pad": "x" * (9 * 1024 * 1024)}).encode()
    _err(_post(server, "/v1/chat/completions", content=big), 413)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server["base"] + "/v1", api_key="bad", max_retries=0).models.list()
    # Unknown fields are ignored.
    r = _post(server, "/v1/chat/completions", {**ok, "temperature": 0, "frobnicate": {"a": [1]}, "user": "me"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    assert httpx.get(server["base"] + "/health").status_code == 200
    m = _metrics(server)
    assert m['sparrow_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 6
    assert m['sparrow_requests_total{endpoint="/v1/chat/completions",status="413"}'] == 1


def test_tokenize_detokenize(server, ref, model_id):
    r = _post(server, "/tokenize", {"model": model_id, "prompt": "Hello world"}).json()
    assert r["tokens"] == ref.tokenizer.encode("Hello world", add_special_tokens=True)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == ref.ctx
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a fruit."}]}]
    r2 = _post(server, "/tokenize", {"messages": parts}).json()
    assert r2["tokens"] == ref.prompt_ids([{"role": "user", "content": "Name\na fruit."}], chat=True)
    assert _post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    _err(_post(server, "/detokenize", {"tokens": ["a"]}), 400)
    _err(_post(server, "/detokenize", {"tokens": [10**9]}), 400)


def test_server_log_has_no_tracebacks(server, model_id):
    """Bad, cut-off and good requests leave no traceback or internal error in the server log (nor
    did any test before this one; the server fixture checks once more after the last test)."""
    body = {
        "model": model_id,
        "prompt": "Once upon a time",
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", server["base"] + "/v1/completions", json=body, timeout=600, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: {"))  # then hang up mid-stream
    ok = {"model": model_id, "messages": CHAT, "max_tokens": 1}
    bad = [
        ("/v1/chat/completions", {"content": b'{"model": "x", "messages": ['}),
        ("/v1/chat/completions", {"content": b"\xff\xfe"}),
        ("/v1/chat/completions", {"body": [1, 2]}),
        ("/v1/chat/completions", {"body": {**ok, "messages": [{"role": "wizard", "content": "hi"}]}}),
        ("/v1/chat/completions", {"body": {**ok, "max_tokens": 10**6}}),
        ("/v1/chat/completions", {"body": {**ok, "sparse_attn": True, "sparse_k": 0}}),
        ("/v1/chat/completions", {"body": {**ok, "model": "gpt-17"}}),
        ("/v1/chat/completions", {"body": ok, "key": "wrong"}),
        ("/v1/completions", {"body": {"model": model_id, "prompt": [[1, 2], "a"]}}),
        ("/v1/completions", {"body": {"model": model_id, "prompt": [10**9]}}),
        ("/tokenize", {"body": {"prompt": 5}}),
        ("/detokenize", {"body": {"tokens": [-1]}}),
        ("/v1/no-such-route", {"body": {}}),
    ]
    for path, kw in bad:
        r = _post(server, path, **kw)
        assert 400 <= r.status_code < 500, (path, kw, r.status_code, r.text)
    r = _post(server, "/v1/chat/completions", {**ok, "temperature": 0})  # and the server still serves
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    problem = _log_problem(server)
    assert problem is None, problem
