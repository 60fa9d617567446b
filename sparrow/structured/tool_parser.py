"""Tool calls out of generated text, streamed: OpenAI `tool_calls` deltas and the content around them.

Formats, chosen per model family from its chat template (`tool_format`):
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number of them,
  with text before them. Qwen2/Qwen3 templates teach it, and so does the tools prompt sparrow adds
  for templates that have no tools section (SmolLM2's, plain ChatML).
- llama3_json: the whole answer is `{"name": ..., "parameters": {...}}` (several joined by `;`),
  the JSON tool format of Llama 3.1-3.3 templates.

A parser is fed the content text piece by piece (`push`) and returns the content that is final
plus OpenAI-shaped tool-call deltas: the first delta of a call carries its id and name with empty
arguments, later ones argument fragments. The whole answer is the same pieces fed to the same
parser, so a streamed call reassembles to exactly the call a whole answer returns. A call whose
JSON does not parse stays content; nothing here raises on model output.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    name: str
    args_key: str  # "arguments" | "parameters"
    open: str | None  # tags around each call (None: the whole answer is the call)
    close: str | None


HERMES = ToolFormat("hermes", "arguments", "<tool_call>", "</tool_call>")
LLAMA3_JSON = ToolFormat("llama3_json", "parameters", None, None)


def tool_format(chat_template: str | None) -> ToolFormat:
    t = chat_template or ""
    if "<tool_call>" not in t and "<|python_tag|>" in t:
        return LLAMA3_JSON
    return HERMES


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj, args_key: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) when obj is a well-formed call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of text that could be the start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _arguments_part(rest: str) -> str:
    """The text of a cut call after `"arguments": ` that belongs to the arguments: all of it while
    they are unfinished, else the complete JSON value alone, never the wrapper's own `}`, newline
    or part of the closing tag that came after it."""
    try:
        _, end = json.JSONDecoder().raw_decode(rest)
    except ValueError:
        return rest
    return rest[:end]


# The head of a call written name first, as the grammar writes it: the name can be sent at once.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


class HermesParser:
    """incremental: stream arguments as they are generated. Right when a grammar guarantees the
    call is valid (tool_choice required or named); otherwise a call is held until `</tool_call>`
    so that malformed JSON can still fall back to content."""

    fmt = HERMES

    def __init__(self, incremental: bool = False):
        self.incremental = incremental
        self.buf = ""  # text not yet released: a possible tag start, trailing whitespace, or a call body
        self.in_call = False
        self.calls: list[dict] = []  # finished calls, OpenAI shape, in order
        self._sent = 0  # incremental: argument characters of the current call already sent
        self._head: re.Match | None = None

    def push(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buf += text
        content, deltas = [], []
        while True:
            if not self.in_call:
                i = self.buf.find(self.fmt.open)
                if i < 0:
                    break
                content.append(self.buf[:i].rstrip())  # the newline before a call belongs to the format
                self.buf, self.in_call, self._sent, self._head = self.buf[i + len(self.fmt.open) :], True, 0, None
            j = self.buf.find(self.fmt.close)
            if j < 0:
                if self.incremental:
                    deltas += self._stream_args()
                break
            body, self.buf = self.buf[:j], self.buf[j + len(self.fmt.close) :]
            self.in_call = False
            content_text, call_deltas = self._finish(body)
            content.append(content_text)
            deltas += call_deltas
        if final:
            content_text, call_deltas = self._flush()
            content.append(content_text)
            deltas += call_deltas
        elif not self.in_call:
            held = _held_prefix(self.buf, self.fmt.open)
            before = self.buf[: len(self.buf) - held]
            keep = held + len(before) - len(before.rstrip())  # whitespace right before a call is dropped
            content.append(self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep :]
        return "".join(content), deltas

    # ---- one call
    def _open(self, name: str) -> dict:
        call = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call, "function": {"name": name, "arguments": ""}}

    def _args(self, fragment: str) -> list[dict]:
        if not fragment:
            return []
        self.calls[-1]["function"]["arguments"] += fragment
        return [{"index": len(self.calls) - 1, "function": {"arguments": fragment}}]

    def _stream_args(self) -> list[dict]:
        out = []
        if self._head is None:
            self._head = _HEAD.match(self.buf)
            if self._head is None:
                return out
            out.append(self._open(json.loads(f'"{self._head.group(1)}"')))
        # Hold back a possible start of the closing tag, and the "}" and whitespace before it: they may
        # close the call rather than belong to the arguments.
        rest = self.buf[self._head.end() :]
        rest = rest[: len(rest) - _held_prefix(rest, self.fmt.close)].rstrip()
        end = len(rest) - 1 if rest.endswith("}") else len(rest)
        if end > self._sent:
            out += self._args(rest[self._sent : end])
            self._sent = end
        return out

    def _finish(self, body: str) -> tuple[str, list[dict]]:
        """A complete `<tool_call>body</tool_call>`: (content, deltas)."""
        if self._head is not None:  # incremental: name and part of the arguments are already out
            rest = body[self._head.end() :].rstrip()
            return "", self._args(rest[self._sent : len(rest) - 1 if rest.endswith("}") else len(rest)])
        try:
            call = _call(json.loads(body), self.fmt.args_key)
        except ValueError:
            call = None
        if call is None:
            return f"{self.fmt.open}{body}{self.fmt.close}", []
        return "", [self._open(call[0]), *self._args(call[1])]

    def _flush(self) -> tuple[str, list[dict]]:
        """End of the answer: an unfinished call is content unless its arguments were streaming."""
        buf, self.buf = self.buf, ""
        if not self.in_call:
            return ("" if self.calls and not buf.strip() else buf), []
        self.in_call = False
        if self._head is not None:  # cut off by max_tokens: the arguments stay as far as they got
            return "", self._args(_arguments_part(buf[self._head.end() :])[self._sent :])
        return self.fmt.open + buf, []


class Llama3JsonParser:
    """An answer that opens with `{` is held to the end and becomes tool calls if it parses as
    calls (several may be joined by `;`); anything else is content."""

    fmt = LLAMA3_JSON

    def __init__(self, incremental: bool = False):
        self.buf = ""
        self.mode = "start"  # "start" (only whitespace so far) | "json" | "text"
        self.calls: list[dict] = []

    def push(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buf += text
        if self.mode == "start" and self.buf.strip():
            self.mode = "json" if self.buf.lstrip().startswith("{") else "text"
        if self.mode == "text" or (self.mode == "start" and final):
            out, self.buf = self.buf, ""
            return out, []
        if not final:
            return "", []
        body, self.buf = self.buf, ""
        calls = []
        for part in body.split(";"):
            try:
                call = _call(json.loads(part), self.fmt.args_key) if part.strip() else None
            except ValueError:
                call = None
            if call is None:
                return body, []
            calls.append(call)
        deltas = []
        for name, args in calls:
            call = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}
            self.calls.append(call)
            deltas += [
                {"index": len(self.calls) - 1, **call, "function": {"name": name, "arguments": ""}},
                {"index": len(self.calls) - 1, "function": {"arguments": args}},
            ]
        return "", deltas


def make_parser(fmt: ToolFormat, incremental: bool = False):
    return (Llama3JsonParser if fmt is LLAMA3_JSON else HermesParser)(incremental)
