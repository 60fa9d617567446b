"""String-match scorers for retrieval tasks (needle/passkey: one answer; RULER: all answers)."""

from __future__ import annotations

import re


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s).strip().lower()


def contains(output: str, answer: str) -> bool:
    """Case-insensitive: answer appears in output as a whole word ('ramen' is not in 'ramenX')."""
    a = _norm(answer)
    if not a:
        return False
    return re.search(r"(?<!\w)" + re.escape(a) + r"(?!\w)", _norm(output)) is not None


def match_all(output: str, answers: list[str]) -> float:
    """RULER string_match_all: the share of answers found."""
    return sum(contains(output, a) for a in answers) / len(answers) if answers else 0.0


def match_any(output: str, answers: list[str]) -> float:
    """RULER string_match_part: 1 if any answer is found."""
    return float(any(contains(output, a) for a in answers))


def score(task: str, output: str, answers: list[str]) -> float:
    """needle, passkey, niah_single and niah_multikey ask for one value; the rest for all."""
    if task in ("needle", "passkey", "niah_single", "niah_multikey"):
        return match_any(output, answers[:1])
    return match_all(output, answers)


def repetition_ratio(output: str, n: int = 3) -> float:
    """Share of repeated word n-grams: a collapsed output ("ramen ramen ramen ...") scores near 1."""
    words = output.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0
