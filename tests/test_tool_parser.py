"""Tool-call parsers on hand-written model outputs: calls, text around them, malformed JSON, and
every way a stream can cut them into pieces."""

from __future__ import annotations

import json

import pytest

from sparrow.structured import HERMES, LLAMA3_JSON, make_parser, tool_format
from sparrow.structured.tool_parser import HermesParser, Llama3JsonParser

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "lookup", "arguments": {"q": "a } b", "n": [1, {"x": "}"}]}}\n</tool_call>'
WANT_A = ("get_weather", {"city": "Paris", "unit": "c"})
WANT_B = ("lookup", {"q": "a } b", "n": [1, {"x": "}"}]})


def run(parser, pieces):
    """Feeds pieces (the last one final); returns content, the deltas, and the calls as (name, args)."""
    content, deltas = [], []
    for i, piece in enumerate(pieces):
        c, d = parser.push(piece, final=i == len(pieces) - 1)
        content.append(c)
        deltas += d
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parser.calls]
    return "".join(content), deltas, calls


def reassemble(deltas) -> list[dict]:
    """What an OpenAI client builds from streamed tool-call deltas."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls and d["type"] == "function" and d["function"]["arguments"] == ""
            calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


CASES = [
    (CALL_A, "", [WANT_A]),
    ("Let me check.\n" + CALL_A, "Let me check.", [WANT_A]),
    (CALL_A + "\n" + CALL_B, "", [WANT_A, WANT_B]),
    ("Two calls:\n" + CALL_B + "\n" + CALL_A + "\nDone.", "Two calls:\nDone.", [WANT_B, WANT_A]),
    ("no calls here, only a <tool and a </tool_call>", "no calls here, only a <tool and a </tool_call>", []),
    ("  a < b  ", "  a < b  ", []),
]


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("text,content,calls", CASES)
def test_hermes_whole_and_every_split(text, content, calls, incremental):
    whole = run(HermesParser(incremental), [text])
    assert (whole[0], whole[2]) == (content, calls)
    for cut in range(len(text) + 1):
        got = run(HermesParser(incremental), [text[:cut], text[cut:]])
        assert (got[0], got[2]) == (content, calls), cut
    p = HermesParser(incremental)
    c, deltas, got = run(p, list(text) + [""])
    assert (c, got) == (content, calls)
    streamed = reassemble(deltas)
    assert [(s["id"], s["name"], s["arguments"]) for s in streamed] == [
        (x["id"], x["function"]["name"], x["function"]["arguments"]) for x in p.calls
    ]


def test_hermes_incremental_streams_argument_fragments():
    p = HermesParser(incremental=True)
    _, deltas, calls = run(p, list(CALL_B) + [""])
    assert calls == [WANT_B]
    assert deltas[0]["function"] == {"name": "lookup", "arguments": ""}
    fragments = [d["function"]["arguments"] for d in deltas[1:]]
    assert len(fragments) > 10  # arguments arrive as they are generated, not in one piece at the end
    assert "".join(fragments) == '{"q": "a } b", "n": [1, {"x": "}"}]}'
    # The name is out before the arguments are finished.
    p = HermesParser(incremental=True)
    head = CALL_A[: CALL_A.index('"Paris"')]
    _, deltas = p.push(head)
    assert deltas and deltas[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "f", "arguments": {"a": 1}',  # unbalanced
        '{"name": "f", "arguments": [1, 2]}',  # arguments not an object
        '{"arguments": {}}',  # no name
        "not json at all",
        '{"name": "f", "arguments": "{broken"}',
    ],
)
def test_hermes_malformed_stays_content(body):
    text = f"Before.\n<tool_call>\n{body}\n</tool_call> after"
    content, deltas, calls = run(HermesParser(), [text])
    assert calls == [] and deltas == []
    assert content == text.replace("Before.\n", "Before.")
    for cut in range(len(text) + 1):  # and the same for any split
        assert run(HermesParser(), [text[:cut], text[cut:]])[0] == content


def test_hermes_arguments_as_json_string_and_valid_after_malformed():
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call><tool_call>\nnope\n</tool_call>'
    content, _, calls = run(HermesParser(), [text])
    assert calls == [("f", {"a": 1})]
    assert content == "<tool_call>\nnope\n</tool_call>"


def test_hermes_unfinished_call():
    text = 'Hi\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert run(HermesParser(), [text]) == (text.replace("Hi\n", "Hi"), [], [])  # held, then given back as content
    p = HermesParser(incremental=True)  # cut off by max_tokens while streaming: the call keeps what it had
    outs = [p.push(c) for c in text] + [p.push("", final=True)]
    assert "".join(o[0] for o in outs) == "Hi" and p.calls[0]["function"]["arguments"] == '{"city": "Pa'


def test_hermes_call_cut_anywhere_keeps_only_its_arguments():
    """A forced call cut by max_tokens (incremental parser): whole or streamed, its arguments are as
    far as they got and never hold the wrapper's `}`, newline or part of `</tool_call>` (issue 38:
    '{"city": "Paris"}}\n</tool_call' came back as arguments)."""
    args = '{"city": "Paris", "unit": "c"}'
    start = CALL_A.index(args)
    for cut in range(start + 1, len(CALL_A)):
        text = CALL_A[:cut]
        for pieces in ([text], list(text) + [""]):
            p = HermesParser(incremental=True)
            content, deltas, _ = run_raw(p, pieces)
            got = p.calls[0]["function"]["arguments"]
            assert content == "" and args.startswith(got), (cut, got)
            assert reassemble(deltas)[0]["arguments"] == got
            if cut >= start + len(args):
                assert got == args, cut


def run_raw(parser, pieces):
    """run() without parsing the calls' arguments (a cut call's do not parse)."""
    content, deltas = [], []
    for i, piece in enumerate(pieces):
        c, d = parser.push(piece, final=i == len(pieces) - 1)
        content.append(c)
        deltas += d
    return "".join(content), deltas, parser.calls


def test_llama3_json():
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    two = one + '; {"name": "lookup", "parameters": {"q": "x"}}'
    assert run(Llama3JsonParser(), [one])[2] == [("get_weather", {"city": "Paris"})]
    assert run(Llama3JsonParser(), list(two) + [""])[2] == [("get_weather", {"city": "Paris"}), ("lookup", {"q": "x"})]
    for text in ["The weather is fine.", '{"name": "f", "parameters": {', '{"a": 1}', "  {not json}"]:
        assert run(Llama3JsonParser(), list(text) + [""])[:3:2] == (text, [])
    content, deltas, _ = run(Llama3JsonParser(), [one])
    assert content == "" and reassemble(deltas)[0]["arguments"] == '{"city": "Paris"}'


def test_format_per_model_family():
    assert tool_format("{{ '<tool_call>' }} {% if tools %}") is HERMES  # Qwen2/Qwen3
    assert tool_format("{{ '<|python_tag|>' }} {{ 'parameters' }}") is LLAMA3_JSON  # Llama 3.1+
    assert tool_format(None) is HERMES  # no template: ChatML and sparrow's hermes tools prompt
    assert isinstance(make_parser(LLAMA3_JSON), Llama3JsonParser) and isinstance(make_parser(HERMES), HermesParser)
