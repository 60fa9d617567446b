"""The OpenAI-compatible HTTP server: FastAPI routes over the engine thread.

JSON, chat templating and tokenization live here; the engine (sparrow.engine.engine) sees
token ids and typed settings. uvicorn starts serving at once (/health answers 503) while the
model loads and warms up in a background thread.
"""

from __future__ import annotations

import hmac
import json
import os
import signal
import sys
import threading
import traceback

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..config import rope_scaling_from_flags
from ..engine.engine import Engine
from ..engine.speculative import check_mtp
from ..errors import SparrowError
from ..params import SpeculativeParams
from ..request import speculative_from_flags
from ..state.budget import format_size, parse_size
from ..state.disk import prepare_folder
from ..state.prefix import check_disk_setting, prefix_key
from ..vision.media import MAX_PIXELS_PER_REQUEST, MediaRules
from ..vision.preprocess import image_salt
from . import (
    anthropic_api,
    cache_api,
    completions_api,
    docs_page,
    responses_api,
    tokenize_api,
    tokenizer_info,
    web_ui,
)
from .limits import BODY_TIMEOUT, HEADER_TIMEOUT, BodyLimit, http_protocol
from .metrics import Metrics
from .protocol import (
    APIError,
    error_body,
    now,
    validation_error,
)
from .schema import (
    ERRORS,
    ModelCard,
    ModelList,
    openapi,
)
from .service import Service

ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/models/{model}",
    "/v1/cache/save",
    "/v1/cache",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
)
PUBLIC = ("/health", "/openapi.json", docs_page.PAGE, *docs_page.ASSETS)  # answered without the API key
LOADING_RETRY_AFTER = 5  # seconds: what a 503 while the model loads asks clients to wait


def _endpoint(path: str) -> str:
    """The metrics label of a request path: a route, never the model id a client wrote."""
    if path in ENDPOINTS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


def check_api_key(api_key: str | None) -> None:
    """An empty key would compare equal to a missing Authorization header's empty token."""
    if api_key is not None and not api_key.strip():
        raise SparrowError("--api-key is empty: give a key, or leave the option out to serve without one")


class ServerState:
    def __init__(
        self,
        api_key: str | None = None,
        max_batch: int = 16,
        allowed_local_media_path: str | None = None,
        max_images_per_request: int | None = None,
        max_image_bytes: int | None = None,
        max_pixels_per_request: int | None = MAX_PIXELS_PER_REQUEST,
        metrics_public: bool = False,
        special_tokens_in_content: bool = False,
        body_timeout: float | None = BODY_TIMEOUT,
        prompt_cache: str | None = None,
        prompt_cache_size: int | None = None,
        web_ui: bool = True,
        speculative: SpeculativeParams | None = None,
        draft_model: str | None = None,
        **engine_options,
    ):
        """engine_options: Engine's kv_budget, max_queue, prefix_cache, timeout. Images: file://
        URLs only under allowed_local_media_path, each file at most max_image_bytes (None:
        vision.media's default); at most max_images_per_request (None: the API's default) per
        request, holding at most max_pixels_per_request pixels together (None: no limit).
        metrics_public: /metrics answers without the API key. special_tokens_in_content: chat
        content may write special tokens (trusted clients only). body_timeout: seconds for a
        request body to arrive (None: no limit). prompt_cache: a folder that keeps prompts' KV
        across restarts (engine/disk_cache.py), at most prompt_cache_size bytes (None: its
        default). speculative: the speculative decoding of requests that do not say;
        draft_model: the draft model requests may ask for (speculative 'draft'). web_ui: the chat
        page at / (web_ui.py)."""
        check_api_key(api_key)
        self.speculative, self.draft_model = speculative, draft_model
        self.prompt_cache, self.prompt_cache_size = prompt_cache, prompt_cache_size
        if prompt_cache is not None:  # a bad setting fails at start, not after the model loads
            check_disk_setting(engine_options.get("prefix_cache", True), True)
            prepare_folder(prompt_cache)
        self.allowed_local_media_path = allowed_local_media_path
        self.max_images_per_request = max_images_per_request
        self.max_image_bytes = max_image_bytes
        self.max_pixels_per_request = max_pixels_per_request
        # the prompt builder's image rules (file:// parts are read by local_media.py first)
        self.media = MediaRules(
            allowed_local_media_path, False, max_images_per_request, max_image_bytes, max_pixels_per_request
        )
        self.metrics_public = metrics_public
        self.web_ui = web_ui
        self.special_tokens_in_content = special_tokens_in_content
        self.body_timeout = body_timeout
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
        if self.draft_model is not None:  # loaded now: no request waits for it, a bad path fails the start
            llm.draft_llm(self.draft_model)
        if self.speculative is not None and self.speculative.method == "mtp":  # a model without one fails the start
            check_mtp(llm.model)
        self.aliases = {llm.name, os.path.splitext(llm.name)[0]}
        self.created = now()
        disk = None
        if self.prompt_cache is not None:
            from ..api import open_disk_cache

            runner = self.engine_options.get("runner") or llm.runner  # the chunk its entries are cut at
            disk = open_disk_cache(llm, self.prompt_cache, self.prompt_cache_size, runner.prefill_chunk)
        self.engine = Engine(
            llm.handle, max_batch=self.max_batch, metrics=self.metrics, disk_cache=disk, **self.engine_options
        )
        self.engine.start(warmup=warmup, on_ready=self._ready, on_warm=on_warm)

    def _ready(self) -> None:
        self.ready = self.metrics.ready = True

    # ------------------------------------------------------------------ what the routes ask of the engine
    @property
    def kv_budget(self) -> int:
        """The KV budget in bytes."""
        return self.engine.pool.budget

    @property
    def keeps_prompt_cache(self) -> bool:
        """Whether prompts' KV is kept on disk (--prompt-cache)."""
        return self.engine.prefix.disk is not None

    def cancel(self, handles) -> None:
        for h in handles:
            self.engine.cancel(h)  # no-op once finished

    def saved_tokens(self, ids, kv_dtype, sparse, images) -> int:
        """Waits for the disk cache's writes, then how many of the prompt's positions its folder
        holds (0 when the write failed: the log says why). Blocking: run it in a thread."""
        disk = self.engine.prefix.disk
        disk.flush()
        key = prefix_key(kv_dtype or self.llm.kv_dtype, sparse, image_salt(images), bool(images))
        if key is None:
            return 0
        return disk.best(key, np.append(ids, -1), self.engine.runner.prefill_chunk)[1]

    def clear_prompt_cache(self) -> tuple[int, int]:
        """Drops every prefix-cache entry, in memory and on disk -> (entries, files) dropped.
        Blocking: run it in a thread."""
        prefix = self.engine.prefix
        entries = len(prefix)
        prefix.clear()
        return entries, prefix.disk.clear() if prefix.disk is not None else 0

    def require_ready(self) -> None:
        if not self.ready:
            raise APIError(
                503,
                self.load_error or "the model is still loading",
                type="server_error",
                code="model_not_ready",
                headers={"Retry-After": str(LOADING_RETRY_AFTER)},
            )

    def authorized(self, headers) -> bool:
        """headers: an ASGI scope's (name, value) byte pairs."""
        if self.api_key is None:
            return True
        header = next((v for k, v in headers if k == b"authorization"), b"")
        token = header[7:] if header[:7].lower() == b"bearer " else b""
        if not token:  # Anthropic's clients send the key as x-api-key
            token = next((v for k, v in headers if k == b"x-api-key"), b"")
        return hmac.compare_digest(token, self.api_key.encode())  # bytes as sent: a non-ASCII key matches too


class _Auth:
    """The API key, checked before anything reads the body: a client without the key gets 401
    whatever it sends (a malformed or oversized body included), and costs no body read. Pure
    ASGI, outside BodyLimit."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self._public(scope["path"]) or self.state.authorized(scope["headers"]):
            return await self.app(scope, receive, send)
        message = "invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')"
        if scope["path"].startswith("/v1/messages"):  # Anthropic's error shape on Anthropic's API
            body = json.dumps(anthropic_api.error_body(message, 401)).encode()
        else:
            body = json.dumps(error_body(message, code="invalid_api_key")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _public(self, path: str) -> bool:
        if self.state.web_ui and (path == web_ui.PAGE or path in web_ui.ASSETS):  # the page asks for the key
            return True
        return path in PUBLIC or (path == "/metrics" and self.state.metrics_public)


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
            self.metrics.request(_endpoint(path), status[0] or 500)


def create_app(state: ServerState) -> FastAPI:
    # /openapi.json from schema.py; /docs is sparrow's own page (docs_page.py), not FastAPI's CDN one
    app = FastAPI(title="sparrow", version=__version__, redoc_url=None, docs_url=None)
    app.openapi = lambda: openapi(app)
    app.state.sparrow = state
    metrics = state.metrics

    # outermost last: _Guard (counts every answer), _Auth (the key before any body is read), BodyLimit
    app.add_middleware(BodyLimit, timeout=state.body_timeout)
    app.add_middleware(_Auth, state=state)
    app.add_middleware(_Guard, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        err = validation_error(list(e.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        if request.url.path.startswith("/v1/messages"):  # Anthropic's API answers in Anthropic's shape
            return JSONResponse(anthropic_api.error_body(str(e.detail), e.status_code), status_code=e.status_code)
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    service = Service(state)  # the request path (service.py), shared with the routes in their own modules

    if state.web_ui:
        web_ui.add_routes(app)
    docs_page.add_routes(app)
    tokenizer_info.add_routes(app, state)

    @app.get("/health")
    async def health():
        if not state.ready:
            return JSONResponse(
                {"status": "error" if state.load_error else "loading", "error": state.load_error},
                status_code=503,
                headers={"Retry-After": str(LOADING_RETRY_AFTER)},
            )
        return {"status": "ok", "model": state.llm.name}

    @app.get("/metrics")  # needs the API key unless --metrics-public (_Auth)
    async def get_metrics():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        llm = state.llm
        return {
            "id": llm.name,
            "object": "model",
            "created": state.created,
            "owned_by": "sparrow",
            "max_model_len": llm.ctx,
            "activations": llm.model.activations,
            "activations_why": llm.activations_why,
        }

    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **ERRORS})
    async def models(request: Request):
        state.require_ready()
        return {"object": "list", "data": [model_card()]}

    # `:path`: a model id may hold a slash (org/name), as OpenAI's and Hugging Face's do
    @app.get("/v1/models/{model:path}", response_model=None, responses={200: {"model": ModelCard}, **ERRORS})
    async def model(request: Request, model: str):
        """One model (the client's `models.retrieve`): this server's, by its name or file stem."""
        state.require_ready()
        service.check_model(model)
        return model_card()

    tokenize_api.add_routes(app, service)
    completions_api.add_routes(app, service)
    cache_api.add_routes(app, service)

    anthropic_api.add_routes(app, service)
    responses_api.add_routes(app, service)

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
        max_image_bytes=parse_size(args.max_image_file_size) if getattr(args, "max_image_file_size", None) else None,
        max_pixels_per_request=_limit(getattr(args, "max_pixels_per_request", MAX_PIXELS_PER_REQUEST)),
        metrics_public=getattr(args, "metrics_public", False),
        web_ui=not getattr(args, "no_web_ui", False),
        special_tokens_in_content=getattr(args, "allow_special_tokens_in_content", False),
        body_timeout=_limit(getattr(args, "body_timeout", BODY_TIMEOUT)),
        prompt_cache=getattr(args, "prompt_cache", None),
        speculative=speculative_from_flags(args, serve=True),
        draft_model=getattr(args, "draft_model", None),
        prompt_cache_size=parse_size(size, "--prompt-cache-size")
        if (size := getattr(args, "prompt_cache_size", None))
        else None,
    )


def _limit(value):
    """A limit from the command line: 0 means none."""
    return None if value == 0 else value


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
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=3,
            http=http_protocol(_limit(getattr(args, "header_timeout", HEADER_TIMEOUT))),
        )
    )

    def load():
        try:
            llm = api.load(**options)
            state.attach(llm, on_warm=_warm_line)
            kv = format_size(state.kv_budget)
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
    from ..kernels.runtime import announce_compiles

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
