"""Turning the engine's StepOutputs into OpenAI responses: whole answers and SSE streams."""

from __future__ import annotations

import asyncio
import json

from fastapi.responses import StreamingResponse

from .protocol import APIError, ReasoningSplitter, error_body, usage


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
    """Runs on_close however the response ends (finished, client gone, task cancelled)."""

    def __init__(self, gen, on_close):
        super().__init__(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class Accumulator:
    """Turns StepOutputs into content/reasoning deltas, tool-call deltas and logprob entries.

    The whole answer and the stream feed the same pieces to the same tool parser, so a streamed
    call reassembles to the call the whole answer returns."""

    def __init__(
        self, llm, splitter: ReasoningSplitter | None, want_lp: bool, stop_ids=(), tool_parser=None, tracer=None
    ):
        """tracer: a sparse_trace.Tracer when the request asked for sparse_trace."""
        self.tok, self.splitter, self.want_lp = llm.tokenizer, splitter, want_lp
        self.tracer = tracer
        self.trace_step: dict | None = None  # of the latest add()
        self.trace_steps: list[dict] = []  # every add()'s, for a whole answer
        self.eos = set(llm.tokenizer.eos_token_ids) | set(stop_ids)
        self.tokens = 0
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.parser = tool_parser
        self.tool_deltas: list[dict] = []  # of the latest add()

    @property
    def tool_calls(self) -> list[dict]:
        return self.parser.calls if self.parser is not None else []

    def finish_reason(self, finish: str) -> str:
        return "tool_calls" if finish == "stop" and self.tool_calls else finish

    def usage(self, prompt_tokens: int) -> dict:
        return {**usage(prompt_tokens, self.tokens), "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def add(self, out):
        self.tokens += 1
        self.trace_step = self.tracer.step(out) if self.tracer is not None else None
        if out.cached_tokens is not None:
            self.cached_tokens = out.cached_tokens
        final = out.finish_reason is not None
        if self.splitter is not None:
            reasoning, content = self.splitter.push(out.text, final)
        else:
            reasoning, content = "", out.text
        self.tool_deltas = []
        if self.parser is not None:
            content, self.tool_deltas = self.parser.push(content, final)
        hidden = out.finish_reason == "stop" and out.token_id in self.eos  # end-of-turn / stop token: no text
        lps = [out] if self.want_lp and out.logprob is not None and not hidden else []
        return reasoning, content, lps


async def collect(request, queue, acc):
    """Waits for the whole answer; None if the client disconnects first."""

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    reasoning, content, lps = [], [], []
    try:
        while True:
            get = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                return None
            kind, out = get.result()
            if kind == "timeout":
                raise APIError(504, out, type="server_error", code="timeout")
            if kind == "error":
                raise APIError(500, out, type="server_error")
            r, c, lp = acc.add(out)
            reasoning.append(r)
            content.append(c)
            lps += lp
            if acc.trace_step is not None:
                acc.trace_steps.append(acc.trace_step)
            if out.finish_reason:
                return "".join(reasoning), "".join(content), lps, acc.finish_reason(out.finish_reason)
    finally:
        watch.cancel()


async def stream(req, ids, queue, acc, rid, created, chat, lp_fmt, model_name):
    """SSE chunks in OpenAI's shape: role first, deltas, finish, optional usage, [DONE]."""
    base = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model_name,
    }
    extra = {"usage": None} if req.include_usage else {}
    offset = 0  # characters streamed so far: completions' logprobs.text_offset

    def chunk(delta_or_text, lps=None, finish=None, trace=None):
        choice = {
            "index": 0,
            ("delta" if chat else "text"): delta_or_text,
            "logprobs": lp_fmt(lps, offset) if lps else None,
            "finish_reason": finish,
        }
        if trace is not None:
            choice["sparse_trace"] = trace
        return sse({**base, "choices": [choice], **extra})

    header = acc.tracer.header if acc.tracer is not None else None  # sparse_trace: with the first chunk
    if chat:
        yield chunk({"role": "assistant", "content": ""}, trace=header)
    elif header is not None:
        yield chunk("", trace=header)
    while True:
        kind, out = await queue.get()
        if kind in ("error", "timeout"):
            yield sse(error_body(out, "server_error", code="timeout" if kind == "timeout" else None))
            break
        r, c, lps = acc.add(out)
        tr = acc.trace_step  # every token's step goes out, with its text or in a chunk of its own
        if chat:
            delta = {k: v for k, v in (("reasoning_content", r), ("content", c)) if v}
            if delta or lps or tr:
                yield chunk(delta, lps, trace=tr)
            for d in acc.tool_deltas:  # OpenAI's shape: one call's id and name first, then its arguments
                yield chunk({"tool_calls": [d]})
        elif c or lps or tr:
            yield chunk(c, lps, trace=tr)
            offset += len(c)
        if out.finish_reason:
            yield chunk({} if chat else "", finish=acc.finish_reason(out.finish_reason))
            if req.include_usage:
                yield sse({**base, "choices": [], "usage": acc.usage(len(ids))})
            break
    yield "data: [DONE]\n\n"
