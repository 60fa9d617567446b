"""A generation request in flight: its tokens, KV cache, sampler and text/stop handling.

The model-facing side is token ids and typed settings; text only appears through the
incremental detokenizer so that stop strings and streaming deltas are handled in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import ContextLengthError
from ..params import SamplingParams, SparseParams
from .runner import Runner, Slot
from .sampling import Sampler, log_softmax, top_tokens


@dataclass
class StepOutput:
    """One generated token and the text it released."""

    token_id: int | None  # None: a request that generates nothing (scoring its prompt) finished
    text: str  # text that became final with this token (may be "" while a stop string is pending)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # [(token_id, logprob)] best first
    finish_reason: str | None = None  # "stop" | "length" | None while running
    timing: dict | None = None  # per-step times in ms when requested
    cached_tokens: int | None = None  # first output only: prompt tokens whose KV came from the prefix cache
    index: int = 0  # which of a request's n choices it belongs to
    # first output of choice 0 only, when asked: each prompt position's (token id, logprob or None for
    # the first, top alternatives or None), the logprob as decoding would report the same token
    prompt_logprobs: list | None = None
    speculative: dict | None = None  # last output of a speculative run: {"drafted_tokens", "accepted_tokens"}
    # the engine's traced requests: the sparse selections of the step that chose it, as
    # models.attention.Selections' arrays (sel, stages, nsel)
    trace: tuple | None = None


@dataclass
class Sequence:
    """A generation request: a model-facing `Slot` plus sampling, detokenisation and stops."""

    slot: Slot
    params: SamplingParams
    sampler: Sampler
    detok: object  # tokenizer.IncrementalDecoder
    eos_ids: set[int]
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    constraint: object | None = None  # a grammar's state: allowed() -> [V] bool before a sample, advance(token) after
    _pending: str = ""  # decoded text held back because it may start a stop string

    @classmethod
    def create(
        cls,
        runner: Runner,
        tokenizer,
        prompt_ids: list[int],
        params: SamplingParams,
        ctx: int,
        kv_dtype: str = "f32",
        sparse: SparseParams | None = None,
        trace: bool = False,
        constraint=None,
        images: list | None = None,
        allocate: bool = True,
        trace_mass: bool = True,
    ) -> Sequence:
        """Checks the request against the context and allocates exactly the KV it can use.
        `params` were validated where they were built (CLI, HTTP request, API keywords).
        images: the prompt's preprocessed images (Qwen3-VL, Qwen3.5), encoded into the slot here."""
        check_context(len(prompt_ids), params.max_tokens, ctx)
        capacity = len(prompt_ids) + params.max_tokens if allocate else None  # None: the engine's KV budget
        slot = runner.new_slot(prompt_ids, capacity, kv_dtype, sparse, trace, images, trace_mass)
        sampler = Sampler(params, runner.model.config.vocab_size)
        sampler.observe_prompt(prompt_ids)
        return cls(
            slot,
            params,
            sampler,
            tokenizer.incremental_decoder(skip_special_tokens=True),
            set(tokenizer.eos_token_ids),
            constraint=constraint,
        )

    def fork(self, tokenizer, params: SamplingParams, constraint, cache) -> Sequence:
        """Another choice for the same prompt, right after this one's prefill: its own sampler
        (params: its seed), grammar state and text, over `cache` (a copy of the prompt's KV, or
        None to prefill it again when the KV budget has room). Nothing sampled yet."""
        src = self.slot
        slot = Slot(src.prompt, cache, src.sparse, None, src.mm, dict(src.snapshots) if cache is not None else {})
        sampler = Sampler(params, self.sampler.vocab_size)
        sampler.observe_prompt(src.prompt)
        return Sequence(
            slot,
            params,
            sampler,
            tokenizer.incremental_decoder(skip_special_tokens=True),
            self.eos_ids,
            constraint=constraint,
        )

    @property
    def prompt(self) -> np.ndarray:
        return self.slot.prompt  # [P] int64

    @property
    def trace(self):  # Slot.trace
        return self.slot.trace

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill_done(self) -> bool:
        return self.slot.prefill_done

    @property
    def last_token(self) -> int:
        """The token the next decode step feeds: the last one sampled."""
        return self.output[-1]

    @property
    def next_input(self) -> int:
        """The token the next decode step feeds at the cache's end: the last one sampled, or,
        while a preempted sequence rebuilds its KV, the output token at that position."""
        return self.output[self.slot.cache.length - len(self.slot.prompt)]

    @property
    def caught_up(self) -> bool:
        """Whether the cache holds every position before the next sample: the prompt and all
        sampled tokens but the last (false while replaying after a preemption)."""
        return self.slot.cache.length >= len(self.slot.prompt) + len(self.output) - 1

    def accept(self, logits: np.ndarray) -> StepOutput:
        """Samples from the logits of the last position [V] and updates the stop state."""
        p = self.params
        c = self.constraint
        tok = self.sampler(logits, c.allowed() if c is not None else None)
        if c is not None:
            c.advance(tok)
        self.output.append(tok)
        self.sampler.observe(tok)
        lp = top = None
        if p.logprobs is not None:
            ls = log_softmax(logits)  # [V]
            lp = float(ls[tok])
            if p.logprobs > 0:
                top = top_tokens(ls, p.logprobs)
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            self.finish_reason = "stop"
            text, self._pending = self._pending, ""  # no stop string came: release what was held
        else:
            text = self._push_text(self.detok.push(tok))
            if not self.done and len(self.output) >= p.max_tokens:
                self.finish_reason = "length"
                text += self._push_text(self.detok.flush())  # may still complete a stop string
                if self.finish_reason == "length":
                    text, self._pending = text + self._pending, ""
        return StepOutput(tok, text, lp, top, self.finish_reason)

    def _push_text(self, piece: str) -> str:
        stops = self.params.stop
        if not stops:
            return piece
        buf = self._pending + piece
        hits = [(buf.find(s), s) for s in stops if s and buf.find(s) >= 0]
        if hits:
            idx = min(h[0] for h in hits)
            self.finish_reason = "stop"
            self._pending = ""
            return buf[:idx]
        # Hold back the longest tail that could still grow into a stop string.
        hold = 0
        for s in stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]


def check_context(n_prompt: int, max_tokens: int, ctx: int) -> None:
    if n_prompt == 0:
        raise ContextLengthError("the prompt is empty")
    if n_prompt + max_tokens > ctx:
        raise ContextLengthError(
            f"prompt has {n_prompt} tokens and max_tokens is {max_tokens}: {n_prompt + max_tokens} exceeds "
            f"the context length {ctx}"
        )
