"""OpenAI request parsing/validation and response shapes; no model or HTTP code here.

Requests are validated by hand rather than with pydantic models so that every problem becomes
OpenAI's error shape with a 400 and the offending `param`, and unknown fields are ignored the
way permissive OpenAI-compatible servers do.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

from ..errors import SparrowError
from ..params import KV_DTYPES, SamplingParams, SparseParams
from ..structured import Structured, StructuredError

ROLES = {"system", "user", "assistant", "developer", "tool"}  # developer is OpenAI's newer name for system
_TEMPLATE_RESERVED = {"messages", "add_generation_prompt", "tools", "template", "self"}  # set by the server
DEFAULT_MAX_TOKENS = 2048  # when the request names none: the KV cache is sized to prompt + this


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


# ---------------------------------------------------------------------- typed field readers
def _num(body: dict, name: str, default, lo=None, hi=None, integer=False):
    v = body.get(name)
    if v is None:
        return default
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or (integer and not isinstance(v, int))
        or (isinstance(v, float) and not math.isfinite(v))
    ):  # json.loads accepts NaN and Infinity
        raise _bad(name, f"'{name}' must be {'an integer' if integer else 'a finite number'}, got {v!r}"[:300])
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise _bad(name, f"'{name}' must be in {rng}, got {v!r}")
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"'{name}' must be a boolean, got {v!r}"[:300])
    return v


def _dict(body: dict, name: str) -> dict:
    v = body.get(name)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _bad(name, f"'{name}' must be an object")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad("stop", "'stop' must be a string or a list of strings")
    if len(v) > 16:
        raise _bad("stop", "at most 16 stop strings are supported")
    return [s for s in v if s]


def _token_ids(body: dict, name: str) -> list[int]:
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise _bad(name, f"'{name}' must be a list of token ids")
    return v


@dataclass
class GenRequest:
    chat: bool
    model: str | None
    params: SamplingParams
    sparse: SparseParams | None
    max_tokens: int | None  # None: fill to DEFAULT_MAX_TOKENS / the context once the prompt is known
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)
    kv_dtype: str | None = None  # None: the server's --kv-dtype
    structured: Structured = field(default_factory=Structured)  # tools, tool_choice, response_format


def _common(body: dict, chat: bool, defaults: dict | None) -> GenRequest:
    """defaults: the model's generation_config sampling values, used where the request says nothing."""
    d = {k: v for k, v in (defaults or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "'model' must be a string")
    n = _num(body, "n", 1, lo=1, integer=True)
    if n != 1:
        raise _bad("n", "n > 1 is not supported; send separate requests")
    max_tokens = _num(body, "max_tokens", None, integer=True)
    max_tokens = _num(body, "max_completion_tokens", max_tokens, integer=True)
    if max_tokens is not None and max_tokens < 1:
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        raise _bad(name, f"'{name}' must be a positive integer, got {max_tokens}")
    seed = _num(body, "seed", None, integer=True)
    if chat:
        want_lp = _bool(body, "logprobs", False)
        top = _num(body, "top_logprobs", None, lo=0, hi=20, integer=True)
        if top is not None and not want_lp:
            raise _bad("top_logprobs", "'top_logprobs' requires 'logprobs': true")
        logprobs = (top or 0) if want_lp else None
    else:
        logprobs = _num(body, "logprobs", None, lo=0, hi=20, integer=True)
        want_lp = logprobs is not None
    params = SamplingParams(
        max_tokens=max_tokens or 1,
        temperature=float(_num(body, "temperature", d.get("temperature", 1.0), lo=0.0, hi=2.0)),
        top_p=float(_num(body, "top_p", d.get("top_p", 1.0), lo=0.0, hi=1.0)),
        top_k=max(0, _num(body, "top_k", int(d.get("top_k", 0)), lo=-1, integer=True)),  # -1 = off (vLLM)
        min_p=float(_num(body, "min_p", d.get("min_p", 0.0), lo=0.0, hi=1.0)),
        repetition_penalty=float(_num(body, "repetition_penalty", d.get("repetition_penalty", 1.0), lo=0.0)),
        presence_penalty=float(_num(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0)),
        frequency_penalty=float(_num(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0)),
        seed=None if seed is None else seed % 2**64,
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos", False),
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        logprobs=logprobs,
    )
    if params.top_p == 0.0:
        raise _bad("top_p", "'top_p' must be in (0, 1]")
    if params.repetition_penalty == 0.0:
        raise _bad("repetition_penalty", "'repetition_penalty' must be > 0")
    sparse = None
    if _bool(body, "sparse_attn", False):
        try:
            sparse = SparseParams(
                k=_num(body, "sparse_k", 32, lo=1, integer=True),
                block=_num(body, "sparse_block", 32, lo=1, integer=True),
                probe=_num(body, "sparse_probe", 8, lo=1, integer=True),
                prefill=_bool(body, "sparse_prefill", False),
            )
        except SparrowError as e:
            raise _bad("sparse_attn", str(e)) from None
    kv_dtype = body.get("kv_dtype")
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise _bad("kv_dtype", f"'kv_dtype' must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}"[:300])
    stream = _bool(body, "stream", False)
    opts = _dict(body, "stream_options")
    include_usage = _bool(opts, "include_usage", False)
    return GenRequest(
        chat,
        model,
        params,
        sparse,
        max_tokens,
        stream=stream,
        include_usage=include_usage,
        logprobs=want_lp,
        kv_dtype=kv_dtype,
    )


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(p, f"{p} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{p}.role", f"{p}.role must be one of system, user, assistant, tool; got {role!r}"[:300])
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (
                    isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str)
                ):
                    raise _bad(
                        f"{p}.content[{j}]", f"{p}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}"
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None:
            if role != "assistant":
                raise _bad(f"{p}.content", f"{p}.content is required")
            content = ""
        elif not isinstance(content, str):
            raise _bad(f"{p}.content", f"{p}.content must be a string or a list of text parts")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        reasoning = m.get("reasoning_content")
        if role == "assistant" and isinstance(reasoning, str):
            msg["reasoning_content"] = reasoning
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{p}.tool_calls")
        if role == "tool":
            if m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
                raise _bad(f"{p}.tool_call_id", f"{p}.tool_call_id must be a string")
            msg["tool_call_id"] = m.get("tool_call_id")
        out.append(msg)
    return out


def _tool_calls(calls, p: str) -> list[dict]:
    """An assistant message's earlier calls, as the chat template reads them (arguments: JSON text)."""
    if not isinstance(calls, list):
        raise _bad(p, f"{p} must be a list")
    out = []
    for i, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(
                f"{p}[{i}]", f"{p}[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}"
            )
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise _bad(f"{p}[{i}].function.arguments", f"{p}[{i}].function.arguments must be a JSON string")
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def _structured(body: dict, parallel: bool) -> Structured:
    try:
        return Structured.parse(body.get("tools"), body.get("tool_choice"), body.get("response_format"), parallel)
    except StructuredError as e:
        raise _bad(e.param, str(e)) from None


def parse_chat(body, defaults: dict | None = None) -> GenRequest:
    req = _common(body, chat=True, defaults=defaults)
    req.messages = _messages(body)
    req.structured = _structured(body, _bool(body, "parallel_tool_calls", True))
    kwargs = _dict(body, "chat_template_kwargs")
    clash = sorted(set(kwargs) & _TEMPLATE_RESERVED)
    if clash:
        raise _bad("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(clash)}")
    req.chat_template_kwargs = dict(kwargs)
    return req


def parse_completion(body, defaults: dict | None = None) -> GenRequest:
    req = _common(body, chat=False, defaults=defaults)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        req.prompt = p
    elif isinstance(p, str):
        req.prompt = p
    elif isinstance(p, list) and len(p) > 1:
        raise _bad("prompt", "batched prompts are not supported; send one prompt per request")
    else:
        raise _bad("prompt", "'prompt' must be a string or a list of token ids")
    if _bool(body, "echo", False):
        raise _bad("echo", "'echo' is not supported")
    return req


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
    """outs: StepOutputs with logprobs -> chat `logprobs` {"content": [...]}."""
    content = []
    for o in outs:
        e = token_entry(tokenizer, o.token_id, o.logprob)
        e["top_logprobs"] = [token_entry(tokenizer, t, lp) for t, lp in (o.top_logprobs or [])]
        content.append(e)
    return {"content": content}


def completion_logprobs(tokenizer, outs, offset: int = 0) -> dict:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs [{token: lp}], text_offset."""
    tokens, lps, tops, offsets = [], [], [], []
    for o in outs:
        t = token_entry(tokenizer, o.token_id, o.logprob)["token"]
        tokens.append(t)
        lps.append(_lp(o.logprob))
        tops.append({token_entry(tokenizer, i, lp)["token"]: _lp(lp) for i, lp in (o.top_logprobs or [])})
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
