"""Tool calling and structured output: OpenAI tools/response_format specs, llguidance grammars and
token masks, and tool-call parsers. The engine only sees a `Constraint` (allowed(), advance())."""

from .grammar import Constraint, TokenIndex, check_tools, request_grammar, schema_grammar
from .request import Structured
from .spec import (
    ResponseFormat,
    StructuredError,
    Tool,
    ToolChoice,
    parse_response_format,
    parse_tool_choice,
    parse_tools,
)
from .tool_parser import HERMES, LLAMA3_JSON, ToolFormat, make_parser, tool_format

__all__ = [
    "HERMES",
    "LLAMA3_JSON",
    "Constraint",
    "ResponseFormat",
    "Structured",
    "StructuredError",
    "TokenIndex",
    "Tool",
    "ToolChoice",
    "ToolFormat",
    "check_tools",
    "make_parser",
    "parse_response_format",
    "parse_tool_choice",
    "parse_tools",
    "request_grammar",
    "schema_grammar",
    "tool_format",
]
