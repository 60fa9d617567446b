"""Sampling: penalties, temperature, top-k, top-p, min-p, and a per-request RNG.

Each request owns a `Sampler` seeded from its `seed`, so its tokens never depend on other
requests or on thread timing. Greedy (temperature 0) never touches the RNG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import SparrowError


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/llama.cpp style: divides positive logits, multiplies negative ones
    presence_penalty: float = 0.0  # OpenAI style, subtracted once per seen token
    frequency_penalty: float = 0.0  # OpenAI style, subtracted per occurrence
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to report (0 = only the chosen token)

    def validate(self) -> "SamplingParams":
        def bad(msg):
            raise SparrowError(msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature <= 100.0):
            bad(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            bad(f"top_logprobs must be in [0, 20], got {self.logprobs}")
        return self


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max()
    return (x - m - math.log(np.exp(x - m).sum())).astype(np.float32)


class Sampler:
    def __init__(self, params: SamplingParams, vocab_size: int):
        self.p = params
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.counts = np.zeros(vocab_size, np.int32)  # occurrences in the output so far
        self.seen = np.zeros(vocab_size, bool)  # prompt or output: what repetition_penalty acts on
        self.vocab_size = vocab_size

    def observe_prompt(self, token_ids) -> None:
        self.seen[np.asarray(token_ids, dtype=np.int64)] = True

    def observe(self, token_id: int) -> None:
        self.counts[token_id] += 1
        self.seen[token_id] = True

    def __call__(self, logits: np.ndarray) -> int:
        """logits: [V] float32 for one position; returns the chosen token id."""
        p = self.p
        x = logits[: self.vocab_size].astype(np.float32, copy=True)  # [V]
        if p.repetition_penalty != 1.0:
            xs = x[self.seen]
            x[self.seen] = np.where(xs > 0, xs / p.repetition_penalty, xs * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            x -= p.presence_penalty * (self.counts > 0) + p.frequency_penalty * self.counts
        if p.temperature == 0.0:
            return int(np.argmax(x))  # ties -> lowest id, deterministic
        x = x.astype(np.float64) / p.temperature
        order = np.argsort(-x, kind="stable")  # [V] best first, ties by id
        if p.top_k > 0:
            order = order[: p.top_k]
        xs = x[order]
        probs = np.exp(xs - xs[0])
        probs /= probs.sum()
        keep = len(probs)
        if p.top_p < 1.0:
            # Smallest prefix whose mass reaches top_p (always at least one token).
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int(np.sum(probs >= p.min_p * probs[0]))))
        probs = probs[:keep] / probs[:keep].sum()
        r = self.rng.random()
        idx = int(np.searchsorted(np.cumsum(probs), r, side="right"))
        return int(order[min(idx, keep - 1)])
