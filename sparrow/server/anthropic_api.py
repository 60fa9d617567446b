"""Anthropic's Messages API: `POST /v1/messages` (whole or streamed as Anthropic's SSE events) and
`POST /v1/messages/count_tokens`, for the anthropic SDK and clients built on it (Claude Code).

A Messages body is turned into a chat completions body and run by the chat path (chat_runs.py):
- `system` (a string or text blocks) and any `system` role inside `messages` (recent Claude Code
  clients send one) become the conversation's one leading system message;
- text and image blocks (base64 or URL sources) become chat parts, `tool_use` blocks an
  assistant's tool_calls, `tool_result` blocks tool messages, `thinking` blocks the assistant's
  reasoning_content (Qwen3 templates render it);
- `tools` (custom tools: name, description, input_schema) and `tool_choice` (auto, any, tool,
  none; disable_parallel_tool_use) map onto sparrow's tool support, `output_config.format` (a JSON
  schema) onto its structured output; `stop_sequences`,
  `temperature`, `top_p`, `top_k` and sparrow's own sampling fields (the SDK sends them through
  `extra_body`) onto the chat fields of the same meaning; `thinking` onto the template's
  `enable_thinking`.
The answer holds `thinking`, `text` and `tool_use` blocks, `stop_reason` (end_turn, max_tokens,
stop_sequence, tool_use) and `usage`; errors are Anthropic's shape ({"type": "error", "error":
{"type", "message"}}), never a 5xx for a bad body. What is not supported (server tools,
documents, MCP servers, containers) is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from ..errors import SparrowError
from .chat_runs import SPARROW_FIELDS, Busy, ChatRun
from .protocol import APIError, new_id, validate
from .protocol import chat_request as gen_request
from .schema import ChatCompletionRequest
from .service import Service
from .streaming import SSEResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
# sparrow's chat fields a Messages body may carry too (the SDK's extra_body)
PASSED = (*SPARROW_FIELDS, "response_format")
REFUSED = {
    "mcp_servers": "MCP servers are not supported",
    "container": "containers are not supported",
}  # context_management (clearing old tool results) is accepted: the whole conversation is kept


_TEXT_BLOCK = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_MESSAGES = {  # the published schema of `messages` (chat_body checks every block)
    "items": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["user", "assistant", "system"]},
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {"anyOf": [_TEXT_BLOCK, {"type": "object"}]},
                        "description": "text, image, tool_use, tool_result and thinking blocks",
                    },
                ]
            },
        },
    }
}


class MessagesRequest(BaseModel):
    """The fields /v1/messages reads (documentation and fuzzing; the module doc has the rules)."""

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(
        min_length=1, description="role user or assistant (system accepted)", json_schema_extra=_MESSAGES
    )
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="custom tools: name, description, input_schema")
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = Field(None, description="enabled / disabled: the template's enable_thinking")
    metadata: dict[str, Any] | None = None


class CountTokensRequest(BaseModel):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1, json_schema_extra=_MESSAGES)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def _doc(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


DOC = {200: {"description": "a message; with stream, server-sent events (message_start ... message_stop)"}}


def error_body(message: str, status: int) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status, headers=headers)


def _bad(message: str) -> APIError:
    return APIError(400, message)


# ---------------------------------------------------------------------- Messages body -> chat body
def _text_of(value, where: str) -> str:
    """A string, or text blocks joined (a system prompt, a tool result)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        out = []
        for j, b in enumerate(value):
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise _bad(f"{where}[{j}]: expected a text block {{'type': 'text', 'text': ...}}")
            out.append(b["text"])
        return "\n".join(out)
    raise _bad(f"{where}: expected a string or a list of text blocks")


def _image(block: dict, where: str) -> dict:
    src = block.get("source")
    if not isinstance(src, dict):
        raise _bad(f"{where}.source: required (base64 or url)")
    if src.get("type") == "base64":
        media, data = src.get("media_type"), src.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise _bad(f"{where}.source: a base64 source needs 'media_type' and 'data' strings")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if src.get("type") == "url" and isinstance(src.get("url"), str):
        return {"type": "image_url", "image_url": {"url": src["url"]}}
    raise _bad(f"{where}.source: the type must be 'base64' or 'url'")


def _tool_result(block: dict, where: str) -> dict:
    tid = block.get("tool_use_id")
    if not isinstance(tid, str):
        raise _bad(f"{where}.tool_use_id: required (a string)")
    content = block.get("content", "")
    if isinstance(content, list):  # text blocks; images in tool results are not supported
        content = _text_of(content, f"{where}.content")
    elif not isinstance(content, str):
        raise _bad(f"{where}.content: expected a string or text blocks")
    if block.get("is_error") is True:
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": tid, "content": content}


def _user(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content: expected a string or a list of content blocks")
    tools, parts = [], []
    for j, b in enumerate(content):
        w = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image":
            parts.append(_image(b, w))
        elif kind == "tool_result":
            tools.append(_tool_result(b, w))
        else:
            raise _bad(f"{w}: unsupported content block {kind!r} in a user message (text, image, tool_result)")
    out = tools
    if parts:
        text_only = all(p["type"] == "text" for p in parts)
        out = out + [{"role": "user", "content": "\n".join(p["text"] for p in parts) if text_only else parts}]
    return out


def _assistant(content, where: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(f"{where}.content: expected a string or a list of content blocks")
    texts, thinking, calls = [], [], []
    for j, b in enumerate(content):
        w = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thinking.append(b["thinking"])
        elif kind == "redacted_thinking":
            continue  # nothing a local model can read
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise _bad(f"{w}: a tool_use block needs 'id' and 'name' strings")
            args = b.get("input", {})
            if not isinstance(args, dict):
                raise _bad(f"{w}.input: expected an object")
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": args}})
        else:
            raise _bad(f"{w}: unsupported content block {kind!r} in an assistant message (text, thinking, tool_use)")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise _bad("tools: expected a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise _bad(f"tools[{i}]: expected an object")
        kind = t.get("type", "custom")
        if kind not in (None, "custom"):
            raise _bad(f"tools[{i}]: server tool {kind!r} is not supported (custom tools only)")
        if not isinstance(t.get("name"), str):
            raise _bad(f"tools[{i}].name: required (a string)")
        fn = {"name": t["name"], "parameters": t.get("input_schema", {"type": "object"})}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    if not isinstance(choice, dict):
        raise _bad("tool_choice: expected an object such as {'type': 'auto'}")
    parallel = None if choice.get("disable_parallel_tool_use") is not True else False
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad("tool_choice.type: must be auto, any, tool (with a name) or none")


def chat_body(body, count_only: bool = False) -> dict:
    """A Messages (or count_tokens) body -> a chat completions body (not yet validated)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    for name, why in REFUSED.items():
        if body.get(name) is not None:
            raise _bad(why)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages: required (a non-empty list)")
    if not count_only:
        mt = body.get("max_tokens")
        if mt is None:
            raise _bad("max_tokens: Field required")
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise _bad("max_tokens: must be an integer of at least 1")
    system = [] if body.get("system") is None else [_text_of(body["system"], "system")]
    out: list[dict] = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where}: expected an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if content is None:
            raise _bad(f"{where}.content: required")
        if role == "system":  # not Anthropic's API, but what recent Claude Code clients send
            system.append(_text_of(content, f"{where}.content"))
        elif role == "user":
            out += _user(content, where)
        elif role == "assistant":
            out.append(_assistant(content, where))
        else:
            raise _bad(f"{where}.role: must be 'user' or 'assistant' (got {role!r:.40})")
    if system:
        out.insert(0, {"role": "system", "content": "\n\n".join(system)})
    chat: dict[str, Any] = {"messages": out}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"], parallel = _tool_choice(body["tool_choice"])
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    kwargs = dict(body.get("chat_template_kwargs") or {}) if isinstance(body.get("chat_template_kwargs"), dict) else {}
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise _bad("thinking.type: must be 'enabled' or 'disabled'")
        kwargs.setdefault("enable_thinking", thinking["type"] != "disabled")
    if count_only:
        if kwargs:
            chat["chat_template_kwargs"] = kwargs
        return chat
    for name in PASSED:
        if body.get(name) is not None:
            chat[name] = body[name]
    fmt = body.get("output_format")
    if fmt is None and isinstance(body.get("output_config"), dict):
        fmt = body["output_config"].get("format")
    if fmt is not None:  # structured output: a JSON schema the answer's text follows
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise _bad("output_config.format: expected {'type': 'json_schema', 'schema': {...}}")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    chat["max_tokens"] = body["max_tokens"]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise _bad("stop_sequences: expected a list of strings")
        chat["stop"] = stops
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    return chat


# ---------------------------------------------------------------------- answers
def _call_input(arguments) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(run: ChatRun) -> dict:
    cached = run.cached_tokens
    return {
        "input_tokens": run.prompt_tokens - cached,
        "output_tokens": run.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _stop(run: ChatRun, finish: str) -> tuple[str, str | None]:
    if finish != "stop":
        return STOP_REASONS.get(finish, "end_turn"), None
    matched = run.matched_stop()
    return ("stop_sequence", matched) if matched is not None else ("end_turn", None)


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def _delta(index: int, delta: dict) -> str:
    return _sse("content_block_delta", {"index": index, "delta": delta})


async def _events(run: ChatRun, mid: str, model: str):
    """Anthropic's event sequence: message_start, each block's start / deltas / stop (thinking,
    text, tool_use in the order written), message_delta (stop_reason, usage), message_stop."""
    message = {"id": mid, "type": "message", "role": "assistant", "content": [], "model": model,
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": run.prompt_tokens, "output_tokens": 0}}  # fmt: skip
    yield _sse("message_start", {"message": message})
    index, open_kind = -1, None

    def close():
        nonlocal open_kind
        out = []
        if open_kind == "thinking":
            out.append(_delta(index, {"type": "signature_delta", "signature": ""}))
        if open_kind is not None:
            out.append(_sse("content_block_stop", {"index": index}))
        open_kind = None
        return out

    def start(kind: str, block: dict):
        nonlocal index, open_kind
        out = close()
        index += 1
        open_kind = kind
        out.append(_sse("content_block_start", {"index": index, "content_block": block}))
        return out

    try:
        async for p in run.pieces():
            if p.reasoning:
                if open_kind != "thinking":
                    for e in start("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield e
                yield _delta(index, {"type": "thinking_delta", "thinking": p.reasoning})
            if p.content:
                if open_kind != "text":
                    for e in start("text", {"type": "text", "text": ""}):
                        yield e
                yield _delta(index, {"type": "text_delta", "text": p.content})
            for d in p.tool_deltas:
                if "id" in d:
                    block = {"type": "tool_use", "id": d["id"], "name": d["function"]["name"], "input": {}}
                    for e in start("tool_use", block):
                        yield e
                args = d["function"].get("arguments", "")
                if args:
                    yield _sse(
                        "content_block_delta",
                        {"index": index, "delta": {"type": "input_json_delta", "partial_json": args}},
                    )
            if p.finish:
                if index < 0:  # an empty answer still holds one (empty) text block, as the whole answer does
                    for e in start("text", {"type": "text", "text": ""}):
                        yield e
                for e in close():
                    yield e
                reason, seq = _stop(run, p.finish)
                usage = _usage(run)  # the cached part of the prompt is known only now
                yield _sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage})
                yield _sse("message_stop", {})
                return
    except APIError as e:
        yield f"event: error\ndata: {json.dumps(error_body(e.message, e.status))}\n\n"


def _message(run: ChatRun, mid: str, model: str, reasoning: str, content: str, finish: str) -> dict:
    blocks: list[dict] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content or not run.acc.tool_calls:
        blocks.append({"type": "text", "text": content})
    for c in run.acc.tool_calls:
        blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                       "input": _call_input(c["function"]["arguments"])})  # fmt: skip
    reason, seq = _stop(run, finish)
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": seq, "usage": _usage(run)}  # fmt: skip


async def _json(request: Request):
    try:
        return await request.json()
    except ValueError:
        raise _bad("the request body is not valid JSON") from None


# ---------------------------------------------------------------------- routes
def add_routes(app: FastAPI, core: Service) -> None:
    state = core.state

    async def chat_request(body, count_only: bool = False):
        chat = chat_body(body, count_only)
        if count_only:
            chat["max_tokens"] = 1
        return validate(ChatCompletionRequest, chat)

    @app.post("/v1/messages", response_model=None, openapi_extra=_doc(MessagesRequest), responses=DOC)
    async def messages(request: Request):
        """Anthropic's Messages API (see the module doc)."""
        run = None
        try:
            state.require_ready()
            body = await _json(request)
            chat = await chat_request(body)
            run = ChatRun(core, chat)
            await run.start()
        except APIError as e:
            return _error(e.status, e.message, e.headers)
        except Busy as e:
            return _error(529, str(e), {"Retry-After": e.retry_after})
        mid, model = new_id("msg").replace("-", "_"), state.llm.name
        if body.get("stream") is True:
            return SSEResponse(_events(run, mid, model), run.cancel)
        try:
            result = await run.collect(request)
        except APIError as e:
            return _error(e.status, e.message)
        if result is None:
            return _error(400, "client disconnected")
        return _message(run, mid, model, *result)

    @app.post(
        "/v1/messages/count_tokens",
        response_model=None,
        openapi_extra=_doc(CountTokensRequest),
        responses={200: {"description": "{'input_tokens': N}"}},
    )
    async def count_tokens(request: Request):
        """The prompt's tokens for a Messages body (its model, system, messages, tools)."""
        try:
            state.require_ready()
            chat = await chat_request(await _json(request), count_only=True)
            llm = state.llm
            req = gen_request(chat, llm.checkpoint.generation_defaults, llm.vision is not None)
            core.check_model(req.model)
            try:
                await run_in_threadpool(core.check_chat_size, llm, req, 0)
                ids, _ = await run_in_threadpool(core.chat_prompt, llm, req)
            except SparrowError as e:  # the context, a bad image, a template error
                raise _bad(str(e)) from None
        except APIError as e:
            return _error(e.status, e.message, e.headers)
        return {"input_tokens": len(ids)}
