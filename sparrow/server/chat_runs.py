"""One chat generation driven by an API other than chat completions (Anthropic's Messages,
OpenAI's Responses): the same request path (a ChatCompletionRequest checked, tokenised and
submitted by service.py's Service.prepare and Service.submit) and the same Accumulator, so the
text, reasoning and tool calls at temperature 0 are the chat endpoint's; only the shape of the
answer differs.

app.py hands its request path over as a `Service`; each API module turns its own body into a
chat body, runs it here and writes the pieces in its own shape.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ..params import SPARSE_OPTIONS
from .protocol import APIError, ReasoningSplitter
from .schema import ChatCompletionRequest
from .service import Service
from .streaming import Accumulator, _failure


class Busy(Exception):
    """The engine's queue is full: retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: str):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Piece:
    reasoning: str
    content: str
    tool_deltas: list[dict]
    finish: str | None  # OpenAI's finish reason once the answer ended: stop, length, tool_calls


# sparrow's own chat fields that the Messages and Responses bodies may carry too (the SDKs' extra_body)
SPARROW_FIELDS = (
    "seed",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
    "kv_dtype",
    *SPARSE_OPTIONS,
    "speculative",
    "spec_tokens",
    "spec_ngram",
    "spec_sparse_k",
    "spec_sparse_select",
    "chat_template_kwargs",
)


@dataclass
class ChatRun:
    core: Service
    body: ChatCompletionRequest
    req: Any = None
    acc: Accumulator | None = None
    prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    reasoning: bool = False  # the model may write reasoning (a <think> template)
    _handles: list = field(default_factory=list)
    _queue: Any = None

    async def start(self) -> None:
        """Checks, tokenises and queues the request (an APIError or Busy when it cannot run)."""
        llm = self.core.state.llm
        req, prompts, params, in_reasoning, constraints, images = await self.core.prepare(self.body, True)
        handles, queue = self.core.submit(req, prompts, params, constraints, images)
        if queue is None:
            import json

            err = json.loads(handles.body)["error"]
            raise Busy(err["message"], handles.headers.get("retry-after", "1"))
        self.req, self._handles, self._queue = req, handles, queue
        self.prompt_tokens = len(prompts[0])
        self.reasoning = in_reasoning is not None
        splitter = None if in_reasoning is None else ReasoningSplitter(in_reasoning)
        parser = req.structured.parser(llm.tool_format)
        self.acc = Accumulator(llm, splitter, False, req.params.stop_token_ids, parser, True)

    def cancel(self) -> None:
        for h in self._handles:
            self.core.state.engine.cancel(h)  # no-op once finished

    async def pieces(self):
        """The answer as it comes: a Piece per engine output, the last with its finish."""
        while True:
            _, kind, out = await self._queue.get()
            if (e := _failure(kind, out)) is not None:
                raise e
            if out.token_id is not None:
                self.token_ids.append(out.token_id)
            r, c, _ = self.acc.add(out)
            finish = self.acc.finish_reason(out.finish_reason) if out.finish_reason else None
            yield Piece(r, c, list(self.acc.tool_deltas), finish)
            if finish:
                return

    async def collect(self, request) -> tuple[str, str, str] | None:
        """The whole answer (reasoning, content, finish), or None if the client left first."""

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watch = asyncio.ensure_future(disconnected())
        reasoning, content = [], []
        try:
            it = self.pieces().__aiter__()
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                done, _ = await asyncio.wait({nxt, watch}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    nxt.cancel()
                    return None
                try:
                    p = nxt.result()
                except StopAsyncIteration:  # pragma: no cover - pieces() ends after a finish
                    raise APIError(500, "the answer ended without a finish", type="server_error") from None
                reasoning.append(p.reasoning)
                content.append(p.content)
                if p.finish:
                    return "".join(reasoning), "".join(content), p.finish
        finally:
            watch.cancel()
            self.cancel()

    def matched_stop(self) -> str | None:
        """The stop string that ended the answer, if one did (not the end of turn)."""
        stops = self.req.params.stop if self.req is not None else []
        if not stops or not self.token_ids or self.token_ids[-1] in self.acc.eos:
            return None
        text = self.core.state.llm.tokenizer.decode(self.token_ids)
        found = [(text.find(s), s) for s in stops if s in text]
        return min(found)[1] if found else None

    @property
    def completion_tokens(self) -> int:
        return self.acc.tokens if self.acc is not None else 0

    @property
    def cached_tokens(self) -> int:
        return self.acc.cached_tokens if self.acc is not None else 0
