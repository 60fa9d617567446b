"""Anthropic's Messages API (issue 69, item 2) driven by the official anthropic SDK against an
in-process server on the tiny GGUF: whole and streamed answers equal the chat endpoint's at
temperature 0 for the same conversation, system prompts in every form Claude Code sends,
tools (tool_use out, tool_result back), stop_sequences, count_tokens, x-api-key, and errors
in Anthropic's shape (never a 5xx for a bad body)."""

from __future__ import annotations

import json

import httpx
import pytest
from test_fuzz_files import tiny_gguf  # noqa: F401 - the fixture, shared
from test_openapi import post, served  # noqa: F401 - served: the fixture, shared

from sparrow.server.anthropic_api import chat_body

anthropic = pytest.importorskip("anthropic")

CTX = 1024
T0 = {"temperature": 0}  # the SDK sends sampling fields through extra_body
SYSTEM = "Be brief."
USER = [{"role": "user", "content": "the heat"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}

PICK = {"type": "tool", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(served):  # noqa: F811
    return anthropic.Anthropic(base_url=served, api_key="none", max_retries=0, timeout=120)


def _chat(base, messages, **kw):
    body = {"messages": messages, "temperature": 0, **kw}
    r = post(base, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_message_equals_the_chat_answer(client, served):  # noqa: F811
    m = client.messages.create(model="tiny", max_tokens=8, system=SYSTEM, messages=USER, extra_body=T0)
    want = _chat(served, [{"role": "system", "content": SYSTEM}, *USER], max_tokens=8)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert _text(m) == want["choices"][0]["message"]["content"]
    finish = want["choices"][0]["finish_reason"]
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish] and m.stop_sequence is None
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == want["usage"]["prompt_tokens"]
    assert m.usage.output_tokens == want["usage"]["completion_tokens"]


def test_stream_events_and_text_equal_the_whole_answer(client, served):  # noqa: F811
    whole = client.messages.create(model="tiny", max_tokens=8, system=SYSTEM, messages=USER, extra_body=T0)
    with client.messages.stream(model="tiny", max_tokens=8, system=SYSTEM, messages=USER, extra_body=T0) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == _text(whole) == _text(final)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    body = {"model": "tiny", "max_tokens": 8, "system": SYSTEM, "messages": USER, "temperature": 0, "stream": True}
    with httpx.stream("POST", served + "/v1/messages", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    kinds = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == kinds
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    assert data[0]["message"]["usage"]["input_tokens"] > 0 and data[-2]["usage"]["output_tokens"] > 0


def test_system_in_every_form_gives_the_same_prompt(client):
    blocks = [{"type": "text", "text": SYSTEM}]
    counts = {
        client.messages.count_tokens(model="tiny", system=SYSTEM, messages=USER).input_tokens,
        client.messages.count_tokens(model="tiny", system=blocks, messages=USER).input_tokens,
        client.messages.count_tokens(
            model="tiny", messages=[{"role": "system", "content": SYSTEM}, *USER]
        ).input_tokens,
        client.messages.count_tokens(
            model="tiny", messages=[{"role": "system", "content": blocks}, *USER]
        ).input_tokens,
    }
    assert len(counts) == 1
    m = client.messages.create(
        model="tiny", max_tokens=2, messages=[{"role": "system", "content": SYSTEM}, *USER], extra_body=T0
    )
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == counts.pop()


def test_count_tokens_equals_tokenize(client, served):  # noqa: F811
    n = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=USER).input_tokens
    t = post(served, "/tokenize", {"messages": [{"role": "system", "content": SYSTEM}, *USER]}).json()
    assert n == t["count"]


def test_tool_use_and_tool_result(client, served):  # noqa: F811
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    m = client.messages.create(
        model="tiny", max_tokens=120, messages=ask, tools=[WEATHER], tool_choice=PICK, extra_body=T0
    )
    assert m.stop_reason == "tool_use", m
    calls = [b for b in m.content if b.type == "tool_use"]
    assert calls and calls[0].name == "get_weather" and isinstance(calls[0].input["city"], str)
    assert calls[0].id
    with client.messages.stream(
        model="tiny", max_tokens=120, messages=ask, tools=[WEATHER], tool_choice=PICK, extra_body=T0
    ) as s:
        streamed = s.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(c.name, c.input) for c in calls]
    chat_tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                    "parameters": WEATHER["input_schema"]}}]  # fmt: skip
    want = _chat(
        served,
        ask,
        max_tokens=120,
        tools=chat_tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    got = want["choices"][0]["message"]["tool_calls"][0]["function"]
    assert (got["name"], json.loads(got["arguments"])) == (calls[0].name, calls[0].input)
    # the result goes back as a tool_result block
    follow = ask + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21 C"}]},
    ]
    r = client.messages.create(model="tiny", max_tokens=4, messages=follow, tools=[WEATHER], extra_body=T0)
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use")
    before = client.messages.count_tokens(model="tiny", messages=ask, tools=[WEATHER]).input_tokens
    after = client.messages.count_tokens(model="tiny", messages=follow, tools=[WEATHER]).input_tokens
    assert after > before


def test_stop_sequences(client):
    whole = _text(client.messages.create(model="tiny", max_tokens=12, messages=USER, extra_body=T0))
    at = next(i for i in range(1, len(whole) - 2) if whole.find(whole[i : i + 2]) == i and whole[i : i + 2].strip())
    stop = whole[at : at + 2]
    m = client.messages.create(model="tiny", max_tokens=12, messages=USER, extra_body=T0, stop_sequences=[stop, "zzzq"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert _text(m) == whole[:at]


def test_sampling_fields_through_extra_body(client):
    m = client.messages.create(
        model="tiny", max_tokens=4, messages=USER, extra_body={"temperature": 0.8, "top_k": 5, "seed": 3}
    )
    again = client.messages.create(
        model="tiny", max_tokens=4, messages=USER, extra_body={"temperature": 0.8, "top_k": 5, "seed": 3}
    )
    assert _text(m) == _text(again)


@pytest.mark.parametrize(
    "body, match",
    [
        ({"messages": USER}, "max_tokens"),
        ({"max_tokens": 0, "messages": USER}, "max_tokens"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        ({"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document"}]}]}, "document"),
        ({"max_tokens": 4, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "w"}]}, "server tool"),
        ({"max_tokens": 4, "messages": USER, "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"max_tokens": 4, "messages": USER, "temperature": "hot"}, "temperature"),
        ({"max_tokens": 4, "messages": USER, "stop_sequences": "x"}, "stop"),
        ({"max_tokens": 4, "messages": USER, "mcp_servers": [{}]}, "MCP"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x" * 5000}] * 3}, "context length"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_bodies_are_anthropic_400s(served, body, match):  # noqa: F811
    r = post(served, "/v1/messages", body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert match in err["error"]["message"], err


def test_errors_reach_the_sdk_typed(client, served):  # noqa: F811
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(served + "/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="tiny", messages=[])


def test_x_api_key(tiny_gguf, tmp_path):  # noqa: F811
    from inprocess_server import serving

    import sparrow
    from sparrow.server.app import ServerState

    path = tmp_path / "tiny.gguf"
    path.write_bytes(tiny_gguf)
    with serving(ServerState(api_key="k3y"), sparrow.load(str(path), ctx=CTX), timeout=120) as base:
        ok = anthropic.Anthropic(base_url=base, api_key="k3y", max_retries=0, timeout=120)
        assert ok.messages.count_tokens(model="tiny", messages=USER).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
                model="tiny", max_tokens=2, messages=USER
            )
        assert e.value.body["error"]["type"] == "authentication_error"
        bearer = httpx.post(base + "/v1/messages/count_tokens", json={"messages": USER},
                            headers={"Authorization": "Bearer k3y"})  # fmt: skip
        assert bearer.status_code == 200
        assert httpx.get(base + "/v1/models", headers={"x-api-key": "k3y"}).status_code == 200


def test_conversion_of_blocks():
    body = {
        "max_tokens": 5,
        "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        "messages": [
            {"role": "system", "content": "C"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                ],
            },  # fmt: skip
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
                ],
            },  # fmt: skip
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "42"}]},
                    {"type": "text", "text": "and?"},
                ],
            },  # fmt: skip
        ],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "stop_sequences": ["END"],
        "top_k": 3,
    }
    chat = chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "A\nB\n\nC"},
        {"role": "user", "content": [{"type": "text", "text": "hi"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hmm",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "42"},
        {"role": "user", "content": "and?"},
    ]  # fmt: skip
    assert chat["chat_template_kwargs"] == {"enable_thinking": True} and chat["parallel_tool_calls"] is False
    assert chat["tool_choice"] == "auto" and chat["stop"] == ["END"] and chat["top_k"] == 3
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_a_full_queue_is_an_overloaded_error(served, monkeypatch):  # noqa: F811
    """The engine's queue full: 529 overloaded_error with Retry-After (the SDK retries it)."""
    from sparrow.server import chat_runs

    def full(self):
        raise chat_runs.Busy("the queue is full", "3")

    monkeypatch.setattr(chat_runs.ChatRun, "start", lambda self: _raise_async(full, self))
    r = post(served, "/v1/messages", {"max_tokens": 2, "messages": USER})
    assert r.status_code == 529 and r.headers["retry-after"] == "3"
    assert r.json()["error"] == {"type": "overloaded_error", "message": "the queue is full"}
    r = post(served, "/v1/responses", {"input": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "3" and r.json()["error"]["code"] == "server_busy"


def test_busy_is_read_from_the_engines_503():
    """ChatRun reads app.py's queue-full answer (its 503 JSONResponse) back as Busy."""
    import asyncio
    from types import SimpleNamespace

    from fastapi.responses import JSONResponse

    from sparrow.server.chat_runs import Busy, ChatRun
    from sparrow.server.protocol import error_body

    async def prepare(body, chat):
        return None, [[1]], [None], None, None, []

    busy = JSONResponse(error_body("full", "server_error", code="server_busy"), 503, headers={"Retry-After": "7"})
    core = SimpleNamespace(state=SimpleNamespace(llm=None), prepare=prepare, submit=lambda *a: (busy, None))
    with pytest.raises(Busy) as e:
        asyncio.run(ChatRun(core, None).start())
    assert str(e.value) == "full" and e.value.retry_after == "7"


async def _raise_async(fn, *args):
    fn(*args)
