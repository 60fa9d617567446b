"""OpenAI's Responses API (issue 69, item 1) driven by the official openai SDK's
`client.responses.create` against an in-process server on the tiny GGUF: the answer at
temperature 0 equals the chat endpoint's for the same conversation, whole and streamed (the SDK's
typed events and its stream helper's snapshot), instructions, input items, function tools and
their outputs, text.format, store / previous_response_id, and 400s naming what is refused."""

from __future__ import annotations

import json

import httpx
import pytest
from test_fuzz_files import tiny_gguf  # noqa: F401 - the fixture, shared
from test_openapi import error, post, served  # noqa: F401 - served: the fixture, shared

from sparrow.server.responses_api import input_messages

openai = pytest.importorskip("openai")

CTX = 1024
SYSTEM = "Be brief."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
PICK = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(served):  # noqa: F811
    return openai.OpenAI(base_url=served + "/v1", api_key="none", max_retries=0, timeout=120)


def _chat(base, messages, **kw):
    r = post(base, "/v1/chat/completions", {"messages": messages, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_response_equals_the_chat_answer(client, served):  # noqa: F811
    r = client.responses.create(model="tiny", input="the heat", instructions=SYSTEM, max_output_tokens=8,
                                temperature=0)  # fmt: skip
    want = _chat(served, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "the heat"}], max_tokens=8)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny.gguf"
    assert r.output_text == want["choices"][0]["message"]["content"]
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == want["usage"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    length = want["choices"][0]["finish_reason"] == "length"
    assert r.status == ("incomplete" if length else "completed")
    if length:
        assert r.incomplete_details.reason == "max_output_tokens"


def test_stream_events(client):
    kw = {"model": "tiny", "input": "the heat", "instructions": SYSTEM, "max_output_tokens": 8, "temperature": 0}
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    if kinds[-1] == "response.incomplete":  # cut by max_output_tokens, as OpenAI reports it
        assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_stream_helper_rebuilds_the_response(client):
    """The SDK's stream helper (which needs response.completed: an answer that ends by itself, here
    as its JSON schema closes) rebuilds the same response from the events."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    kw = {"model": "tiny", "input": "a number as JSON", "max_output_tokens": 60, "temperature": 0,
          "text": {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}}}  # fmt: skip
    whole = client.responses.create(**kw)
    assert whole.status == "completed"
    with client.responses.stream(**kw) as s:
        deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert final.output_text == whole.output_text == deltas
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == "completed"


def test_input_items_equal_chat_messages(client, served):  # noqa: F811
    items = [
        {"role": "developer", "content": SYSTEM},
        {"role": "user", "content": [{"type": "input_text", "text": "the heat"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "is on"}]},
        {"type": "message", "role": "user", "content": "and then?"},
    ]
    r = client.responses.create(model="tiny", input=items, max_output_tokens=6, temperature=0)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "the heat"},
            {"role": "assistant", "content": "is on"}, {"role": "user", "content": "and then?"}]  # fmt: skip
    assert r.output_text == _chat(served, msgs, max_tokens=6)["choices"][0]["message"]["content"]


def test_function_call_and_its_output(client, served):  # noqa: F811
    ask = "the weather in Paris?"
    r = client.responses.create(model="tiny", input=ask, tools=[WEATHER], tool_choice=PICK, max_output_tokens=120,
                                temperature=0)  # fmt: skip
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and set(json.loads(calls[0].arguments)) == {"city"}
    chat_tool = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    want = _chat(served, [{"role": "user", "content": ask}], max_tokens=120, tools=[chat_tool],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    got = want["choices"][0]["message"]["tool_calls"][0]["function"]
    assert (got["name"], got["arguments"]) == (calls[0].name, calls[0].arguments)
    events = list(client.responses.create(model="tiny", input=ask, tools=[WEATHER], tool_choice=PICK,
                                          max_output_tokens=120, temperature=0, stream=True))  # fmt: skip
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == calls[0].arguments == done[0].arguments and done[0].name == "get_weather"
    # the call and its output go back as input items
    follow = [{"role": "user", "content": ask}, calls[0].model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}]  # fmt: skip
    again = client.responses.create(model="tiny", input=follow, tools=[WEATHER], max_output_tokens=4, temperature=0)
    assert again.status in ("completed", "incomplete")
    assert again.usage.input_tokens > r.usage.input_tokens


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    r = client.responses.create(
        model="tiny", input="a number as JSON", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert set(json.loads(r.output_text)) == {"a"}


def test_store_and_previous_response_id(client, served):  # noqa: F811
    first = client.responses.create(model="tiny", input="the heat", instructions=SYSTEM, max_output_tokens=4,
                                    temperature=0)  # fmt: skip
    second = client.responses.create(model="tiny", input="and then?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)  # fmt: skip
    msgs = [{"role": "user", "content": "the heat"}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "and then?"}]  # instructions are not carried over  # fmt: skip
    want = _chat(served, msgs, max_tokens=4)
    assert second.output_text == want["choices"][0]["message"]["content"]
    assert second.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id=first.id, max_output_tokens=2)
    unstored = client.responses.create(model="tiny", input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input"),
        ({"input": 3}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "conversation": "c"}, "conversation"),
        ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": "x", "model": "gpt-5"}, "model"),
        ({"input": "x" * 50_000}, "input"),
    ],
)
def test_refused_and_bad_fields_name_themselves(served, body, param):  # noqa: F811
    r = post(served, "/v1/responses", body)
    assert r.status_code in (400, 404), r.text
    err = error(r, r.status_code)
    assert err["param"] == param, err


def test_sdk_errors_are_typed(client):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="x", max_output_tokens=4, include=["reasoning.encrypted_content"])
    r = httpx.post(client.base_url.join("responses").__str__(), content=b"{oops", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_input_items_conversion():
    items = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
    ]  # fmt: skip
    assert input_messages(items) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]  # fmt: skip


def test_store_is_bounded_in_count_and_bytes():
    from sparrow.server.responses_api import Store

    store = Store(size=3, max_bytes=1000)
    msgs = [{"role": "user", "content": "x" * 300}]
    for i in range(4):
        store.put("k", f"r{i}", msgs, {"id": f"r{i}"})
    assert store.get("k", "r1") is None and store.get("k", "r2") is not None  # bytes: three would pass 1000
    assert store.get("other key", "r2") is None  # per API key
    store.put("k", "big", [{"role": "user", "content": "x" * 2000}], {})
    assert store.get("k", "big") is None  # larger than the whole store: not kept
    assert store.delete("k", "r3") and not store.delete("k", "r3")
    assert store.bytes == sum(item[2] for item in store.items.values())
    assert len(store.items) <= 3
