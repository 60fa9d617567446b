"""Speculative decoding whose output is plain decoding's, bit for bit.

A drafter proposes up to K tokens; one target forward checks them all; the sequence samples
at each checked position in order, exactly as plain decoding would, and keeps going while its
sample equals the drafted token. What makes this exact rather than "the same at temperature 0":

- Verification feeds the drafted tokens as decode rows (Runner.verify): one single-token
  decode segment per position, all in one forward. The linear kernels compute each of up to
  kernels.linear.SMALL_T rows as they would alone, and each row's attention reads only
  positions up to its own, which the rows before it in the same forward have just written. A
  sequence's rows append their K/V together and attend in one pass over the cache where the
  layer is exact (models.attention.verify_attention: each KV head reads its K/V once for all
  rows, each row with its own length and the arithmetic of its own decode step); sparse layers
  attend row by row, each selecting its own blocks. So row j's logits are the bits plain
  decoding computes at that position. A prefill chunk over the same tokens
  is not: its attention kernel (online softmax over 64-key steps) sums in another order,
  and its sparse settings differ (prefill runs exact unless sparse.prefill).
- Sampling: Sequence.accept runs on each row's logits in order, with the sequence's own RNG,
  penalties, grammar state and stop handling, and stops at the first sample that differs
  from the draft. Each accepted position takes one RNG draw, as in plain decoding, so seeded
  sampling gives plain decoding's tokens for any K and drafter. This is stricter than
  rejection sampling (which keeps the distribution, not the tokens): a draft is kept only when
  it is the very token this draw picks. Drafters that have logits (draft, sparse) sample with a
  copy of the sequence's sampler, the same draws, so they agree wherever their distribution
  sends the draw to the same token.
- Rollback: positions past the last checked token are dropped with KVCache.rollback, which
  also clears their K/V rows and the sparse copies of blocks they touched, so the cache equals
  plain decoding's bit for bit (importance is written by prefill only).

Drafters: ngram (prompt lookup, no model), draft (a smaller model with its own cache),
sparse (this model and cache with block-sparse attention: its rows at the drafted positions
are overwritten by the exact verification rows before anything reads them) and mtp (the
model's own multi-token-prediction layer, Qwen3.5's, with a one-layer cache of its own, fed
the target's hidden states).
"""

from __future__ import annotations

import copy

import numpy as np

from ..errors import SparrowError
from ..params import SpeculativeParams
from .handle import ModelHandle
from .runner import Runner, Slot

# Adaptive K: a sequence starts drafting FIRST_K tokens; a draft kept whole doubles K (up to
# the request's), a partly kept one sets it to what was kept plus one; a verification that kept
# nothing halves K and pauses drafting for PAUSE plain steps, twice as many after each such
# verification in a row (up to MAX_PAUSE). So a drafter that is always wrong costs 2 + 1 + 1 + ...
# rows: about 5% more rows than plain decoding at 128 tokens, 1% at 1,000 (when a checked row
# costs a decode step, as in the exact mode; less where rows share the weight reads).
FIRST_K = 2
PAUSE = 8
MAX_PAUSE = 512


class Drafter:
    """Proposes tokens to follow a sequence's text. propose() gets the sequence caught up (its
    cache holds every position before the last sampled token) and at most n; settle() hears
    how many positions of the sequence's cache are final after the verification."""

    def propose(self, seq, n: int) -> list[int]:
        raise NotImplementedError

    def settle(self, seq, length: int) -> None:
        pass

    def release(self) -> None:
        pass

    @property
    def own_cache(self):
        """A KV cache the drafter keeps besides the sequence's (charged to the KV budget), or None."""
        return None


class NgramDrafter(Drafter):
    """Prompt lookup: the longest suffix of the text so far (n tokens, down to 1) that occurred
    before, latest occurrence first; the tokens that followed it are the draft."""

    def __init__(self, max_n: int):
        self.max_n = max_n

    def propose(self, seq, n: int) -> list[int]:
        ctx = np.concatenate([seq.prompt, np.asarray(seq.output, np.int64)])  # [P + O]
        return lookup(ctx, self.max_n, n)


def lookup(ctx: np.ndarray, max_n: int, n: int) -> list[int]:
    """Up to n tokens that followed the latest earlier occurrence of ctx's longest suffix
    (max_n tokens down to 1) that has one."""
    size = len(ctx)
    for m in range(min(max_n, size - 1), 0, -1):
        suffix = ctx[size - m :]
        # starts i < size - m of earlier windows ctx[i:i+m] equal to the suffix
        hits = np.flatnonzero(ctx[: size - m] == suffix[0])
        for j in range(1, m):
            hits = hits[ctx[hits + j] == suffix[j]]
        if len(hits):
            start = int(hits[-1]) + m
            return ctx[start : start + n].tolist()
    return []


class SparseDrafter(Drafter):
    """The target model itself, decoding with block-sparse attention over the sequence's own
    cache. The positions it writes are rewritten by verification's exact rows."""

    def __init__(self, runner: Runner, params: SpeculativeParams):
        self.runner, self.sparse = runner, params.sparse

    def propose(self, seq, n: int) -> list[int]:
        s = seq.slot
        view = Slot(s.prompt, s.cache, self.sparse, None, s.mm)  # the same cache, sparse settings
        sampler = copy.deepcopy(seq.sampler)
        tok, out = seq.last_token, []
        mark = s.cache.draft_mark()  # a state the verification does not rewrite must drop the draft
        for _ in range(n):
            tok = sampler(self.runner.decode([view], [tok])[0])
            sampler.observe(tok)
            out.append(tok)
        s.cache.drop_draft(mark)
        return out


class DraftModelDrafter(Drafter):
    """A smaller model sharing the tokenizer, with a cache of its own that follows the
    sequence's text: it catches up with a prefill, drafts by decoding, and drops what the
    verification rejected."""

    def __init__(self, draft: ModelHandle, target_vocab: int, capacity: int, kv_dtype: str):
        self.runner, self.vocab = draft.runner, target_vocab
        self.slot = self.runner.new_slot(np.zeros(1, np.int64), capacity, kv_dtype)
        self.slot.cache.keep_every_row = True  # it may return to any drafted position (settle)

    def propose(self, seq, n: int) -> list[int]:
        ctx = np.concatenate([seq.prompt, np.asarray(seq.output, np.int64)])  # [P + O]
        L = len(ctx) - 1  # the target's cache length
        n = min(n, self.slot.cache.capacity - L)
        if n < 1:
            return []
        self.slot.prompt = ctx[:L]
        self.runner.prefill(self.slot)
        sampler = copy.deepcopy(seq.sampler)
        tok, out = int(ctx[L]), []
        for _ in range(n):
            tok = sampler(self.runner.decode([self.slot], [tok])[0][: self.vocab])
            sampler.observe(tok)
            out.append(tok)
        return out

    def settle(self, seq, length: int) -> None:
        self.slot.cache.truncate(min(self.slot.cache.length, length))

    def release(self) -> None:
        self.slot.cache = None

    @property
    def own_cache(self):
        return self.slot.cache


class MTPDrafter(Drafter):
    """The model's MTP layer (models/qwen3_5_mtp.py). Its row for position i takes the target's
    final-normed hidden state h_i and the token at i + 1, and gives the logits of the token at
    i + 2; its own one-layer K/V cache holds a row per position, row r at position base + r.

    The target's forwards leave their hidden rows in the sequence cache (KVCache.hidden, which
    a rollback cuts back with the positions). propose() first feeds the head the positions the
    target has made final since the last call (one forward over those rows, exact hidden
    states), whose last row drafts the first token; each further token feeds the head's own
    output y as the next h. The rows made from y are dropped after drafting, so the head's cache
    only ever holds rows of verified positions and its drafts do not depend on what earlier
    drafts were. Where the hidden rows of some positions were never computed (a prompt prefix
    reused from the prefix cache, a cache rebuilt after preemption), the head's cache restarts
    at the first position it has rows for: the drafts attend to less, the tokens are the same."""

    def __init__(self, model, seq, capacity: int, kv_dtype: str):
        self.model, self.head = model, model.mtp
        self.cache = self.head.new_cache(capacity, kv_dtype)
        self.base = 0  # the position of the head's cache row 0
        self.target = None  # the sequence cache whose hidden rows it reads
        self.watch(seq.slot.cache)  # before the prompt's prefill, where the drafter comes first

    def watch(self, cache) -> None:
        """Starts following `cache` (the sequence's; the engine hands a preempted sequence a new
        one): its forwards keep their hidden rows from now on."""
        if cache is self.target:
            return
        self.release()
        self.target, self.base = cache, 0
        self.cache.truncate(0)
        if cache is not None and cache.hidden is None:
            cache.hidden = {}

    def propose(self, seq, n: int) -> list[int]:
        self.watch(seq.slot.cache)
        if self.target.hidden is None:  # cleared by someone else: keep them from now on
            self.target.hidden = {}
        hidden, L = self.target.hidden, self.target.length  # positions 0..L-1 fed; L: the last sample's
        m = self.base + self.cache.length  # the head's next row
        if any(p not in hidden for p in range(m, L)):  # a gap: restart at the run of rows ending at L - 1
            if L - 1 not in hidden:
                return []
            p = L - 1
            while p - 1 >= m and p - 1 in hidden:
                p -= 1
            self.base = m = p
            self.cache.truncate(0)
        n = min(n, self.cache.capacity - (L - 1 - self.base))
        if m >= L or n < 1:
            return []
        ctx = np.concatenate([seq.prompt, np.asarray(seq.output, np.int64)])  # [P + O]; ctx[L] is the last sample
        rows = np.stack([hidden.pop(p) for p in range(m, L)])  # [L - m, E]
        logits, y = self.head.forward(self.model, ctx[m + 1 : L + 1], rows, self.cache, m - self.base, range(m, L))
        sampler = copy.deepcopy(seq.sampler)
        tok = sampler(logits[0])
        sampler.observe(tok)
        out = [tok]
        for j in range(1, n):
            p = L - 1 + j
            logits, y = self.head.forward(self.model, [tok], y[-1:], self.cache, p - self.base, [p])
            tok = sampler(logits[0])
            sampler.observe(tok)
            out.append(tok)
        self.cache.truncate(L - self.base)  # rows made from the head's own y: not kept
        return out

    def settle(self, seq, length: int) -> None:
        self.cache.truncate(min(self.cache.length, max(0, length - self.base)))

    def release(self) -> None:
        if self.target is not None:
            self.target.hidden = None
            self.target = None

    @property
    def own_cache(self):
        return self.cache


def check_draft_model(target, draft) -> None:
    """A draft model must share the target's tokenizer: the same ids for the same text."""
    probe = "Speculative decoding, 2026: ü 你好 def f(x):\n    return x"
    a, b = target.tokenizer, draft.tokenizer
    if a.encode(probe) != b.encode(probe):
        raise SparrowError(f"the draft model {draft.name} does not share the tokenizer of {target.name}")


class Speculator:
    """One sequence's speculation: its drafter, the draft length K (adaptive) and the counts
    usage reports (drafted, accepted)."""

    def __init__(self, params: SpeculativeParams, drafter: Drafter):
        self.params, self.drafter = params, drafter
        self.k = min(params.tokens, FIRST_K) if params.adaptive else params.tokens
        self.next_pause = PAUSE  # the pause after the next verification that keeps nothing
        self.pause = 0  # plain steps left before drafting again
        self.drafted = self.accepted = 0

    @property
    def counts(self) -> dict:
        return {"drafted_tokens": self.drafted, "accepted_tokens": self.accepted}

    def budget(self, seq) -> int:
        """How many tokens the next step may draft: K, no more than the sequence can still emit
        after the token verification always gives, 0 while paused."""
        if self.pause > 0:
            return 0
        return max(0, min(self.k, seq.params.max_tokens - len(seq.output) - 1))

    def propose(self, seq, n: int) -> list[int]:
        if n < 1:
            self.pause = max(0, self.pause - 1)
            return []
        return self.drafter.propose(seq, n)[:n]

    def settle(self, seq, draft: list[int], kept: int) -> None:
        """kept: how many drafted tokens the sequence sampled too. Rolls its cache back to the
        positions that are now final and adapts K."""
        cache = seq.slot.cache
        final = len(seq.prompt) + len(seq.output) - 1  # positions fed: all but the last sample
        cache.rollback(final)
        self.drafter.settle(seq, final)
        self.drafted += len(draft)
        self.accepted += kept
        if not self.params.adaptive:
            return
        if kept == 0:
            self.k = max(1, self.k // 2)
            self.pause, self.next_pause = self.next_pause, min(MAX_PAUSE, 2 * self.next_pause)
            return
        self.next_pause = PAUSE
        self.k = min(self.params.tokens, 2 * self.k) if kept == len(draft) else max(1, kept + 1)

    def release(self) -> None:
        self.drafter.release()


def make_speculator(model: ModelHandle, runner: Runner, params: SpeculativeParams, seq, kv_dtype: str) -> Speculator:
    """The speculator of one sequence; model.draft(path) gives a draft model (loaded once)."""
    if params.method == "ngram":
        drafter = NgramDrafter(params.ngram)
    elif params.method == "sparse":
        drafter = SparseDrafter(runner, params)
    elif params.method == "mtp":
        check_mtp(runner.model)
        capacity = len(seq.prompt) + seq.params.max_tokens + params.tokens
        drafter = MTPDrafter(runner.model, seq, capacity, kv_dtype)
    else:
        if model.draft is None:
            raise SparrowError("speculative 'draft': this model has no draft models")
        draft = model.draft(params.draft_model)
        capacity = len(seq.prompt) + seq.params.max_tokens + params.tokens
        drafter = DraftModelDrafter(draft, runner.model.config.vocab_size, capacity, kv_dtype)
    return Speculator(params, drafter)


def check_mtp(model) -> None:
    """speculative 'mtp' needs a model with an MTP layer (Qwen3.5 checkpoints that carry one)."""
    if getattr(model, "mtp", None) is None:
        raise SparrowError(
            "speculative 'mtp': this model has no MTP layer (a Qwen3.5 checkpoint with its mtp.* tensors, "
            "or a GGUF converted without --no-mtp)"
        )


def check_supported(seq, params: SpeculativeParams | None) -> None:
    """Speculation needs a text prompt and an untraced sequence (the trace records one
    selection per decode step)."""
    if params is None:
        return
    if seq.slot.trace is not None:
        raise SparrowError("speculative decoding does not combine with a sparse trace")


def accept_drafts(seq, draft: list[int], logits: np.ndarray) -> tuple[list, int]:
    """Samples at each verified position in order (logits [len(draft) + 1, V]) until a sample
    differs from the draft or the sequence ends -> (StepOutputs, drafted tokens kept)."""
    outs = []
    for j in range(len(draft) + 1):
        out = seq.accept(logits[j])
        outs.append(out)
        if seq.done or j == len(draft) or out.token_id != draft[j]:
            break
    kept = sum(o.token_id == d for o, d in zip(outs, draft))
    return outs, kept


def speculative_step(runner: Runner, seq, spec: Speculator) -> list:
    """One step of a single sequence: draft, verify in one forward, sample, roll back ->
    the StepOutputs (at least one)."""
    start = seq.slot.cache.length  # the sparse drafter writes past it; verification rewrites from here
    draft = spec.propose(seq, spec.budget(seq))
    if not draft:
        return [seq.accept(runner.decode([seq.slot], [seq.last_token])[0])]
    logits = runner.verify([seq.slot], [[seq.last_token, *draft]], [start])[0]  # [n + 1, V]
    outs, kept = accept_drafts(seq, draft, logits)
    spec.settle(seq, draft, kept)
    return outs
