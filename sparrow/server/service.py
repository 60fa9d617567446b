"""The server's request path as one small service over the server state: a body checked,
tokenised (the one prompt builder, LLM.prompt_and_images) and turned into GenerationRequests
submitted to the engine. app.py's routes and the routes in their own modules (cache_api.py,
anthropic_api.py, responses_api.py through chat_runs.py) all go through it.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ..engine.engine import EngineBusy
from ..engine.sequence import check_context
from ..errors import ContextLengthError, SparrowError
from ..params import SpeculativeParams
from ..request import GenerationRequest, speculative_params
from ..structured import StructuredError
from ..vision.preprocess import image_salt
from . import local_media, prompt_size
from .protocol import (
    COMPLETION_MAX_TOKENS,
    DEFAULT_MAX_TOKENS,
    APIError,
    ReasoningSplitter,
    chat_request,
    completion_request,
    error_body,
    starts_in_reasoning,
)


class Service:
    """The request path over `state` (app.ServerState: the loaded model, the engine, the
    server's settings)."""

    def __init__(self, state):
        self.state = state

    def check_model(self, name) -> None:
        if name is not None and not isinstance(name, str):
            raise APIError(400, "'model' must be a string", param="model")
        if name is not None and name not in self.state.aliases:
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves '{self.state.llm.name}'",
                param="model",
                code="model_not_found",
            )

    def ready(self, request: Request) -> None:
        """Readiness (the key was checked by _Auth): run before FastAPI validates a body (a
        malformed JSON body comes first)."""
        self.state.require_ready()

    async def prepare(self, body, chat: bool):
        """The request checked and tokenized: (req, prompts [token ids each], their sampling
        params, the choices' reasoning splitter start (None: no splitter), the grammar states
        (per prompt, one per choice, or None), images)."""
        llm = self.state.llm
        defaults = llm.checkpoint.generation_defaults
        takes_images = llm.vision is not None
        req = chat_request(body, defaults, takes_images) if chat else completion_request(body, defaults)
        self.check_model(req.model)
        param = "messages" if chat else "prompt"
        images = []
        reserve = 1 if req.max_tokens is None else req.max_tokens  # the least the answer may take
        try:
            if chat:
                await run_in_threadpool(self.check_chat_size, llm, req, reserve)
                ids, images = await run_in_threadpool(self.chat_prompt, llm, req)
                prompts = [ids]
            else:
                prompts = []
                for p in req.prompts:
                    if isinstance(p, str):
                        await run_in_threadpool(prompt_size.check_text, llm.tokenizer, p, reserve, llm.ctx)
                        p = await run_in_threadpool(llm.prompt_ids, p)
                        if p:  # a batch stops at its first prompt that cannot fit, not after tokenising all
                            check_context(len(p), reserve, llm.ctx)
                    elif any(not 0 <= i < llm.config.vocab_size for i in p):
                        raise APIError(400, f"token ids must be in [0, {llm.config.vocab_size})", param="prompt")
                    prompts.append(p)
            params = []
            for ids in prompts:
                if not ids:
                    raise APIError(400, "the prompt is empty", param=param)
                max_tokens = req.max_tokens
                if max_tokens is None:
                    max_tokens = max(1, min(DEFAULT_MAX_TOKENS if chat else COMPLETION_MAX_TOKENS, llm.ctx - len(ids)))
                # scoring a prompt (echo + logprobs) with max_tokens 0 still runs it in the engine,
                # whose sequences hold at least one position past the prompt
                check_context(len(ids), max(1, max_tokens) if req.echo and req.logprobs else max_tokens, llm.ctx)
                # 0 generates nothing (_generate); SamplingParams keeps its minimum of 1
                params.append(replace(req.params, max_tokens=max(1, max_tokens)).validate())
            try:
                req.params.check_vocab(llm.config.vocab_size)
            except SparrowError as e:
                raise APIError(400, str(e), param="logit_bias") from None
        except ContextLengthError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except SparrowError as e:
            raise APIError(400, str(e), param=getattr(e, "param", None) or param) from None
        in_reasoning = None
        # Constrained output is the answer from its first token: nothing of it is reasoning.
        if chat and llm.tokenizer.token_to_id(ReasoningSplitter.CLOSE) is not None and not req.structured.constrained:
            in_reasoning = starts_in_reasoning(llm.tokenizer.decode(prompts[0][-16:]))

        def grammars():  # one state per choice
            make = req.structured.constraint
            first = make(llm.tokenizer, llm.config.vocab_size, llm.tool_format)
            if first is None:
                return None
            rest = [make(llm.tokenizer, llm.config.vocab_size, llm.tool_format) for _ in range(req.n - 1)]
            return [first, *rest]

        try:  # compiling a grammar takes ~1.4 ms; the first for a tokenizer also indexes it (0.35-1.3 s)
            constraints = await run_in_threadpool(grammars)
        except StructuredError as e:
            raise APIError(400, str(e), param=e.param) from None
        return req, prompts, params, in_reasoning, constraints, images

    def check_chat_size(self, llm, req, reserve: int, ctx: int | None = None, what: str = "the context length") -> None:
        """A conversation that cannot fit in ctx (None: the model's) with `reserve` tokens of
        answer is refused before it is tokenised whole (prompt_size.py)."""
        kwargs, ctx = req.chat_template_kwargs, llm.ctx if ctx is None else ctx
        tools = req.structured.template_tools
        prompt_size.check_chat(llm.tokenizer, req.messages, tools, kwargs, reserve, ctx, what)

    def chat_prompt(self, llm, req):
        """(ids with image pads expanded, preprocessed images) under the server's media rules."""
        tools = req.structured.template_tools
        max_images = self.state.max_images_per_request
        # file:// parts are read here, inside the allowed folder only (local_media.py): the vision
        # code gets their bytes and never opens a request's path
        messages = local_media.resolve(
            req.messages,
            self.state.allowed_local_media_path,
            self.state.max_image_bytes,
            llm.max_images if max_images is None else max_images,
        )
        return llm.prompt_and_images(
            messages,
            chat=True,
            chat_template_kwargs=req.chat_template_kwargs,
            tools=tools,
            media=self.state.media,
            special_tokens_in_content=self.state.special_tokens_in_content,
        )

    def speculative(self, req) -> SpeculativeParams | None:
        """The request's speculative settings: its own options over the server's default
        (request.speculative_params)."""
        o = req.speculative
        try:
            return speculative_params(
                None if o is None else o["speculative"],
                None if o is None else {k: v for k, v in o.items() if k != "speculative"},
                default=self.state.speculative,
                draft_model=self.state.draft_model,
                lenient=True,
            )
        except SparrowError as e:
            raise APIError(400, str(e), param="speculative") from None

    def submit(self, req, prompts, params, constraints, images, scoring: bool = False):
        """(the engine's handles, one per prompt, and the queue of their outputs: (prompt index,
        kind, payload)), or (the 503 response, None)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emitter(p):
            def emit(kind, payload):  # engine thread
                loop.call_soon_threadsafe(queue.put_nowait, (p, kind, payload))

            return emit

        salt = image_salt(images)  # the prefix cache shares KV only between prompts with the same images
        top = req.params.logprobs or 0
        handles = []
        # a bad setting is a 400 before anything is queued; a traced request decodes plainly
        spec = None if req.sparse_trace else self.speculative(req)
        try:
            for p, (ids, sampling) in enumerate(zip(prompts, params)):
                request = GenerationRequest(
                    ids,
                    sampling,
                    req.sparse,
                    spec,
                    req.kv_dtype,
                    constraints,
                    images,
                    n=req.n,
                    prompt_logprobs=top if scoring else None,
                    score_only=req.max_tokens == 0,
                    trace=req.sparse_trace,
                    cache_salt=salt,
                )
                handles.append(self.state.engine.submit(request, emitter(p)))
        except EngineBusy as e:  # OpenAI clients retry a 503 after Retry-After
            for h in handles:
                self.state.engine.cancel(h)
            busy = JSONResponse(
                error_body(str(e), "server_error", code="server_busy"),
                status_code=503,
                headers={"Retry-After": str(e.retry_after)},
            )
            return busy, None
        except SparrowError as e:  # prompt + max_tokens exceed the whole KV budget; n over the queue
            for h in handles:
                self.state.engine.cancel(h)
            param = getattr(e, "param", None) or "max_tokens"
            code = "kv_budget_exceeded" if param == "max_tokens" else None
            raise APIError(400, str(e), param=param, code=code) from None
        return handles, queue
