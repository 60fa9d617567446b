"""The OpenAI-compatible HTTP server: FastAPI routes over the engine thread.

JSON, chat templating and tokenization live here; the engine (sparrow.engine.engine) sees
token ids and typed settings. uvicorn starts serving at once (/health answers 503) while the
model loads and warms up in a background thread.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import signal
import sys
import threading
import traceback

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..config import rope_scaling_from_flags
from ..engine.engine import Engine, EngineBusy
from ..engine.kv_budget import format_size, parse_size
from ..engine.sequence import check_context
from ..errors import ContextLengthError, SparrowError
from ..structured import StructuredError
from ..vision.preprocess import image_salt
from .limits import BodyLimit
from .metrics import Metrics
from .protocol import (
    DEFAULT_MAX_TOKENS,
    APIError,
    ReasoningSplitter,
    chat_logprobs,
    chat_request,
    completion_logprobs,
    completion_request,
    error_body,
    new_id,
    now,
    starts_in_reasoning,
    validate,
    validation_error,
)
from .schema import (
    ERRORS,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    openapi,
)
from .streaming import Accumulator, SSEResponse, collect, stream

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/tokenize", "/detokenize")


class ServerState:
    def __init__(
        self,
        api_key: str | None = None,
        max_batch: int = 16,
        allowed_local_media_path: str | None = None,
        max_images_per_request: int | None = None,
        **engine_options,
    ):
        """engine_options: Engine's kv_budget, max_queue, prefix_cache, timeout. Images: file://
        URLs only under allowed_local_media_path; at most max_images_per_request (None: the
        API's default) per request."""
        self.allowed_local_media_path = allowed_local_media_path
        self.max_images_per_request = max_images_per_request
        self.api_key = api_key
        self.max_batch = max_batch
        self.engine_options = engine_options
        self.metrics = Metrics()
        self.llm = None
        self.engine: Engine | None = None
        self.ready = False
        self.load_error: str | None = None

    def attach(self, llm, warmup: bool = True, on_warm=None) -> None:
        """Starts the engine on a loaded model; ready once its warm-up (engine/warmup.py) has
        run. on_warm(name, i, n, seconds) follows each warmed path."""
        self.llm = llm
        self.aliases = {llm.name, os.path.splitext(llm.name)[0]}
        self.created = now()
        self.engine = Engine(llm, max_batch=self.max_batch, metrics=self.metrics, **self.engine_options)
        self.engine.start(warmup=warmup, on_ready=self._ready, on_warm=on_warm)

    def _ready(self) -> None:
        self.ready = self.metrics.ready = True

    def require_ready(self) -> None:
        if not self.ready:
            raise APIError(
                503, self.load_error or "the model is still loading", type="server_error", code="model_not_ready"
            )


class _Guard:
    """Counts responses by endpoint and status, and turns any escaped exception into a 500 here, so
    it never reaches uvicorn (which would drop the keep-alive connection). Pure ASGI: streaming and
    disconnects pass untouched."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [0]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception:
            traceback.print_exc(file=sys.stderr)
            if not status[0]:
                body = json.dumps(error_body("internal server error", "server_error")).encode()
                await send_status(
                    {
                        "type": "http.response.start",
                        "status": 500,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
        finally:
            path = scope.get("path", "")
            self.metrics.request(path if path in ENDPOINTS else "other", status[0] or 500)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="sparrow", version=__version__, redoc_url=None)  # /openapi.json and /docs from schema.py
    app.openapi = lambda: openapi(app)
    app.state.sparrow = state
    metrics = state.metrics

    app.add_middleware(BodyLimit)  # inside _Guard, which counts its 413s
    app.add_middleware(_Guard, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        err = validation_error(list(e.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    def auth(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), state.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")

    def check_model(name) -> None:
        if name is not None and not isinstance(name, str):
            raise APIError(400, "'model' must be a string", param="model")
        if name is not None and name not in state.aliases:
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves '{state.llm.name}'",
                param="model",
                code="model_not_found",
            )

    @app.get("/health")
    async def health():
        if not state.ready:
            return JSONResponse(
                {"status": "error" if state.load_error else "loading", "error": state.load_error}, status_code=503
            )
        return {"status": "ok", "model": state.llm.name}

    @app.get("/metrics")
    async def get_metrics():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def ready(request: Request) -> None:
        """Key, then readiness: run before FastAPI validates a body (a malformed JSON body comes first)."""
        auth(request)
        state.require_ready()

    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **ERRORS})
    async def models(request: Request):
        auth(request)
        state.require_ready()
        llm = state.llm
        return {
            "object": "list",
            "data": [
                {
                    "id": llm.name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "sparrow",
                    "max_model_len": llm.ctx,
                    "activations": llm.model.activations,
                    "activations_why": llm.activations_why,
                }
            ],
        }

    @app.post("/tokenize", dependencies=[Depends(ready)], responses={200: {"model": TokenizeResponse}, **ERRORS})
    async def tokenize(request: Request, body: TokenizeRequest):
        llm = state.llm
        check_model(body.model)
        try:
            if body.messages is not None:
                keys = ("messages", "chat_template_kwargs", "tools", "tool_choice")
                chat = body.model_dump(include=set(keys), by_alias=True, exclude_unset=True)  # as sent: no nulls
                req = chat_request(validate(ChatCompletionRequest, chat), images=llm.vision is not None)
                ids = (await run_in_threadpool(chat_prompt, llm, req))[0]  # image pads expanded
            elif body.prompt is not None:
                ids = await run_in_threadpool(llm.tokenizer.encode, body.prompt, body.add_special_tokens)
            else:
                raise APIError(400, "send 'prompt' (a string) or 'messages'", param="prompt")
        except SparrowError as e:
            raise APIError(400, str(e)) from None
        out = {"count": len(ids), "max_model_len": llm.ctx, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [llm.tokenizer.id_to_token(i) for i in ids]
        return out

    @app.post("/detokenize", dependencies=[Depends(ready)], responses={200: {"model": DetokenizeResponse}, **ERRORS})
    async def detokenize(request: Request, body: DetokenizeRequest):
        llm = state.llm
        ids = body.tokens
        check_model(body.model)
        if any(not 0 <= i < llm.tokenizer.vocab_size for i in ids):
            raise APIError(400, f"token ids must be in [0, {llm.tokenizer.vocab_size})", param="tokens")
        return {"prompt": llm.tokenizer.decode(ids)}

    @app.post(
        "/v1/chat/completions",
        dependencies=[Depends(ready)],
        response_model=None,
        responses={200: {"model": ChatCompletion}, **ERRORS},
    )
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await _generate(request, body, chat=True)

    @app.post(
        "/v1/completions",
        dependencies=[Depends(ready)],
        response_model=None,
        responses={200: {"model": Completion}, **ERRORS},
    )
    async def completions(request: Request, body: CompletionRequest):
        return await _generate(request, body, chat=False)

    async def _prepare(body, chat: bool):
        llm = state.llm
        defaults = llm.checkpoint.generation_defaults
        takes_images = llm.vision is not None
        req = chat_request(body, defaults, takes_images) if chat else completion_request(body, defaults)
        check_model(req.model)
        param = "messages" if chat else "prompt"
        images = []
        try:
            if chat:
                ids, images = await run_in_threadpool(chat_prompt, llm, req)
            elif isinstance(req.prompt, str):
                ids = await run_in_threadpool(llm.prompt_ids, req.prompt)
            else:
                ids = req.prompt
                if any(not 0 <= i < llm.config.vocab_size for i in ids):
                    raise APIError(400, f"token ids must be in [0, {llm.config.vocab_size})", param="prompt")
            if not ids:
                raise APIError(400, "the prompt is empty", param=param)
            max_tokens = req.max_tokens or max(1, min(DEFAULT_MAX_TOKENS, llm.ctx - len(ids)))
            req.params.max_tokens = max_tokens
            check_context(len(ids), max_tokens, llm.ctx)
            req.params.validate()
        except ContextLengthError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except SparrowError as e:
            raise APIError(400, str(e), param=param) from None
        splitter = None
        # Constrained output is the answer from its first token: nothing of it is reasoning.
        if chat and llm.tokenizer.token_to_id(ReasoningSplitter.CLOSE) is not None and not req.structured.constrained:
            splitter = ReasoningSplitter(starts_in_reasoning(llm.tokenizer.decode(ids[-16:])))
        try:  # compiling a grammar takes ~1.4 ms; the first for a tokenizer also indexes it (0.35-1.3 s)
            constraint = await run_in_threadpool(
                req.structured.constraint, llm.tokenizer, llm.config.vocab_size, llm.tool_format
            )
        except StructuredError as e:
            raise APIError(400, str(e), param=e.param) from None
        return req, ids, splitter, constraint, images

    def chat_prompt(llm, req):
        """(ids with image pads expanded, preprocessed images) under the server's media rules."""
        tools = req.structured.template_tools
        return llm.prompt_and_images(
            req.messages,
            True,
            None,
            req.chat_template_kwargs,
            "",
            tools,
            allowed_local_path=state.allowed_local_media_path,
            local_files=False,
            max_images=state.max_images_per_request,
        )

    async def _generate(request: Request, body, chat: bool):
        req, ids, splitter, constraint, images = await _prepare(body, chat)
        llm, engine = state.llm, state.engine
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(kind, payload):  # engine thread
            loop.call_soon_threadsafe(queue.put_nowait, (kind, payload))

        try:
            salt = image_salt(images)  # the prefix cache shares KV only between prompts with the same images
            handle = engine.submit(
                ids, req.params, req.sparse, emit, req.kv_dtype, constraint, images=images, cache_salt=salt
            )
        except EngineBusy as e:  # OpenAI clients retry a 503 after Retry-After
            return JSONResponse(
                error_body(str(e), "server_error", code="server_busy"),
                status_code=503,
                headers={"Retry-After": str(e.retry_after)},
            )
        except SparrowError as e:  # prompt + max_tokens exceed the whole KV budget
            raise APIError(400, str(e), param="max_tokens", code="kv_budget_exceeded") from None
        acc = Accumulator(
            llm, splitter, req.logprobs, req.params.stop_token_ids, req.structured.parser(llm.tool_format)
        )
        rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
        obj = "chat.completion" if chat else "text_completion"
        lp_fmt = (
            (lambda outs, offset=0: chat_logprobs(llm.tokenizer, outs))
            if chat
            else (lambda outs, offset=0: completion_logprobs(llm.tokenizer, outs, offset))
        )

        if req.stream:
            return SSEResponse(
                stream(req, ids, queue, acc, rid, created, chat, lp_fmt, llm.name), lambda: engine.cancel(handle)
            )
        try:
            result = await collect(request, queue, acc)
        finally:
            engine.cancel(handle)  # no-op once finished
        if result is None:
            return JSONResponse(error_body("client disconnected"), status_code=499)
        reasoning, content, lps, finish = result
        lp = lp_fmt(lps) if req.logprobs else None
        if chat:
            msg = {"role": "assistant", "content": content}
            if splitter is not None and reasoning:
                msg["reasoning_content"] = reasoning
            if acc.tool_calls:
                msg["content"] = content or None
                msg["tool_calls"] = acc.tool_calls
            choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": content, "logprobs": lp, "finish_reason": finish}
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": llm.name,
            "choices": [choice],
            "usage": acc.usage(len(ids)),
        }

    return app


def state_from_args(args) -> ServerState:
    """The server's settings from `sparrow serve`'s arguments (also each Ray Serve replica's)."""
    budget = getattr(args, "kv_budget", None)
    return ServerState(
        api_key=args.api_key,
        max_batch=args.max_batch,
        kv_budget=parse_size(budget) if budget else None,
        max_queue=getattr(args, "max_queue", None),
        prefix_cache=not getattr(args, "no_prefix_cache", False),
        timeout=getattr(args, "request_timeout", None),
        allowed_local_media_path=getattr(args, "allowed_local_media_path", None),
        max_images_per_request=getattr(args, "max_images_per_request", None),
    )


def load_options(args) -> dict:
    """api.load's keywords from `sparrow serve`'s model arguments."""
    return dict(
        path=args.model,
        kv_dtype=args.kv_dtype,
        threads=args.threads,
        quantize=args.quantize,
        ctx=args.ctx,
        activations=getattr(args, "activations", None),
        mmproj=getattr(args, "mmproj", None),
        rope_scaling=rope_scaling_from_flags(
            getattr(args, "rope_scaling", None), getattr(args, "rope_scale", None), getattr(args, "yarn_orig_ctx", None)
        ),
    )


def _warm_line(name: str, i: int, n: int, seconds: float) -> None:
    print(f"sparrow: warm-up {i}/{n}: {name} in {seconds:.1f} s", file=sys.stderr, flush=True)


def serve(args) -> None:
    """`sparrow serve`: binds at once, loads the model in the background, serves until Ctrl-C."""
    import uvicorn

    from .. import api

    options = load_options(args)  # its flags checked before the port is bound
    state = state_from_args(args)
    app = create_app(state)
    grace = getattr(args, "drain_timeout", 30.0)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM and not self.should_exit and not getattr(self, "draining", False):
                # Drain: new requests get 503, those in flight get `grace` seconds to finish; then
                # what is left fails, its streams end, and the process exits with status 0.
                self.draining = True
                threading.Thread(target=self._drain, name="sparrow-drain", daemon=True).start()
                return
            # Ctrl-C (or a second SIGTERM): fail in-flight generations so shutdown is not held up.
            if state.engine is not None:
                state.engine.stop(timeout=0)
            super().handle_exit(sig, frame)

        def _drain(self):
            if state.engine is not None:
                done = state.engine.drain(grace)
                left = "all requests finished" if done else "grace period over; cancelling the rest"
                print(f"sparrow: SIGTERM: {left}", file=sys.stderr, flush=True)
                state.engine.stop(timeout=5)
            self.should_exit = True

    server = Server(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level="warning", access_log=False, timeout_graceful_shutdown=3
        )
    )

    def load():
        try:
            llm = api.load(**options)
            state.attach(llm, on_warm=_warm_line)
            kv = format_size(state.engine.pool.budget)
            print(
                f"sparrow: {llm.name} loaded in {llm.load_seconds:.1f} s ({llm.threads} threads, ctx {llm.ctx}, "
                f"KV budget {kv}, activations {llm.model.activations}: {llm.activations_why})",
                file=sys.stderr,
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - any load failure ends the server with one line
            state.load_error = f"model failed to load: {e}"
            server.should_exit = True

    print(f"sparrow: serving on http://{args.host}:{args.port} (model loading)", file=sys.stderr, flush=True)
    from ..engine.warmup import SERVER_PATHS
    from ..kernels import announce_compiles

    announce_compiles(lambda line: print(line, file=sys.stderr, flush=True))
    print(
        f"sparrow: before serving, every path a request may take runs once ({', '.join(SERVER_PATHS)}), "
        "so that no request compiles kernels while others stream (cold cache: under 2 min on 2 cores)",
        file=sys.stderr,
        flush=True,
    )
    threading.Thread(target=load, name="sparrow-load", daemon=True).start()
    try:
        server.run()
    finally:
        if state.engine is not None:
            state.engine.stop(timeout=2)
    if state.load_error:
        raise SparrowError(state.load_error)
