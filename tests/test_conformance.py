"""What OpenAI's published API promises and clients rely on (issue 38, conformance): required
response fields, the fields sparrow applies or refuses, completions' defaults, `models.retrieve`,
`logit_bias`, tool calls and schemas that admit no answer.

The server runs in this process on the tiny GGUF of test_fuzz_files (test_openapi's fixture): a
1024-token context and a 384-token vocabulary, so any request finishes in well under a second.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
from test_fuzz_files import tiny_gguf  # noqa: F401 - the fixture, shared
from test_openapi import CHAT, error, post, served  # noqa: F401 - served: the fixture, shared

CHAT_PATH, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CTX = 1024  # the served model's context (test_openapi's fixture reads it): room for a tools prompt


def events(base: str, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed answer, [DONE] checked and dropped."""
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.fixture(scope="module")
def client(served):  # noqa: F811
    return openai.OpenAI(base_url=served + "/v1", api_key="none", timeout=120, max_retries=0)


# ---------------------------------------------------------------------- refusal
def test_chat_answers_carry_refusal(served):  # noqa: F811
    """OpenAI's schema requires message.refusal and logprobs.refusal (string or null)."""
    body = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "logprobs": True}
    choice = post(served, CHAT_PATH, body).json()["choices"][0]
    assert "refusal" in choice["message"] and choice["message"]["refusal"] is None
    assert choice["logprobs"]["refusal"] is None and choice["logprobs"]["content"]
    lps = [c["choices"][0]["logprobs"] for c in events(served, CHAT_PATH, body) if c["choices"]]
    lps = [lp for lp in lps if lp is not None]
    assert lps and all(lp["refusal"] is None and "content" in lp for lp in lps)


# ---------------------------------------------------------------------- models.retrieve
def test_models_retrieve(served, client):  # noqa: F811
    listed = client.models.list().data[0]
    got = client.models.retrieve(listed.id)
    assert (got.id, got.object, got.owned_by, got.created) == (listed.id, "model", "sparrow", listed.created)
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    err = error(httpx.get(served + "/v1/models/org/no-such-model"), 404)
    assert err["param"] == "model" and "org/no-such-model" in err["message"]
    metrics = httpx.get(served + "/metrics").text  # one label for the route, never a client's model id
    assert 'endpoint="/v1/models/{model}"' in metrics and "no-such-model" not in metrics


# ---------------------------------------------------------------------- completions' limits
def test_completions_default_max_tokens_is_16(served):  # noqa: F811
    r = post(served, COMPLETIONS, {"prompt": "the heat", "ignore_eos": True, "temperature": 0}).json()
    assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (16, "length")
    # chat keeps its own default (up to 2048 tokens, capped by the context)
    r = post(served, CHAT_PATH, {"messages": CHAT, "ignore_eos": True, "temperature": 0}).json()
    assert r["usage"]["completion_tokens"] > 16


def test_completions_max_tokens_0_is_an_empty_answer(served):  # noqa: F811
    body = {"prompt": "the heat", "max_tokens": 0, "logprobs": 1}
    r = post(served, COMPLETIONS, body).json()
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("", "length")
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] > 0
    assert r["choices"][0]["logprobs"]["tokens"] == []
    chunks = events(served, COMPLETIONS, {**body, "stream_options": {"include_usage": True}})
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    # the prompt is still checked, and chat keeps its minimum of 1
    assert error(post(served, COMPLETIONS, {"prompt": "x" * 1500, "max_tokens": 0}))["param"] == "prompt"
    assert error(post(served, CHAT_PATH, {"messages": CHAT, "max_tokens": 0}))["param"] == "max_tokens"


@pytest.mark.parametrize("path,body", [(CHAT_PATH, {"messages": CHAT}), (COMPLETIONS, {"prompt": "the heat"})])
def test_top_p_0_is_greedy(served, path, body):  # noqa: F811
    def text(**kw):
        r = post(served, path, {**body, "max_tokens": 12, "ignore_eos": True, **kw})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["message"]["content"] if "message" in c else c["text"]

    greedy = text(temperature=0)
    assert all(text(temperature=1.5, top_p=0, seed=s) == greedy for s in (1, 2, 3))
    assert any(text(temperature=1.5, seed=s) != greedy for s in (1, 2, 3))  # the sampling was real


# ---------------------------------------------------------------------- logit_bias
def _ids(base: str, text: str) -> list[int]:
    return post(base, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]


def _completion(base: str, **kw) -> dict:
    r = post(base, COMPLETIONS, {"prompt": "the heat", "max_tokens": 8, "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_logit_bias_bans_and_forces_tokens(served):  # noqa: F811
    greedy = _completion(served, temperature=0, logprobs=0)
    # a token of the greedy answer that is whole text (some are single bytes of a UTF-8 character)
    token = next(t for t in greedy["logprobs"]["tokens"] if "\ufffd" not in t and len(_ids(served, t)) == 1)
    [token_id] = _ids(served, token)
    banned = _completion(served, temperature=0, logprobs=0, logit_bias={str(token_id): -100})
    assert token not in banned["logprobs"]["tokens"] and banned["text"] != greedy["text"]
    # sampled or greedy, chat or completions: +100 makes one token all but certain
    [e_id] = _ids(served, "e")
    assert _completion(served, temperature=1.0, seed=5, logit_bias={str(e_id): 100})["text"] == "e" * 8
    r = post(served, CHAT_PATH, {"messages": CHAT, "max_tokens": 4, "ignore_eos": True, "logit_bias": {e_id: 100}})
    assert r.json()["choices"][0]["message"]["content"] == "e" * 4
    # a bias of 0 changes nothing
    assert _completion(served, temperature=0, logit_bias={str(token_id): 0})["text"] == greedy["text"]


def test_logit_bias_is_deterministic_alone_and_batched(served):  # noqa: F811
    from concurrent.futures import ThreadPoolExecutor

    [e_id], [t_id] = _ids(served, "e"), _ids(served, "t")
    kw = {"temperature": 1.0, "seed": 11, "logprobs": 1, "logit_bias": {str(e_id): 3.5, str(t_id): -2.25}}
    alone = [_completion(served, **kw) for _ in range(2)]
    with ThreadPoolExecutor(4) as pool:  # the engine batches their decode steps
        batched = list(pool.map(lambda s: _completion(served, **{**kw, "seed": s}), [11, 12, 11, 13]))
    assert alone[0] == alone[1] == batched[0] == batched[2]  # text and logprobs, to the bit
    assert _completion(served, **{**kw, "logit_bias": {}})["text"] != alone[0]["text"]  # the bias did something


@pytest.mark.parametrize(
    "bias",
    [{"abc": 1}, {"-1": 1}, {"1.5": 1}, {"384": 1}, {"99999999999": 1}, {"5": 101}, {"5": -100.5}, {"5": "x"},
     {"5": None}, [5]],
)  # fmt: skip
def test_logit_bias_is_checked(served, bias):  # noqa: F811
    for path, body in ((CHAT_PATH, {"messages": CHAT}), (COMPLETIONS, {"prompt": "x"})):
        assert error(post(served, path, {**body, "max_tokens": 1, "logit_bias": bias}))["param"] == "logit_bias"


def test_logit_bias_in_the_python_api(tiny_gguf, tmp_path):  # noqa: F811
    import sparrow
    from sparrow.engine.sampling import Sampler
    from sparrow.errors import SparrowError
    from sparrow.params import SamplingParams

    path = tmp_path / "tiny.gguf"
    path.write_bytes(tiny_gguf)
    llm = sparrow.load(str(path))
    kw = dict(max_tokens=6, ignore_eos=True)
    greedy = [o.token_id for o in llm.stream("the heat", **kw)]
    banned = [o.token_id for o in llm.stream("the heat", logit_bias={greedy[0]: -100}, **kw)]
    assert banned[0] != greedy[0]
    as_json = SamplingParams(logit_bias={str(greedy[0]): -100}, **kw)
    same = [o.token_id for o in llm.stream("the heat", sampling=as_json)]
    assert same == banned  # "42" keys, as JSON gives them, are token 42
    for bad in ({-1: 1}, {"x": 1}, {1: 100.5}, {1: float("nan")}, {384: 1}):
        with pytest.raises(SparrowError, match="logit_bias"):
            list(llm.stream("the heat", logit_bias=bad, **kw))
    logits = np.zeros(384, np.float32)
    logits[7] = 50.0
    assert Sampler(SamplingParams(logit_bias={7: -100, 9: 0.5}), 384)(logits) == 9


# ---------------------------------------------------------------------- fields sparrow does not apply
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "path,field,value",
    [
        (CHAT_PATH, "functions", [TOOL["function"]]),
        (CHAT_PATH, "function_call", "auto"),
        (CHAT_PATH, "function_call", {"name": "get_weather"}),
        (CHAT_PATH, "audio", {"voice": "alloy", "format": "wav"}),
        (CHAT_PATH, "modalities", ["text", "audio"]),
        (CHAT_PATH, "reasoning_effort", "low"),
        (CHAT_PATH, "verbosity", "low"),
        (CHAT_PATH, "web_search_options", {}),
        (CHAT_PATH, "store", True),
        (COMPLETIONS, "best_of", 2),
        (COMPLETIONS, "best_of", True),
        (COMPLETIONS, "suffix", " the end"),
    ],
)
def test_fields_not_applied_are_refused(served, path, field, value):  # noqa: F811
    body = {"messages": CHAT} if path == CHAT_PATH else {"prompt": "the heat"}
    err = error(post(served, path, {**body, "max_tokens": 1, field: value}))
    assert (err["param"], err["type"]) == (field, "invalid_request_error")


@pytest.mark.parametrize(
    "path,extra",
    [
        (CHAT_PATH, {"functions": None, "function_call": None, "modalities": ["text"], "store": False,
                     "metadata": {"k": "v"}, "service_tier": "auto", "user": "u", "safety_identifier": "s",
                     "prompt_cache_key": "k", "prediction": {"type": "content", "content": "x"}}),
        (COMPLETIONS, {"best_of": 1, "suffix": None, "echo": False, "user": "u"}),
        (COMPLETIONS, {"suffix": ""}),
    ],
)  # fmt: skip
def test_values_that_ask_for_nothing_are_accepted(served, path, extra):  # noqa: F811
    body = {"messages": CHAT} if path == CHAT_PATH else {"prompt": "the heat"}
    r = post(served, path, {**body, "max_tokens": 2, "temperature": 0, **extra})
    assert r.status_code == 200, r.text


def test_refused_and_ignored_fields_are_documented(served):  # noqa: F811
    """/openapi.json names every field of OpenAI's requests, refused ones as such; docs/serving.md lists them."""
    from pathlib import Path

    from sparrow.server.protocol import REFUSED_CHAT, REFUSED_COMPLETION

    models = httpx.get(served + "/openapi.json").json()["components"]["schemas"]
    docs = (Path(__file__).parent.parent / "docs" / "serving.md").read_text()
    for model, refused in (("ChatCompletionRequest", REFUSED_CHAT), ("CompletionRequest", REFUSED_COMPLETION)):
        props = models[model]["properties"]
        for name in refused:
            assert props[name]["description"].startswith("not supported"), name
            assert f"`{name}`" in docs, name
        for name, p in props.items():
            if p.get("description", "").startswith("accepted, no effect"):
                assert f"`{name}`" in docs, name


# ---------------------------------------------------------------------- tools and schemas
WEATHER = {
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
ASK = [{"role": "user", "content": "the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _call(base: str, **kw) -> dict:
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": NAMED, "max_tokens": 120, "temperature": 0, **kw}
    r = post(base, CHAT_PATH, body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_named_tool_choice_gives_one_call(served):  # noqa: F811
    """The grammar lets a second call follow only when parallel_tool_calls asks for it: a bias
    towards the newline that would start one shows the difference."""
    [newline] = _ids(served, "\n")
    more = {"logit_bias": {str(newline): 30}}
    one = _call(served, **more)
    assert one["finish_reason"] == "tool_calls" and len(one["message"]["tool_calls"]) == 1
    assert json.loads(one["message"]["tool_calls"][0]["function"]["arguments"]).keys() == {"city"}
    several = _call(served, parallel_tool_calls=True, **more)["message"]["tool_calls"]
    assert several and len(several) > 1  # the bias does open a second call where one is allowed
    assert len(_call(served, parallel_tool_calls=False, **more)["message"]["tool_calls"]) == 1


def test_tool_call_cut_by_max_tokens_reports_its_arguments_only(served):  # noqa: F811
    whole = _call(served)
    args = whole["message"]["tool_calls"][0]["function"]["arguments"]
    n = post(served, CHAT_PATH, {"messages": ASK, "tools": [WEATHER], "tool_choice": NAMED, "max_tokens": 120,
                                 "temperature": 0}).json()["usage"]["completion_tokens"]  # fmt: skip
    for cut in range(n - 8, n):  # inside the closing `}\n</tool_call>`, after the arguments ended
        c = _call(served, max_tokens=cut)
        got = c["message"]["tool_calls"][0]["function"]["arguments"]
        assert c["finish_reason"] == "length" and got == args, (cut, got)
        streamed = [
            d["function"].get("arguments", "")
            for e in events(served, CHAT_PATH, {"messages": ASK, "tools": [WEATHER], "tool_choice": NAMED,
                                                "max_tokens": cut, "temperature": 0})
            for ch in e["choices"]
            for d in ch["delta"].get("tool_calls", [])
        ]  # fmt: skip
        assert "".join(streamed) == args, cut


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
        {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
        {"$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/b"}, "minItems": 1},
                   "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
         "$ref": "#/$defs/a"},
    ],
)  # fmt: skip
def test_schema_with_no_finite_value_is_refused(served, schema):  # noqa: F811
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    err = error(post(served, CHAT_PATH, {"messages": CHAT, "max_tokens": 4, "response_format": fmt}))
    assert err["param"] == "response_format.json_schema.schema" and "no finite value" in err["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": schema}, "required": ["x"], **({"$defs": schema["$defs"]} if "$defs" in schema else {})}}}  # fmt: skip
    if schema.get("$ref") != "#":  # a reference to the parameters' root is refused anyway (README)
        err = error(post(served, CHAT_PATH, {"messages": CHAT, "max_tokens": 4, "tools": [tool]}))
        assert err["param"] == "tools[0].function.parameters", err


def test_recursive_schema_that_can_end_still_works(served):  # noqa: F811
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
            "required": ["kids"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "tree", "schema": tree}}
    r = post(served, CHAT_PATH, {"messages": CHAT, "max_tokens": 200, "temperature": 0, "response_format": fmt})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    if c["finish_reason"] == "stop":
        assert "kids" in json.loads(c["message"]["content"])
    else:
        assert c["message"]["content"].startswith('{"kids": [')


# ---------------------------------------------------------------------- OpenAI's response schemas
SPEC = json.loads((__import__("pathlib").Path(__file__).parent / "data" / "openai_responses_2.3.0.json").read_text())


def check(obj, name: str) -> None:
    """Raises jsonschema's ValidationError (with the path of the first problem) unless obj is a `name`."""
    import jsonschema

    jsonschema.Draft202012Validator({"$ref": f"#/$defs/{name}", "$defs": SPEC["$defs"]}).validate(obj)


def test_the_schema_data_rejects_what_it_should():
    """The hand-written schemas are not vacuous: each misses what the spec requires."""
    import jsonschema

    for obj, name in [
        ({"role": "assistant", "content": "hi"}, "ChatCompletionResponseMessage"),  # no refusal (issue 38)
        ({"content": []}, "ChatChoiceLogprobs"),
        ({"error": {"message": "m", "type": "t", "param": None}}, "ErrorResponse"),
        ({"id": "m", "object": "model", "created": 1}, "Model"),
        ({"id": "x", "object": "text_completion", "created": 1, "model": "m",
          "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}]}, "CreateCompletionResponse"),
        ({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
          "choices": [{"index": 0, "delta": {"tool_calls": [{"id": "c"}]}, "finish_reason": None}]},
         "CreateChatCompletionStreamResponse"),
    ]:  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            check(obj, name)


CHAT_MODES = {
    "plain": {"messages": CHAT, "max_tokens": 4},
    "logprobs": {"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 2},
    "length": {"messages": CHAT, "max_tokens": 3, "ignore_eos": True, "logit_bias": {"101": 5}},
    "tool call": {
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 120,
    },
    "tool call cut": {"messages": ASK, "tools": [WEATHER], "tool_choice": NAMED, "max_tokens": 50},
    "json": {"messages": CHAT, "response_format": {"type": "json_object"}, "max_tokens": 20},
    "n": {"messages": CHAT, "max_tokens": 4, "n": 3, "temperature": 1.0, "seed": 1, "logprobs": True},
    "n tool calls": {"messages": ASK, "tools": [WEATHER], "tool_choice": NAMED, "max_tokens": 120, "n": 2},
}
COMPLETION_MODES = {
    "plain": {"prompt": "the heat"},
    "logprobs": {"prompt": "the heat", "max_tokens": 5, "logprobs": 3},
    "token ids": {"prompt": [101, 104], "max_tokens": 3},
    "max_tokens 0": {"prompt": "the heat", "max_tokens": 0, "logprobs": 1},
    "n": {"prompt": "the heat", "max_tokens": 4, "n": 3, "temperature": 1.0, "seed": 1},
    "batched": {"prompt": ["the heat", "a rose"], "max_tokens": 3, "n": 2, "logprobs": 1},
    "batched ids": {"prompt": [[101, 104], [105]], "max_tokens": 2},
    "echo": {"prompt": "the heat", "max_tokens": 3, "echo": True},
    "echo logprobs": {"prompt": "the heat", "max_tokens": 3, "echo": True, "logprobs": 2},
    "echo logprobs max_tokens 0": {"prompt": [[116, 104, 101], [101]], "max_tokens": 0, "echo": True, "logprobs": 1},
    "echo max_tokens 0": {"prompt": "the heat", "max_tokens": 0, "echo": True, "n": 2},
}


@pytest.mark.parametrize("mode", CHAT_MODES)
def test_chat_answers_validate(served, mode):  # noqa: F811
    body = {"temperature": 0, **CHAT_MODES[mode]}
    r = post(served, CHAT_PATH, body)
    assert r.status_code == 200, r.text
    check(r.json(), "CreateChatCompletionResponse")
    chunks = events(served, CHAT_PATH, {**body, "stream_options": {"include_usage": True}})
    for c in chunks:
        check(c, "CreateChatCompletionStreamResponse")
    if "tools" in body:  # the modes do show the shapes they are named after
        assert r.json()["choices"][0]["message"]["tool_calls"]
        assert r.json()["choices"][0]["finish_reason"] == ("length" if "cut" in mode else "tool_calls")
        assert any("tool_calls" in ch["delta"] for c in chunks for ch in c["choices"])
    if "logprobs" in body:
        assert any(ch["logprobs"] for c in chunks for ch in c["choices"])
    n = body.get("n", 1)
    assert [c["index"] for c in r.json()["choices"]] == list(range(n))
    assert sorted({ch["index"] for c in chunks for ch in c["choices"]}) == list(range(n))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= n
    for c in events(served, CHAT_PATH, body):
        check(c, "CreateChatCompletionStreamResponse")
        assert "usage" not in c


@pytest.mark.parametrize("mode", COMPLETION_MODES)
def test_completion_answers_validate(served, mode):  # noqa: F811
    body = {"temperature": 0, **COMPLETION_MODES[mode]}
    r = post(served, COMPLETIONS, body)
    assert r.status_code == 200, r.text
    check(r.json(), "CreateCompletionResponse")
    chunks = events(served, COMPLETIONS, {**body, "stream_options": {"include_usage": True}})
    for c in chunks:
        check(c, "CreateCompletionStreamEvent")
    p = body["prompt"]
    prompts = p if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]
    total = len(prompts) * body.get("n", 1)
    assert [c["index"] for c in r.json()["choices"]] == list(range(total))
    finishes = {ch["index"]: ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]}
    assert sorted(finishes) == list(range(total)) and set(finishes.values()) <= {"stop", "length"}
    if body.get("echo"):
        texts = [t if isinstance(t, str) else post(served, "/detokenize", {"tokens": t}).json()["prompt"]
                 for t in prompts]  # fmt: skip
        assert all(c["text"].startswith(texts[c["index"] // body.get("n", 1)]) for c in r.json()["choices"])
        if "logprobs" in body:
            assert all(c["logprobs"]["token_logprobs"][0] is None for c in r.json()["choices"])
    assert chunks[-1]["choices"] == [] and "completion_tokens" in chunks[-1]["usage"]
    for c in events(served, COMPLETIONS, body):
        check(c, "CreateCompletionStreamEvent")


def test_models_and_errors_validate(served, client):  # noqa: F811
    check(httpx.get(served + "/v1/models").json(), "ListModelsResponse")
    name = client.models.list().data[0].id
    check(httpx.get(f"{served}/v1/models/{name}").json(), "Model")
    errors = [
        httpx.get(served + "/v1/models/nope"),
        httpx.get(served + "/v1/nothing-here"),
        post(served, CHAT_PATH, {"messages": CHAT, "model": "nope"}),
        post(served, CHAT_PATH, {"messages": []}),
        post(served, CHAT_PATH, content=b'{"messages": ['),
        post(served, CHAT_PATH, {"messages": CHAT, "functions": []}),
        post(served, COMPLETIONS, {"prompt": "x", "logit_bias": {"x": 1}}),
        post(served, COMPLETIONS, {"prompt": "x" * 1500}),
        post(served, COMPLETIONS, content=b"x" * (9 << 20)),
    ]
    assert sorted({r.status_code for r in errors}) == [400, 404, 413]
    for r in errors:
        check(r.json(), "ErrorResponse")
