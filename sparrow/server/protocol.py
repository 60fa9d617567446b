"""OpenAI requests -> typed GenRequests, errors in OpenAI's shape, and response helpers; no HTTP here.

Bodies are validated against the pydantic models of schema.py (FastAPI does it for the routes,
`parse_chat`/`parse_completion` for callers holding a dict); every validation error becomes
OpenAI's 400 with `param` naming the field (`validation_error`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from pydantic import BaseModel, ValidationError

from ..errors import SparrowError
from ..params import SPARSE_OPTIONS, SamplingParams, SparseParams
from ..structured import Structured, StructuredError
from .schema import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TextPart, TokenizeRequest

_OTHER = (TokenizeRequest, DetokenizeRequest)

_TEMPLATE_RESERVED = {"messages", "add_generation_prompt", "tools", "template", "self"}  # set by the server
DEFAULT_MAX_TOKENS = 2048  # chat, when the request names none: the KV cache is sized to prompt + this
COMPLETION_MAX_TOKENS = 16  # completions, when the request names none: OpenAI's documented default
MAX_N = 128  # choices per prompt (OpenAI's limit)
MAX_PROMPTS = 2048  # prompts in one batched completions request
MAX_CHOICES = 2048  # prompts * n: each choice is a sequence of the engine


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


# ---------------------------------------------------------------------- validation errors
def _path(loc) -> list:
    """A pydantic error location as field names and list indices. Labels pydantic adds for the
    members of a union ('str', 'list[int]', 'TextPart', ...) are no field of ours: dropped."""
    return [p for p in loc if isinstance(p, int) or p in _FIELDS]


def _named(path: list, missing: bool) -> list:
    """The part of the request an error is reported on: a bad item of a list names the list
    (`stop_token_ids`); a missing field names the list item or top-level field holding it
    (`messages[0]`, `messages[0].tool_calls[0]`, `response_format`)."""
    if len(path) > 1 and isinstance(path[-1], int):
        return path[:-1]
    if missing and len(path) > 1:
        path = path[:-1]
        while len(path) > 1 and not isinstance(path[-1], int):
            path = path[:-1]
    return path


def _param(path: list) -> str | None:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or None


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's (or FastAPI's) errors for one body -> one OpenAI 400. `param` is the deepest field
    common to the errors of the first field named (a union reports one error per member)."""
    if any(e.get("type") == "json_invalid" for e in errors):
        why = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return APIError(400, f"malformed JSON body: {why}"[:300], code="invalid_json")
    full = [_path(e["loc"][1:] if e["loc"][:1] == ("body",) else e["loc"]) for e in errors]
    paths = [_named(p, e["type"] == "missing") for p, e in zip(full, errors)]
    if not paths or not paths[0]:
        return APIError(400, "the request body must be a JSON object")
    group = [(p, f, e) for p, f, e in zip(paths, full, errors) if p[:1] == paths[0][:1]]
    common = group[0][0]
    for p, _, _ in group[1:]:
        n = next((i for i, (a, b) in enumerate(zip(common, p)) if a != b), min(len(common), len(p)))
        common = common[:n]
    param = _param(common)
    if len(group) == 1 and group[0][2]["type"] == "missing" and group[0][1] == common:
        return APIError(400, f"'{param}' is required", param=param)
    why = []
    for p, f, e in group:
        rest = _param(p[len(common) :])
        text = f"{rest}: {e['msg']}" if rest else e["msg"]
        if e["type"] == "missing":
            text = f"{_param(f[len(common) :]) or e['loc'][-1]} is required"
        if "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], (dict, list)):
            text += f" (got {e['input']!r:.40})"
        if text not in why:
            why.append(text)
    return APIError(400, f"invalid '{param}': {'; or '.join(why)}"[:300], param=param)


def validate(model: type[BaseModel], body):
    """A dict -> the model, or the 400 for what is wrong with it."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def _field_names(model, seen) -> set[str]:
    names = set()
    if model in seen or not (isinstance(model, type) and issubclass(model, BaseModel)):
        return names
    seen.add(model)
    for name, f in model.model_fields.items():
        names.add(f.alias or name)
        for sub in _models_in(f.annotation):
            names |= _field_names(sub, seen)
    return names


def _models_in(tp):
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        yield tp
    for arg in getattr(tp, "__args__", ()) or ():
        yield from _models_in(arg)


# ---------------------------------------------------------------------- fields sparrow does not apply
# OpenAI's request fields that would change the answer but are not applied here: each is a 400
# naming it, unless it holds a value that asks for nothing (schema.py documents them as refused).
REFUSED_CHAT = {
    "functions": ((None,), "deprecated 'functions' is not supported; use 'tools'"),
    "function_call": ((None,), "deprecated 'function_call' is not supported; use 'tool_choice'"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
    "reasoning_effort": ((None,), "'reasoning_effort' is not supported (Qwen3: chat_template_kwargs.enable_thinking)"),
    "verbosity": ((None,), "'verbosity' is not supported"),
    "web_search_options": ((None,), "web search is not supported (the server has no network)"),
    "moderation": ((None, False), "moderation is not supported"),
    "store": ((None, False), "'store' is not supported: sparrow stores no completions"),
}
REFUSED_COMPLETION = {
    "best_of": ((None, 1), "'best_of' other than 1 is not supported"),
    "suffix": ((None, ""), "'suffix' (insertion) is not supported"),
}


def _refuse(r, table: dict) -> None:
    for name, (allowed, why) in table.items():
        v = getattr(r, name)
        if not any(v == a and type(v) is type(a) for a in allowed):  # type: 1 is not True, [] is not None
            raise _bad(name, why)


# ---------------------------------------------------------------------- requests -> GenRequest
@dataclass
class GenRequest:
    chat: bool
    model: str | None
    params: SamplingParams
    sparse: SparseParams | None
    # None: DEFAULT_MAX_TOKENS (chat) or COMPLETION_MAX_TOKENS, capped by the context once the prompt is
    # known; 0 (completions only): answer with no tokens, nothing generated
    max_tokens: int | None
    messages: list[dict] | None = None
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: each a text or token ids
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: each choice's text (and logprobs) starts with its prompt's
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)
    kv_dtype: str | None = None  # None: the server's --kv-dtype
    sparse_trace: bool = False  # each token's block selections in the response (server/sparse_trace.py)
    structured: Structured = field(default_factory=Structured)  # tools, tool_choice, response_format
    speculative: dict | None = None  # the request's speculative options (None: the server's default)


def _common(r, chat: bool, defaults: dict | None) -> GenRequest:
    """defaults: the model's generation_config sampling values, used where the request says nothing."""
    d = {k: v for k, v in (defaults or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def pick(name, fallback):
        v = getattr(r, name)
        return d.get(name, fallback) if v is None else v

    max_tokens = r.max_tokens if getattr(r, "max_completion_tokens", None) is None else r.max_completion_tokens
    if chat:
        want_lp = bool(r.logprobs)
        if r.top_logprobs is not None and not want_lp:
            raise _bad("top_logprobs", "'top_logprobs' requires 'logprobs': true")
        logprobs = (r.top_logprobs or 0) if want_lp else None
    else:
        logprobs = r.logprobs
        want_lp = logprobs is not None
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    if len(stop) > 16:
        raise _bad("stop", "at most 16 stop strings are supported")
    bias = r.logit_bias or {}
    bad_key = next((k for k in bias if not (k.isascii() and k.isdigit())), None)
    if bad_key is not None:
        raise _bad("logit_bias", f"logit_bias keys must be token ids (decimal integers), got {bad_key!r:.40}")
    params = SamplingParams(
        max_tokens=max_tokens or 1,
        temperature=float(pick("temperature", 1.0)),
        top_p=float(pick("top_p", 1.0)),
        top_k=max(0, int(pick("top_k", 0))),  # -1 = off (vLLM)
        min_p=float(pick("min_p", 0.0)),
        repetition_penalty=float(pick("repetition_penalty", 1.0)),
        presence_penalty=float(r.presence_penalty or 0.0),
        frequency_penalty=float(r.frequency_penalty or 0.0),
        seed=None if r.seed is None else r.seed % 2**64,
        stop=[s for s in stop if s],
        ignore_eos=bool(r.ignore_eos),
        stop_token_ids=list(r.stop_token_ids or []),
        logprobs=logprobs,
        logit_bias={int(k): v for k, v in bias.items()},
    )
    try:
        sparse = SparseParams.from_options(**{k: getattr(r, k) for k in SPARSE_OPTIONS})
    except SparrowError as e:
        raise _bad("sparse_attn", str(e)) from None
    if r.sparse_trace and sparse is None:
        raise _bad("sparse_trace", "'sparse_trace' traces sparse attention: it requires 'sparse_attn': true or 'auto'")
    if r.sparse_trace and (r.n or 1) > 1:
        raise _bad("sparse_trace", "'sparse_trace' traces one choice: it requires 'n': 1")
    if r.sparse_trace and r.speculative not in (None, "none"):
        raise _bad("sparse_trace", "'sparse_trace' traces plain decoding: it cannot be combined with 'speculative'")
    return GenRequest(
        chat,
        r.model,
        params,
        sparse,
        max_tokens,
        n=1 if r.n is None else r.n,
        stream=bool(r.stream),
        include_usage=bool(r.stream_options and r.stream_options.include_usage),
        logprobs=want_lp,
        kv_dtype=r.kv_dtype,
        speculative=_speculative_options(r),
        sparse_trace=bool(r.sparse_trace),
    )


SPEC_FIELDS = ("spec_tokens", "spec_ngram", "spec_sparse_k", "spec_sparse_select")


def _speculative_options(r) -> dict | None:
    """The speculative options a request gives: None when it gives none (the server's default).
    spec_* without `speculative` tune the server's default method (none: they do nothing, as
    sparse_k does without sparse_attn)."""
    given = {k: getattr(r, k) for k in SPEC_FIELDS if getattr(r, k) is not None}
    if r.speculative is None and not given:
        return None
    return {"speculative": r.speculative, **given}


def _content(content, p: str, images: bool):
    """Text parts are joined into one string; with `images`, a list holding image parts is passed
    on as given (the parts' dicts) for the model's processor."""
    if not isinstance(content, list):
        return content
    for j, part in enumerate(content):
        if not isinstance(part, TextPart) and not images:
            raise _bad(f"{p}.content[{j}]", f"{p}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}")
    if all(isinstance(part, TextPart) for part in content):
        return "\n".join(part.text for part in content)
    return [part.model_dump(exclude_none=True) for part in content]


def _messages(msgs, images: bool) -> list[dict]:
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if m.content is None and m.role != "assistant":
            raise _bad(f"{p}.content", f"{p}.content is required")
        content = "" if m.content is None else _content(m.content, p, images)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.role == "assistant" and m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.role == "assistant" and m.tool_calls is not None:
            # as the chat template reads them: arguments as given (JSON text, or an object)
            msg["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _structured(r, parallel: bool | None) -> Structured:
    def raw(v):
        if isinstance(v, list):
            return [raw(x) for x in v]
        return v.model_dump(exclude_unset=True, by_alias=True) if isinstance(v, BaseModel) else v

    try:
        return Structured.parse(raw(r.tools), raw(r.tool_choice), raw(getattr(r, "response_format", None)), parallel)
    except StructuredError as e:
        raise _bad(e.param, str(e)) from None


def chat_request(r: ChatCompletionRequest, defaults: dict | None = None, images: bool = False) -> GenRequest:
    """images: the model takes image parts (else a non-text part is a 400, as for a text model)."""
    _refuse(r, REFUSED_CHAT)
    req = _common(r, chat=True, defaults=defaults)
    req.messages = _messages(r.messages, images)
    req.structured = _structured(r, r.parallel_tool_calls)
    kwargs = r.chat_template_kwargs or {}
    clash = sorted(set(kwargs) & _TEMPLATE_RESERVED)
    if clash:
        raise _bad("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(clash)}")
    req.chat_template_kwargs = dict(kwargs)
    return req


def completion_request(r: CompletionRequest, defaults: dict | None = None) -> GenRequest:
    _refuse(r, REFUSED_COMPLETION)
    req = _common(r, chat=False, defaults=defaults)
    p = r.prompt
    if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
        req.prompts = [p]
    elif p:  # a batch: strings or token-id lists (schema.py allows no mix)
        req.prompts = list(p)
    else:
        raise _bad("prompt", "'prompt' must be a string, token ids, or a non-empty list of those")
    if req.sparse_trace and len(req.prompts) > 1:
        raise _bad("sparse_trace", "'sparse_trace' traces one prompt, not a batch")
    if len(req.prompts) > MAX_PROMPTS:
        raise _bad("prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(req.prompts)}")
    if len(req.prompts) * req.n > MAX_CHOICES:
        raise _bad("n", f"{len(req.prompts)} prompts * n={req.n} choices exceed {MAX_CHOICES} in one request")
    req.echo = bool(r.echo)
    return req


def parse_chat(body, defaults: dict | None = None, images: bool = False) -> GenRequest:
    return chat_request(validate(ChatCompletionRequest, body), defaults, images)


def parse_completion(body, defaults: dict | None = None) -> GenRequest:
    return completion_request(validate(CompletionRequest, body), defaults)


_FIELDS = set().union(*(_field_names(m, set()) for m in (ChatCompletionRequest, CompletionRequest, *_OTHER)))


# ---------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _lp(x: float) -> float:
    return max(float(x), -9999.0)  # JSON has no -inf (vLLM clamps the same way)


def token_entry(tokenizer, token_id: int, logprob: float) -> dict:
    b = tokenizer.token_bytes(token_id)
    if b is None:
        text = tokenizer.decode([token_id])
        b = text.encode("utf-8")
    else:
        text = b.decode("utf-8", errors="replace")
    return {"token": text, "logprob": _lp(logprob), "bytes": list(b)}


def chat_logprobs(tokenizer, outs) -> dict:
    """outs: StepOutputs with logprobs -> chat `logprobs` {"content": [...], "refusal": None}."""
    content = []
    for o in outs:
        e = token_entry(tokenizer, o.token_id, o.logprob)
        e["top_logprobs"] = [token_entry(tokenizer, t, lp) for t, lp in (o.top_logprobs or [])]
        content.append(e)
    return {"content": content, "refusal": None}  # OpenAI's schema requires refusal (null: sparrow never refuses)


def completion_logprobs(tokenizer, outs, offset: int = 0, prompt=()) -> dict:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs [{token: lp}], text_offset.
    prompt: the echoed prompt's entries (StepOutput.prompt_logprobs), before the outputs; the
    first token has no logprob: null in token_logprobs and top_logprobs, as OpenAI and vLLM give."""
    tokens, lps, tops, offsets = [], [], [], []
    entries = [*prompt, *((o.token_id, o.logprob, o.top_logprobs) for o in outs)]
    for token_id, logprob, top in entries:
        t = token_entry(tokenizer, token_id, 0.0)["token"]
        tokens.append(t)
        lps.append(None if logprob is None else _lp(logprob))
        alternatives = {token_entry(tokenizer, i, lp)["token"]: _lp(lp) for i, lp in top or ()}
        tops.append(None if logprob is None else alternatives)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


class ReasoningSplitter:
    """Splits streamed text into (reasoning, content) at `<think>` ... `</think>` (Qwen3 style).

    Text before anything else that opens with `<think>` is reasoning until `</think>`; a tag cut
    across pieces is held back until it is complete. Feeding any split of a text gives the same
    totals as feeding it whole.
    """

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, in_reasoning: bool = False):
        self.mode = "reasoning" if in_reasoning else "start"
        self.buf = ""
        self._strip = in_reasoning  # drop whitespace at the start of reasoning / of content after it

    def push(self, piece: str, final: bool = False) -> tuple[str, str]:
        buf = self.buf + piece
        self.buf = ""
        if self.mode == "start":
            s = buf.lstrip()
            if s.startswith(self.OPEN):
                self.mode, self._strip, buf = "reasoning", True, s[len(self.OPEN) :]
            elif self.OPEN.startswith(s) and not final:
                self.buf = buf  # whitespace or part of "<think>": undecided
                return "", ""
            else:
                self.mode = "content"
        if self.mode == "reasoning":
            i = buf.find(self.CLOSE)
            if i < 0:
                hold = 0 if final else _partial_suffix(buf, self.CLOSE)
                self.buf, reasoning = buf[len(buf) - hold :], buf[: len(buf) - hold]
                return self._lead(reasoning), ""
            reasoning, buf = self._lead(buf[:i]), buf[i + len(self.CLOSE) :]
            self.mode, self._strip = "content", True
            return reasoning, self._lead(buf)
        return "", self._lead(buf)

    def _lead(self, text: str) -> str:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        return text


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def starts_in_reasoning(prompt_text: str) -> bool:
    """A template that opens `<think>` in the generation prompt leaves the model inside it."""
    return prompt_text.rfind(ReasoningSplitter.OPEN) > prompt_text.rfind(ReasoningSplitter.CLOSE)
