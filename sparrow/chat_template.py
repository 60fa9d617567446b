"""Chat templates: render a conversation to the prompt string a model was trained on.

Templates are Jinja code shipped with the model and untrusted, so they run in jinja2's immutable
sandbox with the same settings and helpers transformers gives them (`trim_blocks`,
`lstrip_blocks`, `tojson` without HTML escaping, `raise_exception`, `strftime_now`); a template
written for transformers therefore renders the same here.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sparrow.errors import SparrowError

# Used when a model ships no template: plain ChatML, which most small instruct models follow.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Older names for a message's reasoning; templates read `reasoning_content` (gpt-oss reads `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & for HTML, which would change tool schemas in the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Namespaces reject dunder-like names so a template cannot reach CPython internals through them.
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Pydantic models and other objects -> plain dicts/lists, so templates can index them."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _flatten_content(content: Any) -> Any:
    """A list of {"type": "text", "text": ...} parts -> one string.

    Most templates (SmolLM2's, Qwen3's) concatenate `message['content']` as a string, and a text-only
    engine has nothing else to put there; parts are joined with newlines, as vLLM does.
    """
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise SparrowError(f"unsupported message content part {kind!r}: only text parts are accepted")
    return "\n".join(texts)


def normalize_messages(messages) -> list[dict]:
    """Messages as plain dicts with string content and `reasoning_content` filled from older names."""
    if not isinstance(messages, (list, tuple)):
        raise SparrowError("messages must be a list of {'role': ..., 'content': ...} objects")
    out = []
    for message in messages:
        message = _plain(message)
        if not isinstance(message, dict) or "role" not in message:
            raise SparrowError("each message must be an object with a 'role'")
        message = dict(message)
        if "content" in message:
            message["content"] = _flatten_content(message["content"])
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


# The tools prompt of Qwen's templates (hermes format), word for word: added as a system message for
# templates with no tools section of their own, so a model that has no tool format learns this one.
_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def _knows(template: str | None, name: str) -> bool:
    return template is not None and name in template


def _call_text(call: dict) -> str:
    fn = call.get("function", call) if isinstance(call, dict) else {}
    args = fn.get("arguments", {})
    args = args if isinstance(args, str) else _tojson(args)
    return f'<tool_call>\n{{"name": "{fn.get("name", "")}", "arguments": {args}}}\n</tool_call>'


def hermes_fallback(messages: list[dict], tools) -> list[dict]:
    """Tools, assistant tool calls and tool results written into plain messages the way Qwen's
    template writes them, for a template that handles none of them (ChatML, SmolLM2)."""
    out = []
    if tools:
        system = bool(messages) and messages[0].get("role") == "system"
        head = (messages[0].get("content") or "") + "\n\n" if system else ""
        listing = "".join("\n" + _tojson(t) for t in tools)
        out.append({"role": "system", "content": head + _TOOLS_HEAD + listing + _TOOLS_TAIL})
        messages = messages[1:] if system else messages
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            text = m.get("content") or ""
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            out.append({**m, "content": (text + "\n" if text else "") + calls})
        elif m.get("role") == "tool":
            text = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text, "_tool_results": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def render_chat(
    template: str | None,
    messages,
    *,
    add_generation_prompt: bool = True,
    tools=None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **kwargs,
) -> str:
    """Render `messages` with `template` (ChatML when None); extra kwargs reach the template."""
    messages, tools = normalize_messages(messages), _plain(tools) if tools is not None else None
    own_tools = _knows(template, "tools")
    if not _knows(template, "tool_calls") and (
        (tools and not own_tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    ):
        messages = hermes_fallback(messages, None if own_tools else tools)
        tools = tools if own_tools else None
    try:
        compiled = _compile(template if template is not None else CHATML_TEMPLATE)
        return compiled.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **kwargs,
        )
    except jinja2.exceptions.TemplateError as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        raise SparrowError(f"chat template error: {msg}") from None
    except (TypeError, KeyError, AttributeError, ValueError) as e:
        # A template indexing a missing field or concatenating None fails with plain Python errors.
        msg = " ".join(str(e).split()) or type(e).__name__
        raise SparrowError(f"chat template error: {type(e).__name__}: {msg}") from None
