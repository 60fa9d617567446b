"""OpenAI's Responses API: `POST /v1/responses` (whole, or streamed as its typed events),
`GET` and `DELETE /v1/responses/{id}` for stored responses.

A Responses body is turned into a chat completions body and run by the chat path
(chat_runs.py), so the answer at temperature 0 is the chat endpoint's for the same conversation:
- `input` as a string (one user message) or a list of items: messages (roles user, assistant,
  system, developer; content a string or input_text / input_image / output_text parts),
  `function_call` items (an assistant's earlier calls) and `function_call_output` items (their
  results), `reasoning` items (the assistant's earlier reasoning);
- `instructions` as the leading system message (not carried to a later response);
- `max_output_tokens`, `temperature`, `top_p`, function `tools`, `tool_choice`,
  `parallel_tool_calls`, `text.format` (text, json_object, json_schema) and sparrow's own
  sampling fields as on chat; `reasoning.effort` "none" / "minimal" turns Qwen3's thinking off;
- `store` (default true) keeps the conversation in memory (at most STORED responses and
  STORED_BYTES of them, the least recently used dropped first), for `previous_response_id`.
The answer's output holds a `reasoning` item (Qwen3 thinking), a `message` item with its
`output_text`, and `function_call` items. What is not supported (built-in tools, background
runs, conversations, prompt templates, input files, logprobs) is a 400 naming it.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from .chat_runs import SPARROW_FIELDS, Busy, ChatRun
from .protocol import APIError, error_body, new_id, validate
from .schema import ChatCompletionRequest
from .service import Service
from .streaming import SSEResponse

STORED = 512  # responses kept for previous_response_id (a bounded LRU, in memory)
STORED_BYTES = 256 * 1024 * 1024  # and at most this much of their JSON
PASSED = (*SPARROW_FIELDS, "top_k", "stop")  # sparrow's chat fields (extra_body)
REFUSED = {  # name: (values that ask for nothing, why)
    "background": ((None, False), "background responses are not supported"),
    "conversation": ((None,), "'conversation' is not supported: use previous_response_id"),
    "prompt": ((None,), "prompt templates are not supported"),
    "include": ((None, []), "'include' is not supported (nothing extra to include)"),
    "top_logprobs": ((None, 0), "'top_logprobs' is not supported on /v1/responses (use chat completions)"),
    "truncation": ((None, "disabled"), "only truncation 'disabled' is supported"),
    "max_tool_calls": ((None,), "'max_tool_calls' is not supported"),
    "stream_options": ((None,), "'stream_options' is not supported"),
}


class ResponsesRequest(BaseModel):
    """The fields /v1/responses reads (documentation and fuzzing; the module doc has the rules)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    tools: list[dict[str, Any]] | None = Field(None, description="function tools: type, name, description, parameters")
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(
        None, description="{'format': {'type': 'text' | 'json_object' | 'json_schema'}}"
    )
    reasoning: dict[str, Any] | None = Field(None, description="effort 'none' or 'minimal' turns Qwen3 thinking off")
    store: bool | None = Field(None, description="keep the conversation for previous_response_id (default true)")
    previous_response_id: str | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None


BODY = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": ResponsesRequest.model_json_schema()}}}
}
DOC = {
    200: {"description": "a response object; with stream, server-sent events (response.created ... response.completed)"}
}


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# ---------------------------------------------------------------------- Responses body -> chat body
def _parts(content, where: str, role: str):
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts", where)
    parts = []
    for j, p in enumerate(content):
        w = f"{where}.content[{j}]"
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif kind == "input_image" and role == "user":
            url = p.get("image_url")
            if not isinstance(url, str):
                raise _bad(f"{w}: an input_image needs an image_url (file_id is not supported)", w)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "refusal":
            continue
        else:
            raise _bad(f"{w}: unsupported content part {kind!r} (input_text, input_image, output_text)", w)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def input_messages(items, where: str = "input") -> list[dict]:
    """Responses input (a string or items) -> chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad("'input' must be a string or a list of input items", "input")
    out: list[dict] = []
    reasoning: list[str] = []

    def assistant() -> dict:
        """The assistant message a call or reasoning item belongs to (the last one, if it ends the list)."""
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        return out[-1]

    for i, it in enumerate(items):
        w = f"{where}[{i}]"
        if not isinstance(it, dict):
            raise _bad(f"{w} must be an object", w)
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{w}.role must be user, assistant, system or developer", w)
            msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
            msg["content"] = _parts(it.get("content", ""), w, role)
            if role == "assistant" and reasoning:
                msg["reasoning_content"] = "\n".join(reasoning)
                reasoning = []
            out.append(msg)
        elif kind == "function_call":
            if not isinstance(it.get("name"), str) or not isinstance(it.get("call_id"), str):
                raise _bad(f"{w}: a function_call needs 'name' and 'call_id' strings", w)
            args = it.get("arguments", "{}")
            if not isinstance(args, str):
                raise _bad(f"{w}.arguments must be a JSON string", w)
            a = assistant()
            if reasoning:
                a["reasoning_content"] = "\n".join(reasoning)
                reasoning = []
            call = {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": args}}
            a.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise _bad(f"{w}: a function_call_output needs a 'call_id' string", w)
            output = it.get("output", "")
            if isinstance(output, list):
                output = _parts(output, w, "tool")
            if not isinstance(output, str):
                raise _bad(f"{w}.output must be a string or text parts", w)
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": output})
        elif kind == "reasoning":
            content, summary = it.get("content"), it.get("summary")
            texts = [c.get("text", "") for c in content if isinstance(c, dict)] if isinstance(content, list) else []
            if not texts and isinstance(summary, list):
                texts = [x.get("text", "") for x in summary if isinstance(x, dict)]
            reasoning.append("".join(t for t in texts if isinstance(t, str)))
        else:
            raise _bad(f"{w}: unsupported input item type {kind!r} (message, function_call, "
                       "function_call_output, reasoning)", w)  # fmt: skip
    return out


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tools[{i}]: tool type {kind!r} is not supported (function tools only)", f"tools[{i}]")
        if not isinstance(t.get("name"), str):
            raise _bad(f"tools[{i}].name is required", f"tools[{i}].name")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("'tool_choice' must be auto, none, required or {'type': 'function', 'name': ...}", "tool_choice")


def _format(text) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("'text' must be an object", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise _bad("'text.verbosity' is not supported", "text.verbosity")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad("'text.format.type' must be text, json_object or json_schema", "text.format")


def chat_body(body: dict, history: list[dict]) -> dict:
    """A Responses body (after the stored conversation `history`) -> a chat completions body."""
    for name, (allowed, why) in REFUSED.items():
        v = body.get(name)
        if not any(v == a and type(v) is type(a) for a in allowed):
            raise _bad(why, name)
    if "input" not in body:
        raise _bad("'input' is required", "input")
    messages = history + input_messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("'instructions' must be a string", "instructions")
        messages = [{"role": "system", "content": instructions}] + messages
    if not messages:
        raise _bad("'input' is empty", "input")
    chat: dict[str, Any] = {"messages": messages, "stream": False}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", *PASSED):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise _bad("'reasoning' must be an object", "reasoning")
        effort = reasoning.get("effort")
        if effort is not None:
            kwargs = dict(chat.get("chat_template_kwargs") or {})
            kwargs.setdefault("enable_thinking", effort not in ("none", "minimal"))
            chat["chat_template_kwargs"] = kwargs
    return chat


def _param(param: str | None) -> str | None:
    """A chat field's name as the Responses body calls it."""
    if param is None:
        return None
    for chat, ours in (("max_tokens", "max_output_tokens"), ("response_format", "text.format"), ("messages", "input")):
        if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
            return ours + param[len(chat) :]
    return param


# ---------------------------------------------------------------------- answers
class Store:
    """Stored responses for previous_response_id: the whole conversation after each (the input
    as chat messages plus the answer), by id, per API key, the least recently used dropped past
    `size` responses or `max_bytes` of their JSON (a conversation may hold 8 MB of images)."""

    def __init__(self, size: int = STORED, max_bytes: int = STORED_BYTES):
        self.size, self.max_bytes, self.bytes = size, max_bytes, 0
        self.items: OrderedDict = OrderedDict()  # (key, id) -> (messages, response, bytes)

    def get(self, key, rid: str):
        item = self.items.get((key, rid))
        if item is not None:
            self.items.move_to_end((key, rid))
        return item

    def put(self, key, rid: str, messages: list[dict], response: dict) -> None:
        size = len(json.dumps([messages, response], ensure_ascii=False))
        if size > self.max_bytes:
            return  # larger than the whole store: not kept (previous_response_id then answers 404)
        self.items[(key, rid)] = (messages, response, size)
        self.bytes += size
        while len(self.items) > self.size or self.bytes > self.max_bytes:
            self.bytes -= self.items.popitem(last=False)[1][2]

    def delete(self, key, rid: str) -> bool:
        item = self.items.pop((key, rid), None)
        if item is not None:
            self.bytes -= item[2]
        return item is not None


def _usage(run: ChatRun) -> dict:
    return {
        "input_tokens": run.prompt_tokens,
        "input_tokens_details": {"cached_tokens": run.cached_tokens},
        "output_tokens": run.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": run.prompt_tokens + run.completion_tokens,
    }


def _text_part(text: str = "") -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class Events:
    """Streams one response as OpenAI's typed events, each with its sequence_number."""

    def __init__(self, base: dict):
        self.base, self.seq = base, 0
        self.output: list[dict] = []
        self.open: str | None = None  # "reasoning" | "message" | "call" | None
        self.calls: dict[int, int] = {}  # the parser's call index -> output index

    def event(self, kind: str, **data) -> str:
        out = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(out, ensure_ascii=False)}\n\n"

    def close(self) -> list[str]:
        if self.open is None:
            return []
        i = len(self.output) - 1
        item = self.output[i]
        out = []
        if self.open == "reasoning":
            text = item["content"][0]["text"]
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=i,
                                  content_index=0, text=text))  # fmt: skip
        elif self.open == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                  text=part["text"], logprobs=[]))  # fmt: skip
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                                  part=part))  # fmt: skip
        elif self.open == "call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  name=item["name"], arguments=item["arguments"]))  # fmt: skip
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=i, item=item))
        self.open = None
        return out

    def start(self, kind: str, item: dict) -> list[str]:
        out = self.close()
        self.output.append(item)
        self.open = kind
        i = len(self.output) - 1
        shown = {**item, "content": []} if kind in ("reasoning", "message") else {**item, "arguments": ""}
        out.append(self.event("response.output_item.added", output_index=i, item={**shown, "status": "in_progress"}))
        if kind == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=i,
                                  content_index=0, part=_text_part()))  # fmt: skip
        return out


def _call_item(call: dict) -> dict:
    fn = call["function"]
    return {"type": "function_call", "id": "fc_" + new_id("")[1:], "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"], "status": "completed"}  # fmt: skip


def _response(base: dict, output: list[dict], run: ChatRun, finish: str) -> dict:
    incomplete = finish == "length"
    for item in output:
        if item["type"] == "message" and incomplete:
            item["status"] = "incomplete"
    return {**base, "status": "incomplete" if incomplete else "completed", "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": _usage(run)}  # fmt: skip


def _whole_output(run: ChatRun, reasoning: str, content: str) -> list[dict]:
    out = []
    if reasoning:
        out.append({"type": "reasoning", "id": "rs_" + new_id("")[1:], "summary": [],
                    "content": [{"type": "reasoning_text", "text": reasoning}], "status": "completed"})  # fmt: skip
    if content or not run.acc.tool_calls:
        out.append({"type": "message", "id": "msg_" + new_id("")[1:], "status": "completed", "role": "assistant",
                    "content": [_text_part(content)]})  # fmt: skip
    out += [_call_item(c) for c in run.acc.tool_calls]
    return out


def _conversation(messages: list[dict], output: list[dict]) -> list[dict]:
    """The stored conversation: the request's messages (less its instructions) and the answer."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            msg["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "message":
            msg["content"] = item["content"][0]["text"]
        elif item["type"] == "function_call":
            msg.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})  # fmt: skip
    return messages + [msg]


# ---------------------------------------------------------------------- routes
def add_routes(app: FastAPI, core: Service) -> None:
    state = core.state
    store = Store()

    def key(request: Request):
        return request.headers.get("authorization") or request.headers.get("x-api-key") or ""

    def failure(e: APIError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.type, _param(e.param), e.code), e.status, headers=e.headers)

    @app.post("/v1/responses", response_model=None, openapi_extra=BODY, responses=DOC)
    async def responses(request: Request):
        """OpenAI's Responses API (see the module doc)."""
        try:
            state.require_ready()
            try:
                body = await request.json()
            except ValueError:
                raise _bad("malformed JSON body") from None
            if not isinstance(body, dict):
                raise _bad("the request body must be a JSON object")
            history: list[dict] = []
            prev = body.get("previous_response_id")
            if prev is not None:
                stored = store.get(key(request), prev) if isinstance(prev, str) else None
                if stored is None:
                    missing = f"previous response {json.dumps(prev)[:60]} not found"
                    raise APIError(404, missing, param="previous_response_id")
                history = stored[0]
            store_it = body.get("store", True)
            if not isinstance(store_it, bool):
                raise _bad("'store' must be a boolean", "store")
            chat = chat_body(body, history)
            messages = [m for m in chat["messages"] if m is not None]
            if body.get("instructions") is not None:
                messages = messages[1:]  # instructions are not carried to a later response
            run = ChatRun(core, validate(ChatCompletionRequest, chat))
            await run.start()
        except APIError as e:
            return failure(e)
        except Busy as e:
            err = APIError(503, str(e), type="server_error", code="server_busy", headers={"Retry-After": e.retry_after})
            return failure(err)
        rid = "resp_" + new_id("")[1:]
        base = {
            "id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": state.llm.name, "output": [], "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "text": body.get("text") or {"format": {"type": "text"}},
            "previous_response_id": prev, "store": store_it, "metadata": body.get("metadata") or {},
            "usage": None,
        }  # fmt: skip

        def keep(response: dict) -> None:
            if store_it:
                store.put(key(request), rid, _conversation(messages, response["output"]), response)

        if body.get("stream") is True:
            return SSEResponse(_stream(run, base, keep), run.cancel)
        try:
            result = await run.collect(request)
        except APIError as e:
            return failure(e)
        if result is None:
            return JSONResponse(error_body("client disconnected"), status_code=499)
        reasoning, content, finish = result
        response = _response(base, _whole_output(run, reasoning, content), run, finish)
        keep(response)
        return response

    @app.get("/v1/responses/{rid}", response_model=None, responses=DOC)
    async def get_response(request: Request, rid: str):
        """A stored response (one made with store true), by its id."""
        stored = store.get(key(request), rid)
        if stored is None:
            return failure(APIError(404, f"response {json.dumps(rid)[:60]} not found", type="not_found_error"))
        return stored[1]

    @app.delete("/v1/responses/{rid}", response_model=None)
    async def delete_response(request: Request, rid: str):
        if not store.delete(key(request), rid):
            return failure(APIError(404, f"response {json.dumps(rid)[:60]} not found", type="not_found_error"))
        return {"id": rid, "object": "response", "deleted": True}


async def _stream(run: ChatRun, base: dict, keep):
    ev = Events(base)
    yield ev.event("response.created", response=base)
    yield ev.event("response.in_progress", response=base)
    try:
        async for p in run.pieces():
            if p.reasoning:
                if ev.open != "reasoning":
                    item = {"type": "reasoning", "id": "rs_" + new_id("")[1:], "summary": [],
                            "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip
                    for e in ev.start("reasoning", item):
                        yield e
                item = ev.output[-1]
                item["content"][0]["text"] += p.reasoning
                yield ev.event("response.reasoning_text.delta", item_id=item["id"], output_index=len(ev.output) - 1,
                               content_index=0, delta=p.reasoning)  # fmt: skip
            if p.content:
                if ev.open != "message":
                    item = {"type": "message", "id": "msg_" + new_id("")[1:], "role": "assistant",
                            "content": [_text_part()]}  # fmt: skip
                    for e in ev.start("message", item):
                        yield e
                item = ev.output[-1]
                item["content"][0]["text"] += p.content
                yield ev.event("response.output_text.delta", item_id=item["id"], output_index=len(ev.output) - 1,
                               content_index=0, delta=p.content, logprobs=[])  # fmt: skip
            for d in p.tool_deltas:
                if "id" in d:
                    call = {"id": d["id"], "function": {"name": d["function"]["name"], "arguments": ""}}
                    for e in ev.start("call", {**_call_item(call), "status": "in_progress"}):
                        yield e
                args = d["function"].get("arguments", "")
                if args:
                    item = ev.output[-1]
                    item["arguments"] += args
                    yield ev.event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=len(ev.output) - 1, delta=args)  # fmt: skip
            if p.finish:
                if not ev.output:  # an empty answer is one empty message, as the whole answer gives
                    item = {"type": "message", "id": "msg_" + new_id("")[1:], "role": "assistant",
                            "content": [_text_part()]}  # fmt: skip
                    for e in ev.start("message", item):
                        yield e
                for e in ev.close():
                    yield e
                response = _response(base, ev.output, run, p.finish)
                keep(response)
                kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
                yield ev.event(kind, response=response)
                return
    except APIError as e:
        yield ev.event("error", code=e.code, message=e.message, param=e.param)
