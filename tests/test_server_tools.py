"""Tools and structured output end to end: the official openai client against `sparrow serve` on the
default model (SmolLM2-135M, which writes hermes tool calls from the tools prompt sparrow adds).

A 135M model follows no schema by itself; every answer below is valid because the grammar masks
its tokens, which is what these tests check (with jsonschema, not by looking at the text).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import test_server as ts
from test_structured import PERSON, SEARCH, WEATHER
from test_tool_parser import reassemble

server, client, model_id, ref = ts.server, ts.client, ts.model_id, ts.ref  # this module's own server process

ASK_PERSON = [{"role": "user", "content": "Invent a person: name, address, favourite colour and a few tags, as JSON."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}


def test_json_schema_validates_for_20_seeds_alone_or_under_load(client, model_id):
    def ask(seed):
        r = client.chat.completions.create(
            model=model_id,
            messages=ASK_PERSON,
            response_format=PERSON_FORMAT,
            max_tokens=150,
            temperature=0.9,
            seed=seed,
        )
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(20) as pool:  # all 20 decode side by side in the engine's batches
        answers = list(pool.map(ask, range(20)))
    for content, finish in answers:
        assert finish == "stop", content
        jsonschema.validate(json.loads(content), PERSON)
    assert len({c for c, _ in answers}) > 10  # seeds matter: the mask does not force one answer
    for seed in (0, 7):  # masked sampling is batch-invariant: the same answer alone
        assert ask(seed) == answers[seed]


def test_tool_choice_required_returns_valid_calls(client, model_id):
    named = {"type": "function", "function": {"name": "search"}}
    for choice, names in [("required", {"get_weather", "search"}), (named, {"search"})]:
        for seed in (1, 2):
            r = client.chat.completions.create(
                model=model_id,
                messages=ASK_WEATHER,
                tools=[WEATHER, SEARCH],
                tool_choice=choice,
                parallel_tool_calls=False,
                max_tokens=80,
                temperature=0.7,
                seed=seed,
            )
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.content is None
            (call,) = c.message.tool_calls
            assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_streamed_tool_call_reassembles_to_the_same_call(client, model_id):
    kw = dict(
        model=model_id,
        messages=ASK_WEATHER,
        tools=[WEATHER, SEARCH],
        tool_choice="required",
        max_tokens=120,
        temperature=0.7,
        seed=5,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [d.model_dump(exclude_none=True) for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    for d in deltas:
        d.setdefault("function", {}).setdefault("arguments", "")
    streamed = reassemble(deltas)  # also checks the shape: id, type and name first, then argument fragments
    assert [(s["name"], s["arguments"]) for s in streamed] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls
    ]
    assert len(deltas) > 2 * len(streamed)  # the arguments came in several fragments
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert all(not (c.choices[0].delta.content or "") for c in chunks)


def test_output_cut_by_max_tokens_finishes_with_length(client, model_id):
    r = client.chat.completions.create(
        model=model_id, messages=ASK_PERSON, response_format=PERSON_FORMAT, max_tokens=6, seed=0
    )
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.content.startswith('{"name": ')
    with pytest.raises(ValueError):
        json.loads(c.message.content)


def test_conversation_with_tool_results(client, model_id):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    for choice in ("auto", "none"):
        r = client.chat.completions.create(
            model=model_id, messages=messages, tools=[WEATHER], tool_choice=choice, max_tokens=12, temperature=0
        )
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = client.chat.completions.create(
        model=model_id, messages=messages, response_format={"type": "json_object"}, max_tokens=40, temperature=0
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"uniqueItems": True}}}},
         "response_format.json_schema.schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "properties": {"a": {"type": 7}}}}}]}, "tools[0].function.parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_structured_input_is_a_400_with_param(server, extra, param):
    r = ts._post(server, "/v1/chat/completions", {"messages": ASK_WEATHER, "max_tokens": 2, **extra})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["param"], err["type"]) == (param, "invalid_request_error")
    assert ts._log_problem(server) is None


def test_server_answers_equal_the_python_api(server, client, model_id, ref):
    """The HTTP layer changes nothing: the same seed gives the same JSON and the same call as
    `LLM.chat` in this process, and /tokenize counts the prompt with its tools."""
    kw = dict(max_tokens=100, temperature=0.8, top_p=1.0, seed=3)
    r = client.chat.completions.create(model=model_id, messages=ASK_PERSON, response_format=PERSON_FORMAT, **kw)
    want = ref.chat(ASK_PERSON, response_format=PERSON_FORMAT, **kw)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want["content"], want["finish_reason"])

    kw.update(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    r = client.chat.completions.create(model=model_id, messages=ASK_WEATHER, **kw)
    want = ref.chat(ASK_WEATHER, **kw)
    got = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
    assert got == [(t["function"]["name"], t["function"]["arguments"]) for t in want["tool_calls"]]
    assert r.choices[0].finish_reason == want["finish_reason"] == "tool_calls"
    n = ts._post(server, "/tokenize", {"messages": ASK_WEATHER, "tools": [WEATHER]}).json()["count"]
    assert n == r.usage.prompt_tokens == len(ref.prompt_ids(ASK_WEATHER, chat=True, tools=[WEATHER]))
