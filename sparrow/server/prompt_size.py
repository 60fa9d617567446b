"""A prompt that cannot fit the context is refused before it is tokenised in full.

Tokenising costs ~2 us a character and its ids several times the text's memory: a 7.8 MB chat
message took 14 s and over a gigabyte of peak memory before the context check refused it. Here
the text is tokenised in pieces of PIECE characters, the counts summed, and counting stops as
soon as the sum shows the prompt cannot fit: the work is bounded by the context, not the body.

The sum is a lower bound of the whole text's count: pieces are cut at a space between two
non-space characters where one is near (byte-level BPE pre-tokenisers split there anyway, so the
counts add up exactly), else anywhere but inside a special token's text, and each cut is
allowed SLACK tokens it may have added. Special-token text counts one token (the chat path
encodes a client's as plain text, several tokens), so it is a lower bound there too.

A prompt that may fit is tokenised whole as before, and its exact count decides; counting in
pieces is skipped below SMALL characters, where tokenising whole costs little.
"""

from __future__ import annotations

from ..errors import ContextLengthError

PIECE = 16384  # characters tokenised at a time
SLACK = 2  # tokens one cut between pieces may add to the sum
SMALL = 32768  # characters: shorter texts are tokenised whole at once (under ~0.2 s)
# /tokenize counts past the context (as vLLM's does: a harness truncates long documents itself),
# up to this many tokens or the context if larger: ~0.5 MB of text, well under a second
TOKENIZE_MAX = 131072


LONGEST_SPECIAL = 256  # characters: longer than any special token's text


def _cut(text: str, start: int, end: int, pattern) -> int:
    """Where the piece starting at start ends: at most end, at a space between non-spaces in its
    second half if there is one, never inside a special token's text."""
    lo = start + (end - start) // 2
    i = text.rfind(" ", lo, end)
    while i > lo:
        if not text[i - 1].isspace() and not text[i + 1].isspace():
            return i
        i = text.rfind(" ", lo, i)
    if pattern is not None:
        window = max(start, end - LONGEST_SPECIAL)
        for m in pattern.finditer(text, window, min(len(text), end + LONGEST_SPECIAL)):
            if m.start() < end < m.end():
                return m.start() if m.start() > start else m.end()
    return end


def at_least(tokenizer, text: str, limit: int) -> int | None:
    """A lower bound of len(tokenizer.encode(text)) over limit, found by counting in pieces and
    stopping there; None when the text may hold limit tokens or fewer (tokenise it to know)."""
    if len(text) <= SMALL:
        return None
    pattern = tokenizer.specials_pattern()
    count = cuts = pos = 0
    while pos < len(text):
        end = min(len(text), pos + PIECE)
        if end < len(text):
            end = _cut(text, pos, end, pattern)
        count += len(tokenizer.encode(text[pos:end]))
        bound = count - SLACK * cuts
        if bound > limit:
            return bound
        cuts += 1
        pos = end
    return None


def chat_text(tokenizer, messages: list[dict], tools, kwargs: dict) -> str | None:
    """The conversation as the chat template writes it, images left out (they only add
    tokens); None when the template fails (the request's own path then reports why)."""
    plain = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        plain.append({**m, "content": content})
    try:
        return tokenizer.apply_chat_template(plain, add_generation_prompt=True, tools=tools, **kwargs)
    except Exception:  # noqa: BLE001 - any template failure is the normal path's to report
        return None


def _chars(value) -> int:
    """The characters of every string in value (dict keys too)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(k) + _chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_chars(v) for v in value)
    return 0


def _refuse(bound: int | None, max_tokens: int, ctx: int, what: str) -> None:
    """check_context's error in its words, for a count that stopped at a lower bound."""
    if bound is not None:
        raise ContextLengthError(
            f"prompt has at least {bound} tokens and max_tokens is {max_tokens}: {bound + max_tokens} exceeds "
            f"{what} {ctx}"
        )


def check_text(tokenizer, text: str, max_tokens: int, ctx: int, what: str = "the context length") -> None:
    """ContextLengthError when text's tokens and max_tokens cannot fit in ctx, found without
    tokenising more than the context's worth; nothing when it may fit. what: ctx's name in the
    error."""
    if len(text) > SMALL:
        _refuse(at_least(tokenizer, text, ctx - max_tokens), max_tokens, ctx, what)


def check_chat(
    tokenizer, messages: list[dict], tools, kwargs: dict, max_tokens: int, ctx: int, what: str = "the context length"
) -> None:
    """check_text for a conversation: the text its chat template writes."""
    if _chars((messages, tools, kwargs)) <= SMALL:
        return
    text = chat_text(tokenizer, messages, tools, kwargs)
    if text is not None:
        check_text(tokenizer, text, max_tokens, ctx, what)
