"""OpenAI `tools`, `tool_choice` and `response_format` as typed, validated objects.

Built once at the edge (an HTTP request, `LLM` keywords) from OpenAI-shaped dicts. Every
problem raises StructuredError naming the offending field the way OpenAI's `param` does
(`tools[0].function.parameters`), so the server can answer 400 with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import SparrowError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


class StructuredError(SparrowError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict  # JSON schema of the arguments object
    raw: dict  # the OpenAI tool object as given: what the chat template renders


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "auto" | "none" | "required" | "function"
    name: str | None = None  # mode "function": the one function the output must call


@dataclass(frozen=True)
class ResponseFormat:
    kind: str  # "text" | "json_object" | "json_schema"
    schema: dict | None = None  # kind "json_schema"


def parse_tools(tools) -> list[Tool]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise StructuredError("tools", "'tools' must be a list of {'type': 'function', 'function': {...}} objects")
    out, seen = [], set()
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if (
            not isinstance(t, dict)
            or t.get("type", "function") != "function"
            or not isinstance(t.get("function"), dict)
        ):
            raise StructuredError(p, f"{p} must be {{'type': 'function', 'function': {{...}}}}")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise StructuredError(f"{p}.function.name", f"{p}.function.name must match [A-Za-z0-9_-]{{1,64}}")
        if name in seen:
            raise StructuredError(f"{p}.function.name", f"two tools are named {name!r}")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise StructuredError(f"{p}.function.description", f"{p}.function.description must be a string")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise StructuredError(f"{p}.function.parameters", f"{p}.function.parameters must be a JSON schema object")
        if params.get("type", "object") != "object":
            raise StructuredError(f"{p}.function.parameters", f"{p}.function.parameters must describe an object")
        out.append(Tool(name, params, {"type": "function", "function": fn}))
    return out


def parse_tool_choice(choice, tools: list[Tool]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise StructuredError("tool_choice", "tool_choice 'required' needs 'tools'")
        return ToolChoice(choice)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise StructuredError(
            "tool_choice",
            "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
        )
    if name not in {t.name for t in tools}:
        raise StructuredError("tool_choice", f"tool_choice names the function {name!r}, which is not in 'tools'"[:300])
    return ToolChoice("function", name)


def parse_response_format(fmt) -> ResponseFormat:
    if fmt is None:
        return ResponseFormat("text")
    if not isinstance(fmt, dict):
        raise StructuredError("response_format", "'response_format' must be an object")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind != "json_schema":
        raise StructuredError("response_format.type", "response_format.type must be text, json_object or json_schema")
    js = fmt.get("json_schema")
    if not isinstance(js, dict):
        raise StructuredError("response_format.json_schema", "response_format.json_schema must be an object")
    if js.get("name") is not None and not (isinstance(js["name"], str) and _NAME.match(js["name"])):
        raise StructuredError("response_format.json_schema.name", "json_schema.name must match [A-Za-z0-9_-]{1,64}")
    schema = js.get("schema", {})
    if not isinstance(schema, dict):
        raise StructuredError("response_format.json_schema.schema", "json_schema.schema must be a JSON schema object")
    return ResponseFormat("json_schema", schema)
