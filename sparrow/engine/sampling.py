"""Sampling: penalties, logit bias, temperature, top-k, top-p, min-p, and a per-request RNG.

Each request owns a `Sampler` seeded from its `seed`, so its tokens never depend on other
requests or on thread timing. Greedy (temperature 0 or top_p 0) never touches the RNG. A grammar's mask
(structured output) comes with each call and depends only on the request's own tokens.
"""

from __future__ import annotations

import math

import numpy as np

from ..params import SamplingParams


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max()
    return (x - m - math.log(np.exp(x - m).sum())).astype(np.float32)


def top_tokens(ls: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k best (token id, logprob) of log-probabilities ls [V], best first, ties by lower id
    (a stable sort of all V, without sorting all V)."""
    k = min(k, len(ls))
    if k <= 0:
        return []
    neg = -ls
    cut = np.partition(neg, k - 1)[k - 1]
    cand = np.flatnonzero(neg <= cut)  # ascending ids: the stable sort below keeps ties by id
    best = cand[np.argsort(neg[cand], kind="stable")[:k]]
    return [(int(i), float(ls[i])) for i in best]


def prompt_logprobs(prompt: np.ndarray, start: int, rows: np.ndarray, top: int) -> list[tuple]:
    """The prompt tokens' logprobs that one prefill chunk gives: rows [T, V] are the logits of
    prompt positions start..start+T-1, each scoring the token after it (the last row of the last
    chunk scores nothing). Entries are (token id, logprob, its top alternatives or None when top
    is 0), computed as Sequence.accept computes a sampled token's; the first token, which has no
    context, gets (id, None, None)."""
    out = [(int(prompt[0]), None, None)] if start == 0 else []
    targets = prompt[start + 1 : start + len(rows) + 1]  # [T] or [T-1]
    for row, t in zip(rows, targets):
        ls = log_softmax(row)  # [V]
        out.append((int(t), float(ls[t]), top_tokens(ls, top) if top > 0 else None))
    return out


class Sampler:
    def __init__(self, params: SamplingParams, vocab_size: int):
        self.p = params
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.counts = np.zeros(vocab_size, np.int32)  # occurrences in the output so far
        self.seen = np.zeros(vocab_size, bool)  # prompt or output: what repetition_penalty acts on
        self.vocab_size = vocab_size
        # logit_bias as two arrays, applied with one indexed add (ids were checked against the vocabulary)
        bias = sorted(params.logit_bias.items())
        self.bias_ids = np.array([k for k, _ in bias], np.int64)
        self.bias_values = np.array([v for _, v in bias], np.float32)

    def observe_prompt(self, token_ids) -> None:
        self.seen[np.asarray(token_ids, dtype=np.int64)] = True

    def observe(self, token_id: int) -> None:
        self.counts[token_id] += 1
        self.seen[token_id] = True

    def __call__(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> int:
        """logits: [V] float32 for one position; allowed: [V] bool mask of a grammar (None: all
        tokens). Returns the chosen token id, always an allowed one."""
        p = self.p
        x = logits[: self.vocab_size].astype(np.float32, copy=True)  # [V]
        if p.repetition_penalty != 1.0:
            xs = x[self.seen]
            x[self.seen] = np.where(xs > 0, xs / p.repetition_penalty, xs * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            x -= p.presence_penalty * (self.counts > 0) + p.frequency_penalty * self.counts
        if len(self.bias_ids):
            x[self.bias_ids] += self.bias_values  # after the penalties, as OpenAI adds it "prior to sampling"
        n_allowed = len(x)
        if allowed is not None:
            allowed = allowed[: len(x)]
            n_allowed = int(np.count_nonzero(allowed))
            x[~allowed] = -np.inf  # after the penalties, before every filter: they only see allowed tokens
        if p.temperature == 0.0 or p.top_p == 0.0:
            return int(np.argmax(x))  # ties -> lowest id, deterministic
        x = x.astype(np.float64) / p.temperature
        order = np.argsort(-x, kind="stable")  # [V] best first, ties by id
        if p.top_k > 0:
            order = order[: p.top_k]
        xs = x[order]
        probs = np.exp(xs - xs[0])
        probs /= probs.sum()
        # Masked tokens sort last with probability 0; cutting them off means rounding in the cumulative
        # sum below can never land the draw on one.
        keep = min(len(probs), n_allowed)
        if p.top_p < 1.0:
            # Smallest prefix whose mass reaches top_p (always at least one token).
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int(np.sum(probs >= p.min_p * probs[0]))))
        probs = probs[:keep] / probs[:keep].sum()
        r = self.rng.random()
        idx = int(np.searchsorted(np.cumsum(probs), r, side="right"))
        return int(order[min(idx, keep - 1)])
