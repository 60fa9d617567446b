"""One request's tool and output-format settings, from OpenAI-shaped values to what generation needs:
the tools the chat template renders, the Constraint the engine applies, the parser for the output."""

from __future__ import annotations

from dataclasses import dataclass, field

from .grammar import Constraint, TokenIndex, check_tools, request_grammar, schema_grammar
from .spec import ResponseFormat, Tool, ToolChoice, parse_response_format, parse_tool_choice, parse_tools
from .tool_parser import ToolFormat, make_parser


@dataclass(frozen=True)
class Structured:
    tools: list[Tool] = field(default_factory=list)
    choice: ToolChoice = ToolChoice("none")
    response: ResponseFormat = ResponseFormat("text")
    parallel: bool = True  # parallel_tool_calls: a forced answer may hold several calls

    @classmethod
    def parse(cls, tools=None, tool_choice=None, response_format=None, parallel_tool_calls=None) -> Structured:
        """Validates everything (raising StructuredError with the field's name), schemas included.
        parallel_tool_calls None (unset): several calls may come, except where tool_choice names
        one function, which is a request for that one call (as OpenAI answers it)."""
        parsed = parse_tools(tools)
        check_tools(parsed)
        choice = parse_tool_choice(tool_choice, parsed)
        response = parse_response_format(response_format)
        if response.kind == "json_schema":
            schema_grammar(response.schema)  # a bad or unsupported schema fails here, before any work
        parallel = choice.mode != "function" if parallel_tool_calls is None else bool(parallel_tool_calls)
        return cls(parsed, choice, response, parallel)

    @property
    def template_tools(self) -> list[dict] | None:
        return [t.raw for t in self.tools] or None

    @property
    def forced_call(self) -> bool:
        return self.choice.mode in ("required", "function")

    @property
    def constrained(self) -> bool:
        return self.forced_call or self.response.kind != "text"

    def constraint(self, tokenizer, vocab_size: int, fmt: ToolFormat) -> Constraint | None:
        """A fresh grammar state for one sequence, or None for free text. The first call for a
        tokenizer builds its TokenIndex (0.35 s for SmolLM2); later ones take ~1.4 ms."""
        if not self.constrained:
            return None
        index = TokenIndex.of(tokenizer, vocab_size)
        grammar = request_grammar(index, self.tools, self.choice, fmt, self.response, self.parallel)
        return Constraint(index, grammar, "tools" if self.forced_call else "response_format")

    def parser(self, fmt: ToolFormat):
        """A tool-call parser for the output, or None when tool calls are not expected."""
        if not self.tools or self.choice.mode == "none":
            return None
        return make_parser(fmt, incremental=self.forced_call)
