"""n choices per prompt, batched completion prompts, `echo`, and `echo` + `logprobs` over the
prompt (issue 38): each checked against single requests of the same server (n=1 with seed + i,
one prompt at a time) and the prompt logprobs against the in-process API, to the bit.

The server runs in this process on the tiny GGUF of test_fuzz_files (a 384-token vocabulary),
with a 1024-token context so that a prompt can span two 512-token prefill chunks.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import pytest
from inprocess_server import serving
from test_fuzz_files import tiny_gguf  # noqa: F401 - the fixture, shared

import sparrow
from sparrow.engine.sampling import log_softmax
from sparrow.request import GenerationRequest
from sparrow.server.app import ServerState

CHAT_PATH, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the heat"}]
MAX_QUEUE = 40


@pytest.fixture(scope="module")
def llm(tiny_gguf, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp("choices") / "tiny.gguf"
    path.write_bytes(tiny_gguf)
    return sparrow.load(str(path), ctx=1024)


@pytest.fixture(scope="module")
def server(llm):
    """(base URL, ServerState): the state's engine and metrics are read by some tests."""
    state = ServerState(max_queue=MAX_QUEUE)
    with serving(state, llm, timeout=600) as base:
        yield base, state


def post(base, path, body):
    r = httpx.post(base + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def events(base, path, body) -> list[dict]:
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def reassemble(chunks, chat: bool) -> dict[int, dict]:
    """index -> {"text", "finish_reason", "tokens"} from streamed chunks."""
    got: dict[int, dict] = {}
    for c in chunks:
        for ch in c["choices"]:
            g = got.setdefault(ch["index"], {"text": "", "finish_reason": None, "tokens": []})
            g["text"] += (ch["delta"].get("content") or "") if chat else ch["text"]
            assert g["finish_reason"] is None  # nothing after a choice's finish
            g["finish_reason"] = ch["finish_reason"]
            lp = ch.get("logprobs")
            if lp:
                g["tokens"] += [e["token"] for e in lp["content"]] if chat else lp["tokens"]
    return got


def text_of(choice) -> str:
    return choice["message"]["content"] if "message" in choice else choice["text"]


SAMPLED = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True}


# ---------------------------------------------------------------------- n
@pytest.mark.parametrize("path,body", [(CHAT_PATH, {"messages": CHAT}), (COMPLETIONS, {"prompt": "the heat"})])
def test_n_choice_i_is_the_answer_of_seed_plus_i(server, path, body):
    """The documented seeding rule: choice i of n samples as a request of n=1 with seed + i, to
    the bit (its logprobs too), whole and streamed."""
    base, _ = server
    lp = {"logprobs": True, "top_logprobs": 2} if path == CHAT_PATH else {"logprobs": 2}
    r = post(base, path, {**body, **SAMPLED, **lp, "n": 4, "seed": 7})
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    singles = [post(base, path, {**body, **SAMPLED, **lp, "seed": 7 + i})["choices"][0] for i in range(4)]
    for c, single in zip(r["choices"], singles):
        assert {**c, "index": 0} == single
    assert len({text_of(c) for c in r["choices"]}) > 1  # the choices differ
    streamed = reassemble(events(base, path, {**body, **SAMPLED, **lp, "n": 4, "seed": 7}), path == CHAT_PATH)
    assert sorted(streamed) == [0, 1, 2, 3]
    for i, single in enumerate(singles):
        assert streamed[i]["text"] == text_of(single) and streamed[i]["finish_reason"] == "length"


def test_n_without_a_seed_gives_independent_choices(server):
    base, _ = server
    r = post(base, COMPLETIONS, {"prompt": "the heat", **SAMPLED, "temperature": 1.5, "max_tokens": 12, "n": 6})
    assert len({c["text"] for c in r["choices"]}) == 6


def test_greedy_n_gives_identical_choices(server):
    base, _ = server
    r = post(base, CHAT_PATH, {"messages": CHAT, "max_tokens": 6, "temperature": 0, "n": 3})
    single = post(base, CHAT_PATH, {"messages": CHAT, "max_tokens": 6, "temperature": 0})["choices"][0]
    assert [c["message"] for c in r["choices"]] == [single["message"]] * 3


def test_n_prefills_the_prompt_once_and_counts_usage(server):
    base, state = server
    body = {"prompt": "the heat of the sun on the sea " * 3, **SAMPLED, "seed": 1}
    before = state.metrics.snapshot()
    r = post(base, COMPLETIONS, {**body, "n": 5})
    after = state.metrics.snapshot()
    n_prompt = r["usage"]["prompt_tokens"]
    assert n_prompt == post(base, COMPLETIONS, body)["usage"]["prompt_tokens"]  # the prompt once, not 5 times
    assert after["prefill_tokens"] - before["prefill_tokens"] == n_prompt  # one prefill for the 5 choices
    assert r["usage"]["completion_tokens"] == 5 * 8 == after["generation_tokens"] - before["generation_tokens"]
    assert r["usage"]["total_tokens"] == n_prompt + 40
    chunks = events(base, COMPLETIONS, {**body, "n": 5, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {**r["usage"]}


def test_n_with_stop_strings_and_tools(server):
    base, _ = server
    body = {"prompt": "the heat", "temperature": 1.0, "max_tokens": 30, "ignore_eos": True, "seed": 3, "stop": ["e"]}
    r = post(base, COMPLETIONS, {**body, "n": 3})
    for i, c in enumerate(r["choices"]):
        assert c == {**post(base, COMPLETIONS, {**body, "seed": 3 + i})["choices"][0], "index": i}
        assert "e" not in c["text"]
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    ask = {"messages": [{"role": "user", "content": "weather?"}], "tools": [tool], "tool_choice": "required"}
    body = {**ask, "max_tokens": 120, "temperature": 0.5, "seed": 5, "parallel_tool_calls": False}
    r = post(base, CHAT_PATH, {**body, "n": 3})
    for i, c in enumerate(r["choices"]):  # each choice had its own grammar state
        single = post(base, CHAT_PATH, {**body, "seed": 5 + i})["choices"][0]
        calls = [x["function"] for x in c["message"]["tool_calls"]]  # ids are random
        assert calls == [x["function"] for x in single["message"]["tool_calls"]] and len(calls) == 1
        assert c["finish_reason"] == single["finish_reason"]
        if c["finish_reason"] == "tool_calls":
            assert json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]).keys() == {"city"}
    assert {c["finish_reason"] for c in r["choices"]} == {"tool_calls"}, r
    fmt = {"type": "json_object"}
    r = post(base, CHAT_PATH, {"messages": CHAT, "response_format": fmt, "max_tokens": 40, "seed": 2, "n": 2})
    for c in r["choices"]:
        if c["finish_reason"] == "stop":
            assert isinstance(json.loads(c["message"]["content"]), dict)


def test_n_cancelled_stream_stops_every_choice(server):
    base, state = server
    body = {"prompt": "the heat", "max_tokens": 900, "ignore_eos": True, "n": 4, "stream": True, "temperature": 1}
    before = state.metrics.snapshot()["cancelled"]
    with httpx.stream("POST", base + COMPLETIONS, json=body, timeout=120) as r:
        assert r.status_code == 200
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen |= {c["index"] for c in json.loads(line[6:])["choices"]}
                if len(seen) == 4:
                    break
    assert len(seen) == 4
    deadline = time.time() + 60
    while not state.engine.idle:
        assert time.time() < deadline, "choices still running after the client left"
        time.sleep(0.05)
    assert state.engine.pool.used == state.engine.prefix.nbytes  # only what the prefix cache keeps
    assert state.metrics.snapshot()["cancelled"] - before == 4  # each choice cancelled, none ran to its end


def test_n_limits(server, llm):
    base, _ = server
    for n in (0, 129, True, 1.5):
        r = httpx.post(base + CHAT_PATH, json={"messages": CHAT, "n": n}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", (n, r.text)
    r = httpx.post(base + COMPLETIONS, json={"prompt": "x", "n": MAX_QUEUE + 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text  # could never be queued
    # the queue counts n choices as n requests
    from sparrow.engine.engine import Engine, EngineBusy
    from sparrow.params import SamplingParams

    engine = Engine(llm.handle, max_queue=6)  # not started: submissions stay queued
    ids = llm.tokenizer.encode("the heat")
    engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=2), n=4), lambda *a: None)
    with pytest.raises(EngineBusy):
        engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=2), n=3), lambda *a: None)
    engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=2), n=2), lambda *a: None)


def test_n_beyond_the_kv_budget_and_batch_still_matches(llm):
    """Choices that find no room (a KV budget for ~2 sequences, a batch of 2) wait and are
    prefilled again: the same answers as when they all fit."""
    from sparrow.engine.engine import Engine
    from sparrow.params import SamplingParams

    ids = llm.tokenizer.encode("the heat of the sun " * 4)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True)

    def run(engine, n):
        got, done = {}, threading.Event()

        def emit(kind, out):
            assert kind == "token", out
            got.setdefault(out.index, []).append(out.token_id)
            if out.finish_reason and len([k for k, v in got.items() if len(v) == 40]) == n:
                done.set()

        engine.start(warmup=False)
        try:
            engine.submit(GenerationRequest(ids, params, n=n), emit)
            assert done.wait(120)
        finally:
            engine.stop()
        return got, engine

    from sparrow.server.metrics import Metrics

    roomy, engine = run(Engine(llm.handle, metrics=Metrics()), 5)
    assert engine.metrics.prompt_tokens == len(ids)  # one prefill for the 5 choices
    need = engine.kv.kv_bytes(len(ids) + 40)
    tight, engine = run(Engine(llm.handle, kv_budget=int(2.5 * need), max_batch=2, metrics=Metrics()), 5)
    assert tight == roomy and len({tuple(v) for v in roomy.values()}) == 5
    assert engine.pool.peak <= engine.pool.budget
    assert engine.metrics.prompt_tokens >= 4 * len(ids)  # the choices that waited were prefilled again


# ---------------------------------------------------------------------- batched prompts
def test_batched_prompts_are_numbered_prompt_times_n_plus_i(server, llm):
    base, _ = server
    texts = ["the heat", "a rose is", "sea"]
    ids = [llm.tokenizer.encode(t) for t in texts]
    for prompt in (texts, ids):
        body = {"prompt": prompt, **SAMPLED, "seed": 4, "n": 2, "logprobs": 1}
        r = post(base, COMPLETIONS, body)
        assert [c["index"] for c in r["choices"]] == list(range(6))
        for p in range(3):
            for i in range(2):
                single = post(base, COMPLETIONS, {**body, "prompt": prompt[p], "n": 1, "seed": 4 + i})
                assert r["choices"][p * 2 + i] == {**single["choices"][0], "index": p * 2 + i}
        assert r["usage"]["prompt_tokens"] == sum(len(x) for x in ids)
        assert r["usage"]["completion_tokens"] == 6 * 8
        streamed = reassemble(events(base, COMPLETIONS, body), chat=False)
        assert [streamed[i]["text"] for i in range(6)] == [c["text"] for c in r["choices"]]
    err = httpx.post(base + COMPLETIONS, json={"prompt": ["the heat", ""]}, timeout=60).json()["error"]
    assert err["param"] == "prompt"
    err = httpx.post(base + COMPLETIONS, json={"prompt": [[1, 2], [1, 999]]}, timeout=60).json()["error"]
    assert err["param"] == "prompt"


# ---------------------------------------------------------------------- echo
def test_echo_prepends_the_prompt(server, llm):
    base, _ = server
    body = {"prompt": "the heat", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = post(base, COMPLETIONS, body)["choices"][0]["text"]
    r = post(base, COMPLETIONS, {**body, "echo": True, "n": 2})
    assert [c["text"] for c in r["choices"]] == ["the heat" + plain] * 2
    ids = llm.tokenizer.encode("the heat")
    assert post(base, COMPLETIONS, {**body, "prompt": ids, "echo": True})["choices"][0]["text"] == "the heat" + plain
    streamed = reassemble(events(base, COMPLETIONS, {**body, "echo": True}), chat=False)
    assert streamed[0]["text"] == "the heat" + plain
    zero = post(base, COMPLETIONS, {**body, "echo": True, "max_tokens": 0})["choices"][0]
    assert (zero["text"], zero["finish_reason"]) == ("the heat", "length")


def _reference(llm, ids, top):
    """Each prompt token's logprob from the in-process API (one forward over the whole prompt)."""
    ls = np.stack([log_softmax(row) for row in llm.logits(ids)])  # [P, V]
    return [None] + [float(ls[j, ids[j + 1]]) for j in range(len(ids) - 1)]


def test_echo_logprobs_score_the_prompt(server, llm):
    """The prompt tokens' logprobs: the first null, each other one what the in-process API gives
    (to the bit), then the generated tokens' as without echo (to the bit)."""
    base, _ = server
    ids = llm.tokenizer.encode("the heat of the sun on the sea is great")
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    plain = post(base, COMPLETIONS, body)["choices"][0]
    c = post(base, COMPLETIONS, {**body, "echo": True})["choices"][0]
    lp, n = c["logprobs"], len(ids)
    assert lp["token_logprobs"][:n] == _reference(llm, ids, 3)
    assert lp["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][n:] == plain["logprobs"]["top_logprobs"]
    assert lp["tokens"][:n] == [llm.tokenizer.decode([i]) for i in ids]
    inproc = llm.prompt_logprobs(ids, top=3)
    assert [e[1] for e in inproc] == lp["token_logprobs"][:n]
    for j in range(1, n):  # the best alternatives (3, fewer where two tokens' texts are the same)
        top = lp["top_logprobs"][j]
        assert 1 <= len(top) <= 3 and max(top.values()) >= lp["token_logprobs"][j]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(lp["tokens"]))]
    # max_tokens 0: the loglikelihood of the prompt alone (evaluation harnesses), streamed too
    zero = post(base, COMPLETIONS, {**body, "echo": True, "max_tokens": 0})
    assert zero["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n]
    assert zero["usage"]["completion_tokens"] == 0 and zero["choices"][0]["finish_reason"] == "length"
    full = {**body, "prompt": [5] * 1024, "echo": True, "max_tokens": 0}  # the whole context: no room to run
    r = httpx.post(base + COMPLETIONS, json=full, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    chunks = events(base, COMPLETIONS, {**body, "echo": True})
    first = chunks[0]["choices"][0]
    assert first["text"] == llm.tokenizer.decode(ids)
    assert first["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n]
    streamed = [x for ch in chunks for c in ch["choices"] if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]


def test_echo_logprobs_report_the_stop_token(server, llm):
    """A completion that ends on a stop token still reports that token's entry (its text is
    left out of `text`), as vLLM does: a harness that scores with echo + max_tokens 1 drops the
    last entry as the sampled token (lm-evaluation-harness: token_logprobs[ctxlen:-1])."""
    base, _ = server
    ids = llm.tokenizer.encode("the heat of the sun")
    [eos] = llm.tokenizer.eos_token_ids[:1]
    body = {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "logit_bias": {str(eos): 100}}
    c = post(base, COMPLETIONS, body)["choices"][0]
    assert (c["finish_reason"], c["text"]) == ("stop", llm.tokenizer.decode(ids))
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["tokens"][-1] == llm.tokenizer.decode([eos])
    assert lp["token_logprobs"][:-1] == [e[1] for e in llm.prompt_logprobs(ids)]
    chat = post(base, CHAT_PATH, {"messages": CHAT, "max_tokens": 3, "logprobs": True, "logit_bias": {str(eos): 100}})
    assert chat["choices"][0]["logprobs"]["content"] == []  # chat's entries spell its content: no end of turn


def test_prompt_logprobs_across_prefill_chunks(server, llm):
    """A prompt of two 512-token chunks: the server's logprobs are the in-process API's to the
    bit, and within float tolerance of one forward over the whole prompt; the prefix cache
    (which holds the first chunk after the first request) is not used for them."""
    base, _ = server
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 380, 700).tolist()
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 0}
    first = post(base, COMPLETIONS, body)["choices"][0]["logprobs"]["token_logprobs"][:700]
    again = post(base, COMPLETIONS, body)["choices"][0]["logprobs"]["token_logprobs"][:700]
    assert first == again == [e[1] for e in llm.prompt_logprobs(ids)]
    ref = _reference(llm, ids, 0)
    assert first[0] is None and np.allclose(first[1:], ref[1:], atol=2e-4)


def test_prompt_logprobs_in_process_checks_its_input(llm):
    from sparrow.errors import SparrowError

    for bad, kw in (([], {}), ([999], {}), ([1, 2], {"top": 21}), ([1] * 1025, {})):
        with pytest.raises(SparrowError):
            llm.prompt_logprobs(bad, **kw)
    assert llm.prompt_logprobs("the heat")[0][1] is None
