"""The published schema: /openapi.json and /docs exist, every validation error is OpenAI's 400 with
`param` naming the field, unknown fields are ignored, and real answers match the response models.

The server runs in this process (uvicorn in a thread) on the tiny GGUF of test_fuzz_files: a
256-token context and a 384-token vocabulary, so any request finishes in well under a second.
"""

from __future__ import annotations

import httpx
import pytest
from inprocess_server import serving
from test_fuzz_files import tiny_gguf  # noqa: F401 - the fixture, shared

import sparrow
from sparrow.server import schema
from sparrow.server.app import ServerState

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the heat"}]


@pytest.fixture(scope="module")
def served(tiny_gguf, tmp_path_factory, request):  # noqa: F811
    """Base URL of a ready server on the tiny model (context: the test module's CTX, else 256)."""
    path = tmp_path_factory.mktemp("served") / "tiny.gguf"
    path.write_bytes(tiny_gguf)
    llm = sparrow.load(str(path), ctx=getattr(request.module, "CTX", None))
    with serving(ServerState(), llm, timeout=120) as base:
        # the first answer compiles what warm-up did not (when numba's cache is cold): not a test's time
        body = {"messages": CHAT, "max_tokens": 2, "temperature": 0.5, "logprobs": True, "stream": True}
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=600).status_code == 200
        yield base


def post(base, path, body=None, **kw):
    return httpx.post(base + path, json=body, timeout=120, **kw)


def error(r, status=400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "\n" not in err["message"] and len(err["message"]) <= 300, err
    return err


def test_openapi_and_docs_are_published(served):
    doc = httpx.get(served + "/openapi.json").json()
    assert doc["openapi"].startswith("3.") and doc["info"]["title"] == "sparrow"
    ops = {(p, m) for p, item in doc["paths"].items() for m in item}
    for op in [("/v1/chat/completions", "post"), ("/v1/completions", "post"), ("/v1/models", "get")]:
        assert op in ops
    assert {("/tokenize", "post"), ("/detokenize", "post"), ("/health", "get")} <= ops
    models = doc["components"]["schemas"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert chat["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletion")
    assert chat["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert {"messages", "temperature", "tools", "response_format"} <= set(models["ChatCompletionRequest"]["properties"])
    assert models["ImageURLPart"]["properties"]["image_url"] == {"$ref": "#/components/schemas/ImageURL"}
    assert models["ChatCompletionRequest"]["required"] == ["messages"]
    # sparrow answers 400, never FastAPI's 422
    assert not any("422" in op.get("responses", {}) for item in doc["paths"].values() for op in item.values())
    assert "HTTPValidationError" not in models
    page = httpx.get(served + "/docs")  # sparrow's own page (tests/test_server_docs_page.py)
    assert page.status_code == 200 and "/openapi.json" in page.text


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"messages": [CHAT[0], {"role": "user", "content": 5}]}, "messages[1].content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages[0].content[0].text"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
         "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0]"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {}, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": 5}},
         "response_format.json_schema"),
        ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "yaml"}}, "response_format.type"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {}}]}, "tools[0]"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{"function": {"name": "bad name"}}]},
         "tools[0].function.name"),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": 7}, "tool_choice"),
        ("/v1/chat/completions", {"messages": CHAT, "temperature": 2.5}, "temperature"),
        ("/v1/chat/completions", {"messages": CHAT, "temperature": "0.5"}, "temperature"),
        ("/v1/chat/completions", {"messages": CHAT, "top_p": -0.1}, "top_p"),
        ("/v1/chat/completions", {"messages": CHAT, "repetition_penalty": 1e-320}, "repetition_penalty"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 1.5}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "seed": "x"}, "seed"),
        ("/v1/chat/completions", {"messages": CHAT, "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": 1}},
         "stream_options.include_usage"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": 3}, "logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "stop": ["x"] * 17}, "stop"),
        ("/v1/chat/completions", {"messages": CHAT, "stop_token_ids": [-1]}, "stop_token_ids"),
        ("/v1/chat/completions", {"messages": CHAT, "kv_dtype": "q4"}, "kv_dtype"),
        ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": []}, "chat_template_kwargs"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], "a"]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
        ("/v1/completions", {"prompt": "x", "n": 129}, "n"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/detokenize", {"tokens": ["a"]}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)  # fmt: skip
def test_validation_errors_name_the_field(served, path, body, param):
    err = error(post(served, path, body))
    assert (err["param"], err["type"]) == (param, "invalid_request_error"), err


def test_bodies_that_are_not_objects(served):
    for content in (b"[1, 2]", b"7", b'"x"', b"null", b""):
        assert error(post(served, "/v1/chat/completions", content=content))["param"] is None
    assert error(post(served, "/v1/chat/completions", content=b'{"messages": ['))["code"] == "invalid_json"
    assert error(post(served, "/v1/chat/completions", content=b"x" * (9 << 20)), 413)["code"] == "request_too_large"


def test_image_parts_reach_the_model_check(served):
    """A text model refuses image parts as before (the parts are modelled, passed on for a VL model)."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
    assert error(post(served, "/v1/chat/completions", {"messages": msgs}))["param"] == "messages[0].content[1]"
    from sparrow.server.protocol import parse_chat

    assert parse_chat({"messages": msgs}, images=True).messages[0]["content"][1] == image


def test_unknown_fields_are_ignored(served):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "x-extra": 1}}
    body = {
        "messages": [{"role": "user", "content": "the heat", "x-note": 1}],
        "max_tokens": 2,
        "user": "me",
        "frobnicate": {"a": [1]},
        "stream_options": {"include_usage": True, "other": 1},
        "metadata": {"k": "v"},
    }
    r = post(served, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    from sparrow.server.protocol import parse_chat

    # a tool's own extra keys reach the chat template as given (the tools prompt is too long for ctx 256)
    assert parse_chat({**body, "tools": [tool]}).structured.template_tools == [tool]
    assert post(served, "/v1/completions", {"prompt": "the", "max_tokens": 1, "user": "x"}).status_code == 200


def test_curl_form_content_type_is_read_as_json(served):
    body = b'{"prompt": "the heat", "max_tokens": 1}'
    headers = {"content-type": "application/x-www-form-urlencoded"}  # what `curl -d` sends
    r = httpx.post(served + "/v1/completions", content=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text


def test_answers_match_the_published_models(served):
    """What the server sends validates against the models /openapi.json documents."""
    kw = {"max_tokens": 3, "temperature": 0}
    r = post(served, "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2, **kw})
    chat = schema.ChatCompletion.model_validate(r.json())
    assert chat.choices[0].logprobs.content and chat.usage.completion_tokens >= 1
    r = post(served, "/v1/completions", {"prompt": "the heat", "logprobs": 2, **kw})
    assert schema.Completion.model_validate(r.json()).choices[0].logprobs.tokens
    tok = schema.TokenizeResponse.model_validate(post(served, "/tokenize", {"prompt": "the heat"}).json())
    detok = post(served, "/detokenize", {"tokens": tok.tokens}).json()
    assert schema.DetokenizeResponse.model_validate(detok).prompt == "the heat"
    card = schema.ModelList.model_validate(httpx.get(served + "/v1/models").json()).data[0]
    assert card.max_model_len == 256
    assert card.activations in ("f32", "q8") and card.activations_why  # which mode runs, and why
    err = post(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**6}).json()
    assert schema.ErrorResponse.model_validate(err).error.param == "messages"
