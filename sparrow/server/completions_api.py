"""OpenAI's completions routes: /v1/chat/completions and /v1/completions, whole answers and SSE
streams, over the request path (service.py) and the engine's outputs (streaming.py)."""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from .protocol import (
    APIError,
    ReasoningSplitter,
    chat_logprobs,
    completion_logprobs,
    error_body,
    new_id,
    now,
    usage,
)
from .schema import ERRORS, ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest
from .service import Service
from .sparse_trace import Tracer
from .streaming import Accumulator, Choices, SSEResponse, collect, sse, stream


def add_routes(app: FastAPI, service: Service) -> None:
    @app.post(
        "/v1/chat/completions",
        dependencies=[Depends(service.ready)],
        response_model=None,
        responses={200: {"model": ChatCompletion}, **ERRORS},
    )
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await _generate(service, request, body, chat=True)

    @app.post(
        "/v1/completions",
        dependencies=[Depends(service.ready)],
        response_model=None,
        responses={200: {"model": Completion}, **ERRORS},
    )
    async def completions(request: Request, body: CompletionRequest):
        return await _generate(service, request, body, chat=False)


async def _generate(service: Service, request: Request, body, chat: bool):
    req, prompts, params, in_reasoning, constraints, images = await service.prepare(body, chat)
    state = service.state
    llm, engine = state.llm, state.engine
    tok = llm.tokenizer
    echo = [p if isinstance(p, str) else tok.decode(p) for p in req.prompts] if req.echo else None
    scoring = req.echo and req.logprobs  # the prompt tokens' logprobs, from a prefill of every position
    if req.max_tokens == 0 and not scoring:  # the prompt was checked; nothing to run
        return _no_tokens(service, req, prompts, echo)
    if len(prompts) > 1 and constraints is not None:  # completions take no grammar; kept general
        raise APIError(400, "a grammar applies to one prompt", param="prompt")
    handles, queue = service.submit(req, prompts, params, constraints, images, scoring)
    if queue is None:
        return handles

    def cancel():
        for h in handles:
            engine.cancel(h)  # no-op once finished

    tool_parser = req.structured.parser
    accs = [
        Accumulator(
            llm,
            None if in_reasoning is None else ReasoningSplitter(in_reasoning),
            req.logprobs,
            req.params.stop_token_ids,
            tool_parser(llm.tool_format),
            chat,
            Tracer(llm, req.sparse, prompts[0]) if req.sparse_trace and i == 0 else None,
        )
        for i in range(len(prompts) * req.n)
    ]
    choices = Choices(accs, req.n, [len(ids) for ids in prompts])
    rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
    obj = "chat.completion" if chat else "text_completion"
    lp_fmt = (
        (lambda outs, offset=0, prompt=(): chat_logprobs(tok, outs))
        if chat
        else (lambda outs, offset=0, prompt=(): completion_logprobs(tok, outs, offset, prompt))
    )

    if req.stream:
        return SSEResponse(stream(req, choices, queue, rid, created, chat, lp_fmt, llm.name, echo), cancel)
    try:
        results = await collect(request, queue, choices)
    finally:
        cancel()
    if results is None:
        return JSONResponse(error_body("client disconnected"), status_code=499)
    out = []
    for i, (reasoning, content, lps, finish) in enumerate(results):
        acc = accs[i]
        if chat:
            lp = lp_fmt(lps) if req.logprobs else None
            msg = {"role": "assistant", "content": content, "refusal": None}  # refusal: required by OpenAI
            if in_reasoning is not None and reasoning:
                msg["reasoning_content"] = reasoning
            if acc.tool_calls:
                msg["content"] = content or None
                msg["tool_calls"] = acc.tool_calls
            out.append({"index": i, "message": msg, "logprobs": lp, "finish_reason": finish})
        else:
            p = i // req.n
            prefix = echo[p] if echo is not None else ""
            prompt_lps = (choices.prompt_logprobs[p] or ()) if scoring else ()
            lp = lp_fmt(lps, 0, prompt_lps) if req.logprobs else None
            out.append({"index": i, "text": prefix + content, "logprobs": lp, "finish_reason": finish})
        if acc.tracer is not None:
            out[-1]["sparse_trace"] = {**acc.tracer.header, "steps": acc.trace_steps}
    return {"id": rid, "object": obj, "created": created, "model": llm.name, "choices": out,
            "usage": choices.usage()}  # fmt: skip


def _no_tokens(service: Service, req, prompts, echo):
    """A completion of max_tokens 0 (not scoring its prompt): each choice's text is empty (or
    its echoed prompt), finish_reason "length", whole or streamed."""
    state = service.state
    rid, created = new_id("cmpl"), now()
    tok = state.llm.tokenizer
    choices = []
    for i in range(len(prompts) * req.n):
        text = echo[i // req.n] if echo is not None else ""
        lp = completion_logprobs(tok, []) if req.logprobs else None
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": "length"})
    counts = {**usage(sum(len(ids) for ids in prompts), 0), "prompt_tokens_details": {"cached_tokens": 0}}
    base = {"id": rid, "object": "text_completion", "created": created, "model": state.llm.name}
    if not req.stream:
        return {**base, "choices": choices, "usage": counts}

    async def events():
        extra = {"usage": None} if req.include_usage else {}
        for choice in choices:
            yield sse({**base, "choices": [choice], **extra})
        if req.include_usage:
            yield sse({**base, "choices": [], "usage": counts})
        yield "data: [DONE]\n\n"

    return SSEResponse(events(), lambda: None)
