"""vLLM's /tokenize and /detokenize: a prompt or a conversation (rendered by the one prompt
builder, image pads expanded) to token ids, and token ids back to text."""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from starlette.concurrency import run_in_threadpool

from ..errors import ContextLengthError, SparrowError
from . import prompt_size
from .protocol import APIError, chat_request, validate
from .schema import (
    ERRORS,
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from .service import Service


def add_routes(app: FastAPI, service: Service) -> None:
    @app.post(
        "/tokenize", dependencies=[Depends(service.ready)], responses={200: {"model": TokenizeResponse}, **ERRORS}
    )
    async def tokenize(request: Request, body: TokenizeRequest):
        llm = service.state.llm
        limit = max(llm.ctx, prompt_size.TOKENIZE_MAX)
        what = "/tokenize's limit of"
        service.check_model(body.model)
        try:
            if body.messages is not None:
                keys = ("messages", "chat_template_kwargs", "tools", "tool_choice")
                chat = body.model_dump(include=set(keys), by_alias=True, exclude_unset=True)  # as sent: no nulls
                req = chat_request(validate(ChatCompletionRequest, chat), images=llm.vision is not None)
                # a prompt may be counted past the context (vLLM's /tokenize counts it all), up to a bound
                await run_in_threadpool(service.check_chat_size, llm, req, 0, limit, what)
                ids = (await run_in_threadpool(service.chat_prompt, llm, req))[0]  # image pads expanded
            elif body.prompt is not None:
                await run_in_threadpool(prompt_size.check_text, llm.tokenizer, body.prompt, 0, limit, what)
                ids = await run_in_threadpool(llm.tokenizer.encode, body.prompt, body.add_special_tokens)
            else:
                raise APIError(400, "send 'prompt' (a string) or 'messages'", param="prompt")
        except ContextLengthError as e:
            param = "messages" if body.messages is not None else "prompt"
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except SparrowError as e:
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None
        out = {"count": len(ids), "max_model_len": llm.ctx, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [llm.tokenizer.id_to_token(i) for i in ids]
        return out

    @app.post(
        "/detokenize", dependencies=[Depends(service.ready)], responses={200: {"model": DetokenizeResponse}, **ERRORS}
    )
    async def detokenize(request: Request, body: DetokenizeRequest):
        llm = service.state.llm
        ids = body.tokens
        service.check_model(body.model)
        if any(not 0 <= i < llm.tokenizer.vocab_size for i in ids):
            raise APIError(400, f"token ids must be in [0, {llm.tokenizer.vocab_size})", param="tokens")
        return {"prompt": llm.tokenizer.decode(ids)}
