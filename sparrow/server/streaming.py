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
    """Turns one choice's StepOutputs into content/reasoning deltas, tool-call deltas and logprob entries.

    The whole answer and the stream feed the same pieces to the same tool parser, so a streamed
    call reassembles to the call the whole answer returns."""

    def __init__(
        self,
        llm,
        splitter: ReasoningSplitter | None,
        want_lp: bool,
        stop_ids=(),
        tool_parser=None,
        chat: bool = True,
        tracer=None,
    ):
        """tracer: a sparse_trace.Tracer when the request asked for sparse_trace. chat: a token
        that ends the answer by being a stop token (end of turn, stop_token_ids) gets no logprobs
        entry, as in OpenAI's chat API, where the entries spell the content; completions report
        it (text still omits it), as vLLM and OpenAI's legacy API do: the last entry is then the
        token sampled, which harnesses that score with echo + logprobs drop
        (lm-evaluation-harness takes token_logprobs[ctxlen:-1])."""
        self.tok, self.splitter, self.want_lp, self.chat = llm.tokenizer, splitter, want_lp, chat
        self.tracer = tracer
        self.trace_step: dict | None = None  # of the latest add()
        self.trace_steps: list[dict] = []  # every add()'s, for a whole answer
        self.eos = set(llm.tokenizer.eos_token_ids) | set(stop_ids)
        self.tokens = 0
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.speculative: dict | None = None  # the last output's drafted / accepted counts
        self.parser = tool_parser
        self.tool_deltas: list[dict] = []  # of the latest add()

    @property
    def tool_calls(self) -> list[dict]:
        return self.parser.calls if self.parser is not None else []

    def finish_reason(self, finish: str) -> str:
        return "tool_calls" if finish == "stop" and self.tool_calls else finish

    def add(self, out):
        self.trace_step = None
        if out.cached_tokens is not None:
            self.cached_tokens = out.cached_tokens
        self.tool_deltas = []
        if out.token_id is None:  # nothing generated (max_tokens 0)
            return "", "", []
        self.tokens += 1
        self.trace_step = self.tracer.step(out) if self.tracer is not None else None
        if out.speculative is not None:
            self.speculative = out.speculative
        final = out.finish_reason is not None
        if self.splitter is not None:
            reasoning, content = self.splitter.push(out.text, final)
        else:
            reasoning, content = "", out.text
        if self.parser is not None:
            content, self.tool_deltas = self.parser.push(content, final)
        hidden = self.chat and out.finish_reason == "stop" and out.token_id in self.eos  # end of turn
        lps = [out] if self.want_lp and out.logprob is not None and not hidden else []
        return reasoning, content, lps


class Choices:
    """The choices of one response: n per prompt, numbered prompt * n + choice as OpenAI numbers
    a batch. Queue items are (prompt index, kind, payload)."""

    def __init__(self, accs: list[Accumulator], n: int, prompt_lengths: list[int]):
        self.accs, self.n, self.prompt_lengths = accs, n, prompt_lengths
        self.left = len(accs)
        self.prompt_logprobs = [None] * len(prompt_lengths)  # each prompt's, when asked (echo)

    def index(self, prompt: int, out) -> int:
        """out's choice index; keeps the prompt's logprobs, which come with its choice 0's first
        output (before any other choice's)."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = out.prompt_logprobs
        return prompt * self.n + out.index

    def usage(self) -> dict:
        """Each prompt counted once, the choices' tokens summed; cached: each prompt's first choice's."""
        cached = sum(self.accs[p * self.n].cached_tokens for p in range(len(self.prompt_lengths)))
        completion = sum(a.tokens for a in self.accs)
        out = {**usage(sum(self.prompt_lengths), completion), "prompt_tokens_details": {"cached_tokens": cached}}
        spec = [a.speculative for a in self.accs if a.speculative is not None]
        if spec:  # OpenAI's names for predicted tokens kept and not, summed over the choices
            a, d = sum(x["accepted_tokens"] for x in spec), sum(x["drafted_tokens"] for x in spec)
            out["completion_tokens_details"] = {"accepted_prediction_tokens": a, "rejected_prediction_tokens": d - a}
        return out


def _failure(kind: str, payload) -> APIError | None:
    if kind == "timeout":
        return APIError(504, payload, type="server_error", code="timeout")
    if kind == "error":
        return APIError(500, payload, type="server_error")
    return None


async def collect(request, queue, choices: Choices):
    """Waits for every choice's whole answer: [(reasoning, content, logprob outputs, finish)]
    by index; None if the client disconnects first."""

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    parts = [([], [], []) for _ in choices.accs]
    results = [None] * len(choices.accs)
    try:
        while choices.left:
            get = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                return None
            p, kind, out = get.result()
            if (e := _failure(kind, out)) is not None:
                raise e
            i = choices.index(p, out)
            acc, (reasoning, content, lps) = choices.accs[i], parts[i]
            r, c, lp = acc.add(out)
            reasoning.append(r)
            content.append(c)
            lps += lp
            if acc.trace_step is not None:
                acc.trace_steps.append(acc.trace_step)
            if out.finish_reason:
                results[i] = "".join(reasoning), "".join(content), lps, acc.finish_reason(out.finish_reason)
                choices.left -= 1
        return results
    finally:
        watch.cancel()


async def stream(req, choices: Choices, queue, rid, created, chat, lp_fmt, model_name, echo_texts=None):
    """SSE chunks in OpenAI's shape: each choice's role first, deltas (each chunk names its
    choice's index), each choice's finish, optional usage once all finished, [DONE].
    echo_texts: completions' echo, each prompt's text, sent as its choices' first chunk."""
    base = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model_name,
    }
    extra = {"usage": None} if req.include_usage else {}
    offsets = [0] * len(choices.accs)  # characters streamed so far: completions' logprobs.text_offset
    started = [False] * len(choices.accs)

    def chunk(i, delta_or_text, lp=None, finish=None, trace=None):
        choice = {"index": i, ("delta" if chat else "text"): delta_or_text, "logprobs": lp, "finish_reason": finish}
        if trace is not None:
            choice["sparse_trace"] = trace
        return sse({**base, "choices": [choice], **extra})

    tracer = choices.accs[0].tracer
    header = tracer.header if tracer is not None else None  # sparse_trace: with the first chunk
    if chat:
        for i in range(len(choices.accs)):
            yield chunk(i, {"role": "assistant", "content": ""}, trace=header if i == 0 else None)
    elif header is not None:
        yield chunk(0, "", trace=header)
    while choices.left:
        p, kind, out = await queue.get()
        if kind in ("error", "timeout"):
            yield sse(error_body(out, "server_error", code="timeout" if kind == "timeout" else None))
            break
        i = choices.index(p, out)
        acc = choices.accs[i]
        r, c, lps = acc.add(out)
        if echo_texts is not None and not started[i]:
            text = echo_texts[p]
            lp = lp_fmt([], 0, choices.prompt_logprobs[p] or ()) if req.logprobs else None
            yield chunk(i, text, lp)
            offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp and lp["tokens"] else len(text)
        started[i] = True
        tr = acc.trace_step  # every token's step goes out, with its text or in a chunk of its own
        if chat:
            delta = {k: v for k, v in (("reasoning_content", r), ("content", c)) if v}
            if delta or lps or tr:
                yield chunk(i, delta, lp_fmt(lps) if lps else None, trace=tr)
            for d in acc.tool_deltas:  # OpenAI's shape: one call's id and name first, then its arguments
                yield chunk(i, {"tool_calls": [d]})
        elif c or lps or tr:
            yield chunk(i, c, lp_fmt(lps, offsets[i]) if lps else None, trace=tr)
            offsets[i] += len(c)
        if out.finish_reason:
            yield chunk(i, {} if chat else "", finish=acc.finish_reason(out.finish_reason))
            choices.left -= 1
    else:
        if req.include_usage:
            yield sse({**base, "choices": [], "usage": choices.usage()})
    yield "data: [DONE]\n\n"
