"""Constrained decoding with llguidance: grammars from JSON schemas and tool lists, and each
sequence's allowed-token mask, computed on the CPU before every sample.

Why llguidance. Measured here (2 shared cores) on the default model's 49,152-token vocabulary
with a nested schema (object in object, enum, array, pattern, required) and a 56-token answer:
- llguidance 1.9.1: grammar + matcher 1.4 ms per request; mask 0.048 ms a token (median,
  unpacked to booleans), 2.4 ms worst; recursive `$ref`s are real recursion (Earley parser);
  Lark grammars embed JSON schemas (`%json`), which is how a tool call's `<tool_call>` tags
  wrap its arguments; no dependencies.
- outlines-core 0.2.14: mask 0.007 ms a token, but 134 ms to build the regex index of that one
  schema (every request may bring a new one); recursion is unrolled to a fixed depth; its
  vocabulary is text, so byte tokens that are not UTF-8 on their own need extra handling.
- xgrammar 0.2.8: requires torch, transformers and triton at run time, which sparrow does not.
Both masks are under 1% of a ~10 ms decode step; the per-request compile decided.
"""

from __future__ import annotations

import json
import threading
import time
import weakref

import llguidance
import numpy as np

from .spec import ResponseFormat, StructuredError, Tool, ToolChoice

# One spelling of JSON: ", " and ": " as json.dumps writes them (what models have seen most), and no
# other whitespace, so a small model cannot wander into endless newlines inside an object.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class TokenIndex:
    """llguidance's view of a tokenizer; building it takes 0.35 s (SmolLM2) to 1.3 s (Qwen3)."""

    def __init__(self, tokenizer, vocab_size: int):
        # The tokenizers-library JSON carries added and special tokens exactly as the model uses them.
        spec = tokenizer._tk.to_str()
        eos = list(tokenizer.eos_token_ids) or None
        self.ll = llguidance.LLTokenizer(spec, n_vocab=vocab_size, eos_token=eos)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(tokenizer.eos_token_ids)

    @classmethod
    def of(cls, tokenizer, vocab_size: int) -> TokenIndex:
        with _lock:
            idx = _indexes.get(tokenizer)
            if idx is None or idx.vocab_size != vocab_size:
                idx = _indexes[tokenizer] = cls(tokenizer, vocab_size)
            return idx

    def literal(self, text: str) -> str:
        """A Lark term for text: the model's own special token when text is one (Qwen's
        `<tool_call>`), since the grammar would otherwise spell it out of smaller tokens."""
        ids = self.tokenizer.encode(text)
        if len(ids) == 1 and self.ll.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text, ensure_ascii=False)


def _styled(schema: dict) -> dict:
    # A request's own llguidance options are replaced, not merged: "lenient" would let unsupported
    # keywords through silently, and the output would no longer be sure to validate.
    return {**schema, "x-guidance": JSON_STYLE}


def _check(grammar: str, param: str, what: str) -> str:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise StructuredError(param, f"{what}: {' '.join(messages[0].split())}"[:500])
    return grammar


def admits_finite_value(schema) -> bool:
    """Whether some finite JSON value can satisfy schema, as far as `$ref` cycles decide it: false
    for `{"$ref": "#"}` or an object that requires a property of its own type, whose only values
    would nest without end (llguidance compiles them; the matcher then allows no first token, or
    only an opening brace forever). Other keywords count as satisfiable: llguidance checks them.

    A least fixpoint over the `$ref` targets: each starts unsatisfiable and becomes satisfiable
    when its schema is, given the targets known so far; a pass costs one walk of each target."""
    targets: dict[str, object] = {}  # pointer -> the schema it names

    def collect(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref not in targets:
                target = _resolve(schema, ref)
                if target is not _UNRESOLVED:
                    targets[ref] = target
                    collect(target)
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    collect(schema)
    known = dict.fromkeys(targets, False)
    changed = True
    while changed:
        changed = False
        for ref, target in targets.items():
            if not known[ref] and _satisfiable(target, known):
                known[ref] = changed = True
    return _satisfiable(schema, known)


_UNRESOLVED = object()


def _resolve(root, ref: str):
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return _UNRESOLVED  # another document: llguidance refuses it
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _UNRESOLVED
    return node


def _satisfiable(node, known: dict) -> bool:
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref in known and not known[ref]:
        return False
    for key in ("anyOf", "oneOf"):
        alts = node.get(key)
        if isinstance(alts, list) and alts and not any(_satisfiable(a, known) for a in alts):
            return False
    all_of = node.get("allOf")
    if isinstance(all_of, list) and not all(_satisfiable(a, known) for a in all_of):
        return False
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if types is None or any(t not in ("object", "array") for t in types):
        return True  # a scalar type (or any type) ends at once
    return ("object" in types and _object_ok(node, known)) or ("array" in types and _array_ok(node, known))


def _object_ok(node: dict, known: dict) -> bool:
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    return all(_satisfiable(props[name], known) for name in required if isinstance(name, str) and name in props)


def _array_ok(node: dict, known: dict) -> bool:
    n = node.get("minItems", 0)
    if not isinstance(n, int) or n <= 0:
        return True
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    if not all(_satisfiable(p, known) for p in prefix[:n]):
        return False
    return n <= len(prefix) or _satisfiable(node.get("items", True), known)


def schema_grammar(schema: dict, param: str = "response_format.json_schema.schema") -> str:
    if not admits_finite_value(schema):
        raise StructuredError(
            param, "the JSON schema admits no finite value: its $ref recursion never ends (nothing could be generated)"
        )
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_styled(schema))
    except (ValueError, TypeError) as e:
        raise StructuredError(param, f"invalid JSON schema: {e}"[:500]) from None
    return _check(grammar, param, "unsupported or invalid JSON schema")


def _call_schema(tool: Tool, args_key: str) -> dict:
    """{"name": <const>, args_key: <parameters>}, with the parameters' `$defs` moved to the root so
    that their `#/$defs/...` references still resolve."""
    params = dict(tool.parameters)
    defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    return _styled(
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, args_key: params},
            "required": ["name", args_key],
            "additionalProperties": False,
            **defs,
        }
    )


def check_tools(tools: list[Tool]) -> None:
    """Every tool's parameter schema must compile; the error names the tool."""
    for i, tool in enumerate(tools):
        schema_grammar(tool.parameters, f"tools[{i}].function.parameters")


def tool_grammar(index: TokenIndex, tools: list[Tool], choice: ToolChoice, fmt, parallel: bool = True) -> str:
    """Output that is valid calls of the chosen tools: one or more (hermes; one unless parallel),
    or one (llama3_json)."""
    chosen = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    rules = [f"fn{i}: %json {json.dumps(_call_schema(t, fmt.args_key))}" for i, t in enumerate(chosen)]
    alts = " | ".join(f"fn{i}" for i in range(len(chosen)))
    if fmt.open is None:
        lark = f"start: {alts}\n"
    else:
        o, c = index.literal(fmt.open), index.literal(fmt.close)
        more = ' ("\\n" call)*' if parallel else ""
        lark = f'start: call{more}\ncall: {o} "\\n" ({alts}) "\\n" {c}\n'
    return _check(llguidance.LLMatcher.grammar_from_lark(lark + "\n".join(rules) + "\n"), "tools", "tool grammar")


def request_grammar(
    index, tools: list[Tool], choice: ToolChoice, fmt, response: ResponseFormat, parallel: bool = True
) -> str | None:
    """The grammar a request's output must follow, or None when it is free text. A forced tool
    call wins over response_format (the answer is then the call, not a message)."""
    if choice.mode in ("required", "function"):
        return tool_grammar(index, tools, choice, fmt, parallel)
    if response.kind == "json_object":
        return schema_grammar({"type": "object"})
    if response.kind == "json_schema":
        return schema_grammar(response.schema)
    return None


class Constraint:
    """One sequence's grammar state. The engine calls `allowed()` before each sample (a bool
    mask over the model's vocabulary) and `advance(token)` after it; once the grammar is
    complete only end-of-turn tokens are allowed, so the sequence finishes with "stop"."""

    def __init__(self, index: TokenIndex, grammar: str, param: str = "response_format"):
        self.matcher = llguidance.LLMatcher(index.ll, grammar, log_level=0)
        if self.matcher.is_error():
            raise StructuredError(param, f"grammar error: {self.matcher.get_error()}"[:500])
        self.vocab_size = index.vocab_size
        self.eos_ids = index.eos_ids
        self._bits = np.full((index.vocab_size + 31) // 32, -1, np.int32)
        # The first mask, once, here: a grammar that allows no first token (an empty language) is the
        # request's error, not an empty answer that finished with "stop" (allowed()'s fallback).
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self.matcher.is_error() or not self._bits.any():
            raise StructuredError(param, "the grammar admits no output: nothing could be generated")
        self.seconds = 0.0  # time spent in mask computation and token consumption (for measurements)

    def allowed(self) -> np.ndarray:
        t0 = time.perf_counter()
        m = self.matcher
        if not m.is_error():
            m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            mask = np.unpackbits(self._bits.view(np.uint8), count=self.vocab_size, bitorder="little").view(bool)
        if m.is_error() or not mask.any():
            # Cannot happen with masked sampling; if the matcher ever fails, end the turn instead of crashing.
            mask = np.zeros(self.vocab_size, bool)
            mask[self.eos_ids] = True
        self.seconds += time.perf_counter() - t0
        return mask

    def advance(self, token_id: int) -> None:
        t0 = time.perf_counter()
        self.matcher.consume_token(int(token_id))
        self.seconds += time.perf_counter() - t0
