"""The prompt cache's routes: /v1/cache/save (prefill a prompt and keep its KV in the
--prompt-cache folder) and DELETE /v1/cache, over the request path (service.py)
and the server state's cache methods."""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from starlette.concurrency import run_in_threadpool

from .protocol import APIError, validate
from .schema import ERRORS, CacheCleared, CacheSaved, ChatCompletionRequest, CompletionRequest
from .service import Service


def add_routes(app: FastAPI, core: Service) -> None:
    state = core.state

    @app.post("/v1/cache/save", dependencies=[Depends(core.ready)], responses={200: {"model": CacheSaved}, **ERRORS})
    async def cache_save(request: Request):
        """Prefills a prompt (a completions body's `prompt`) or a conversation (a chat body's
        `messages`, with its `tools` and `chat_template_kwargs`) and waits until its KV is in
        the --prompt-cache folder; the body's kv_dtype and sparse_prefill settings pick the
        entry as they would for a request. Only whole 512-token chunks are kept (their reuse
        is bit-identical)."""
        if not state.keeps_prompt_cache:
            raise APIError(400, "this server keeps no prompt cache on disk (start it with --prompt-cache DIR)")
        try:
            data = await request.json()
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        chat = "messages" in data
        data = {**data, "max_tokens": 1, "temperature": 0.0, "stream": False}
        body = validate(ChatCompletionRequest if chat else CompletionRequest, data)
        req, [ids], [params], _, _, images = await core.prepare(body, chat)
        handle, queue = core.submit(req, [ids], [params], None, images)
        if queue is None:
            return handle
        try:
            while True:
                _, kind, payload = await queue.get()
                if kind != "token":
                    raise APIError(500 if kind == "error" else 504, str(payload), type="server_error")
                if payload.finish_reason:
                    break
        finally:
            state.cancel(handle[:1])
        saved = await run_in_threadpool(state.saved_tokens, ids, req.kv_dtype, req.sparse, images)
        return {"object": "cache.save", "prompt_tokens": len(ids), "saved_tokens": saved}

    @app.delete("/v1/cache", dependencies=[Depends(core.ready)], responses={200: {"model": CacheCleared}, **ERRORS})
    async def cache_clear(request: Request):
        """Drops every prefix-cache entry: those in memory and this model's files in the
        --prompt-cache folder."""
        entries, files = await run_in_threadpool(state.clear_prompt_cache)
        return {"object": "cache.cleared", "entries": entries, "files": files}
