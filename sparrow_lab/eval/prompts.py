"""Seeded, offline prompt generators for long-context evaluation.

Every prompt is a chat conversation: a haystack of filler sentences with facts ("needles")
inserted on sentence boundaries at chosen depths, the question at the end of the user turn,
and an optional assistant prefix (the answer's opening) that small models need to answer at
long lengths. Lengths are token counts of the full chat prompt under the model's tokenizer.

Tasks: needle (the article's "Zara's favorite food is ramen."), passkey, and RULER-style
niah_single, niah_multikey, niah_multivalue, niah_multiquery, variable tracking.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

import numpy as np

from sparrow.errors import SparrowError
from sparrow.tokenizer import SpecialText

TOWNS = [
    "Oakton",
    "Millbrook",
    "Ashford",
    "Riverton",
    "Cedar Falls",
    "Lakeview",
    "Brookside",
    "Pinecrest",
    "Stonebridge",
    "Fairhaven",
    "Maplewood",
    "Elmhurst",
    "Westfield",
    "Greenvale",
    "Harborview",
    "Kingsport",
    "Redwood",
    "Silverton",
    "Willowdale",
    "Northgate",
    "Sunnyvale",
    "Clearwater",
    "Hillcrest",
    "Foxborough",
    "Bayside",
    "Glenwood",
    "Ironwood",
    "Larkspur",
]
STREETS = ["Main", "Elm", "Oak", "Maple", "Pine", "Cedar", "Birch", "Walnut", "Chestnut", "Spruce", "Hazel", "Mill"]
COLORS = ["red", "blue", "green", "yellow", "white", "gray", "orange", "purple", "brown", "black"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "March", "April", "June", "July", "September", "October", "November"]
WEATHER = ["rainy", "sunny", "windy", "foggy", "cold", "warm", "humid", "snowy"]
GOODS = [
    "flowers",
    "pottery",
    "wool",
    "candles",
    "books",
    "lamps",
    "rugs",
    "old maps",
]  # no foods: they distract the answer
RIVERS = ["Silver", "Blue", "Stone", "Willow", "Clear", "Swift", "Quiet", "Long"]

FILLER_TEMPLATES = [
    "The library in {town} opens at {hour} am.",
    "The bakery on {street} Street in {town} closes at {pm} pm.",
    "{town} has {n} public parks.",
    "The bus to {town} leaves every {mins} minutes.",
    "The museum in {town} was built in {year}.",
    "The post office in {town} is closed on {weekday}s.",
    "The {color} bridge in {town} crosses the {river} River.",
    "The school in {town} has {n} teachers.",
    "The market in {town} sells {goods} on {weekday}s.",
    "The train station in {town} has {small} platforms.",
    "The weather in {town} is usually {weather} in {month}.",
    "The town hall in {town} is painted {color}.",
    "The swimming pool in {town} opens in {month}.",
    "The road from {town} to {town2} is {n} miles long.",
]

# Index 0 of each list is the article's needle: seed 0 reproduces "Zara's favorite food is ramen."
NAMES = [
    "Zara",
    "Milo",
    "Priya",
    "Tomas",
    "Leila",
    "Oskar",
    "Nadia",
    "Hugo",
    "Ines",
    "Felix",
    "Amara",
    "Jonas",
    "Keiko",
    "Rafael",
    "Sofia",
    "Viktor",
]
FOODS = [
    "ramen",
    "lasagna",
    "paella",
    "dumplings",
    "tacos",
    "risotto",
    "falafel",
    "pancakes",
    "curry",
    "sushi",
    "goulash",
    "burritos",
    "pierogi",
    "gnocchi",
    "moussaka",
    "kimchi",
]
KEY_WORDS = [
    "amber",
    "falcon",
    "harbor",
    "lantern",
    "meadow",
    "quartz",
    "ripple",
    "saffron",
    "thistle",
    "velvet",
    "walrus",
    "zephyr",
    "cobalt",
    "juniper",
    "marble",
    "nectar",
]

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there."
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

TASKS = ("needle", "passkey", "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe")


@dataclass
class Prompt:
    """One generated test case. `ids` are the chat prompt's token ids (prefix included)."""

    task: str
    messages: list[dict]
    assistant_prefix: str
    answers: list[str]  # strings the output must contain (all of them, for the multi tasks)
    ids: list[int]
    target_tokens: int
    depths: list[float]  # requested depths of the inserted facts, 0..1
    needle_offsets: list[int] = field(default_factory=list)  # char offsets of facts in the user text
    meta: dict = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.ids)


def parse_length(s) -> int:
    """'1K' -> 1024, '7k' -> 7168, '1500' -> 1500."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kK]?)\s*", str(s))
    if not m:
        raise SparrowError(f"bad length {s!r}: use a token count such as 1500 or 2K")
    n = float(m.group(1)) * (1024 if m.group(2) else 1)
    if n < 64:
        raise SparrowError(f"length {s!r} is too short (at least 64 tokens)")
    return int(round(n))


def chat_ids(tokenizer, messages, assistant_prefix: str = "") -> list[int]:
    """Token ids exactly as LLM.prompt_ids builds them for chat messages (special-token text in
    them encoded as text)."""
    escaper = SpecialText(tokenizer, (messages, assistant_prefix), tokenizer.chat_template)
    messages, assistant_prefix = escaper.escape((messages, assistant_prefix))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return escaper.encode(text + assistant_prefix)


def filler_sentences(rng: random.Random, n: int) -> list[str]:
    """n varied filler facts; no person names, so the needle's name is unique in the prompt."""
    out = []
    for _ in range(n):
        t = rng.choice(FILLER_TEMPLATES)
        town, town2 = rng.sample(TOWNS, 2)
        out.append(
            t.format(
                town=town,
                town2=town2,
                street=rng.choice(STREETS),
                color=rng.choice(COLORS),
                weekday=rng.choice(WEEKDAYS),
                month=rng.choice(MONTHS),
                weather=rng.choice(WEATHER),
                goods=rng.choice(GOODS),
                river=rng.choice(RIVERS),
                hour=rng.randint(6, 11),
                pm=rng.randint(4, 10),
                n=rng.randint(2, 60),
                mins=rng.choice([5, 10, 15, 20, 30, 45]),
                year=rng.randint(1850, 1990),
                small=rng.randint(2, 9),
            )
        )
    return out


def _passkey_filler(rng: random.Random, n: int) -> list[str]:
    return [PASSKEY_FILLER] * n


class _Haystack:
    """Builds the user text: intro, filler sentences with facts at depths, then the question."""

    def __init__(self, tokenizer, rng, filler, intro, question, prefix, facts, depths, target):
        self.tok, self.rng, self.filler = tokenizer, rng, filler
        self.intro, self.question, self.prefix = intro, question, prefix
        self.facts, self.depths, self.target = facts, depths, target

    def _render(self, sents):
        # Place each fact at the sentence boundary whose cumulative filler tokens are nearest
        # its depth (the sentence lengths vary, so counting sentences would drift).
        lens = [len(self.tok.encode(" " + s)) for s in sents]
        total = sum(lens) or 1
        cum = [0]
        for n in lens:
            cum.append(cum[-1] + n)
        slots = {}
        for j in sorted(range(len(self.facts)), key=lambda j: self.depths[j]):
            b = min(range(len(cum)), key=lambda i: (abs(cum[i] / total - self.depths[j]), i))
            slots.setdefault(b, []).append(j)
        parts, offsets = [], [0] * len(self.facts)
        head = (self.intro + " ") if self.intro else ""
        pos = len(head)
        for i in range(len(sents) + 1):
            for j in slots.get(i, []):
                fact = self.facts[j]
                offsets[j] = pos
                parts.append(fact)
                pos += len(fact) + 1
            if i < len(sents):
                parts.append(sents[i])
                pos += len(sents[i]) + 1
        user = head + " ".join(parts) + "\n\n" + self.question
        return user, offsets

    def build(self, max_iter: int = 12):
        """Adds/removes filler until the chat prompt is within 1% of the target length."""
        pool = self.filler(self.rng, 64)
        per = max(4.0, sum(len(self.tok.encode(" " + s)) for s in pool) / len(pool))
        n = max(1, int(self.target / per))
        for _ in range(max_iter):
            while len(pool) < n:
                pool += self.filler(self.rng, max(64, n - len(pool)))
            user, offsets = self._render(pool[:n])
            msgs = [{"role": "user", "content": user}]
            ids = chat_ids(self.tok, msgs, self.prefix)
            err = self.target - len(ids)
            if abs(err) <= max(2, 0.01 * self.target):
                break
            step = int(round(err / per)) or (1 if err > 0 else -1)
            n = max(1, n + step)
        return msgs, ids, offsets


def _depths_for(n: int, depth: float | None, rng: random.Random) -> list[float]:
    if depth is not None and n == 1:
        return [depth]
    return sorted(rng.uniform(0.1, 0.9) for _ in range(n))


def _magic_number(rng):
    return str(rng.randint(1_000_000, 9_999_999))


def _keys(rng, n):
    return [f"{a}-{b}" for a, b in (rng.sample(KEY_WORDS, 2) for _ in range(n))]


_SYLLABLES = ("ba", "ko", "mi", "ru", "te", "la", "no", "vi", "sa", "du", "pe", "ho", "ga", "fi", "zo", "ne")
CWE_COMMON, CWE_FREQ_COMMON, CWE_FREQ_RARE = 10, 30, 3  # RULER's cwe defaults


def _cwe_words(rng: random.Random, n: int) -> list[str]:
    """n distinct made-up three-syllable words (the task counts words; their meaning is noise)."""
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(_SYLLABLES) for _ in range(3)))
    return rng.sample(sorted(words), n)


def _cwe_prompt(tokenizer, length: int, rng: random.Random, answer_prefix: bool, seed: int) -> Prompt:
    """RULER's common-words extraction (cwe), an aggregation task: a numbered list in which
    CWE_COMMON words appear CWE_FREQ_COMMON times each (fewer in short prompts) and the others
    CWE_FREQ_RARE times; the
    answer is every common word. No single block holds the answer, which is where top-k block
    selection is known to fail (MagicPIG, arXiv 2410.16179)."""
    intro = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often."
    )
    question = f"Question: What are the {CWE_COMMON} most common words in the above list?"
    prefix = f"Answer: The top {CWE_COMMON} words that appear most often in the list are:"
    pool = _cwe_words(rng, 2048)
    common, rare_pool = pool[:CWE_COMMON], pool[CWE_COMMON:]
    order_seed = rng.random()

    # common words fill at most half the list (a line is ~8 tokens), so short prompts keep rare ones
    freq = max(CWE_FREQ_RARE + 2, min(CWE_FREQ_COMMON, length // 16 // CWE_COMMON))

    def build(n_rare):
        words = common * freq + rare_pool[:n_rare] * CWE_FREQ_RARE
        order = random.Random(f"cwe-order:{n_rare}:{order_seed}").sample(words, len(words))
        listing = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(order))
        msgs = [{"role": "user", "content": f"{intro}\n{listing}\n{question}"}]
        return msgs, chat_ids(tokenizer, msgs, prefix if answer_prefix else "")

    lo, hi = 0, len(rare_pool)  # the number of rare words: the largest that stays within the length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(build(mid)[1]) <= length:
            lo = mid
        else:
            hi = mid - 1
    msgs, ids = build(lo)
    return Prompt(
        "cwe",
        msgs,
        prefix if answer_prefix else "",
        list(common),
        ids,
        length,
        [],
        [],
        {"facts": [], "rare_words": lo, "freq_common": freq, "seed": seed},
    )


def make_prompt(
    tokenizer, task: str, length: int, depth: float | None = 0.5, seed: int = 0, answer_prefix: bool = True
) -> Prompt:
    """One test case of `task` with a chat prompt of ~`length` tokens (within 1%).

    depth places the single fact of needle/passkey/niah_single; multi-fact tasks draw depths
    from the seed. answer_prefix pre-fills the assistant turn with the answer's opening.
    """
    if task not in TASKS:
        raise SparrowError(f"unknown task {task!r} (choose from {', '.join(TASKS)})")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise SparrowError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(f"{task}:{seed}")
    if task == "cwe":
        return _cwe_prompt(tokenizer, length, rng, answer_prefix, seed)
    filler, intro, meta = filler_sentences, "", {}
    if task == "needle":
        name, food = (NAMES[0], FOODS[0]) if seed == 0 else (rng.choice(NAMES), rng.choice(FOODS))
        facts, answers = [f"{name}'s favorite food is {food}."], [food]
        question, prefix = f"What is {name}'s favorite food?", f"{name}'s favorite food is"
        meta = {"name": name, "food": food}
    elif task == "passkey":
        key = str(rng.randint(10000, 99999))
        facts, answers = [f"The pass key is {key}. Remember it. {key} is the pass key."], [key]
        question, prefix = "What is the pass key?", "The pass key is"
        filler, intro = _passkey_filler, PASSKEY_INTRO
    elif task in ("niah_single", "niah_multikey"):
        keys = _keys(rng, 1 if task == "niah_single" else 4)
        vals = [_magic_number(rng) for _ in keys]
        facts = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, vals)]
        answers = [vals[0]]  # the other keys are distractors
        question = f"What is the special magic number for {keys[0]} mentioned in the provided text?"
        prefix = f"The special magic number for {keys[0]} mentioned in the provided text is"
    elif task == "niah_multivalue":
        key = _keys(rng, 1)[0]
        answers = [_magic_number(rng) for _ in range(4)]
        facts = [f"One of the special magic numbers for {key} is: {v}." for v in answers]
        question = f"What are all the special magic numbers for {key} mentioned in the provided text?"
        prefix = f"The special magic numbers for {key} mentioned in the provided text are"
    elif task == "niah_multiquery":
        keys = _keys(rng, 4)
        answers = [_magic_number(rng) for _ in keys]
        facts = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, answers)]
        question = (
            "What are the special magic numbers for " + ", ".join(keys[:-1]) + f" and {keys[-1]}"
            " mentioned in the provided text?"
        )
        prefix = (
            "The special magic numbers for "
            + ", ".join(keys[:-1])
            + f" and {keys[-1]} mentioned in the provided text are"
        )
    else:  # vt: a chain of variable assignments; the answer is every name in the chain
        value = str(rng.randint(10000, 99999))
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(5)]
        facts = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
        answers = names
        question = f"Find all variables that are assigned the value {value} in the text above."
        prefix = (
            "According to the chain of variables assigned in the text above, 5 variables are assigned the value "
            f"{value}, they are:"
        )
        meta = {"value": value}
    depths = _depths_for(len(facts), depth, rng)
    if task == "vt":
        depths = sorted(depths)  # the chain must read in order
    hay = _Haystack(tokenizer, rng, filler, intro, question, prefix if answer_prefix else "", facts, depths, length)
    msgs, ids, offsets = hay.build()
    return Prompt(
        task,
        msgs,
        prefix if answer_prefix else "",
        answers,
        ids,
        length,
        depths,
        offsets,
        dict(meta, facts=facts, question=question, seed=seed),
    )


def fact_token_depth(tokenizer, prompt: Prompt, i: int = 0) -> float:
    """Measured depth of fact i: filler tokens before it / all filler tokens of the user text."""
    user = prompt.messages[-1]["content"]
    body = user[: user.rindex("\n\n")]
    fact = prompt.meta["facts"][i]
    off = prompt.needle_offsets[i]
    before = len(tokenizer.encode(body[:off].rstrip()))
    after = len(tokenizer.encode(body[off + len(fact) :].lstrip()))
    return before / max(1, before + after)


_NAMES = ["Ada", "Bruno", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena"]
_PLACES = ["the library", "the harbour office", "the north depot", "the school hall", "the clinic", "the market"]
_THINGS = ["the roof repair", "the bus timetable", "the water meters", "the new benches", "the winter budget"]


def meeting_minutes(sentences: int, seed: int = 0) -> str:
    """A plain, varied text (minutes of meetings) of about 22 tokens a sentence: the speculative
    benches' documents (bench/speculative.py, bench/speculative_cost.py)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(sentences):
        a, b = rng.choice(_NAMES, 2, replace=False)
        out.append(
            f"On day {i + 1}, {a} met {b} at {rng.choice(_PLACES)} to discuss {rng.choice(_THINGS)}, "
            f"and they agreed to spend {int(rng.integers(2, 90)) * 10} pounds before week {int(rng.integers(2, 40))}."
        )
    return " ".join(out)
