"""The one driver of the model: every forward that generation, serving, benchmarks and the
evaluation run goes through `Runner`.

It is the only place that cuts a prompt into prefill chunks and a decode step into forwards,
so all callers share the rules that keep results reproducible:
- prefill chunks start at multiples of `prefill_chunk` from where the cache stands, so a
  prompt's logits depend only on the prompt (and the chunk size), never on the caller;
- a decode forward holds at most `kernels.linear.SMALL_T` rows: up to that many rows the
  linear kernels compute each row exactly as they would alone (above it they switch to the
  prefill GEMM), so a token is bit-identical alone or beside other sequences.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np

from ..errors import SparrowError
from ..kernels import linear as _linear
from ..memory import drop_compiler_pages, release_memory
from ..models.attention import Selections
from ..models.decoder import Segment
from ..params import SparseParams
from ..state.cache import KVCache
from ..state.sparse import thin_snapshots

PREFILL_CHUNK = 512  # tokens per prefill forward: keeps the activations of a long prompt small


@dataclass
class Slot:
    """The model-facing state of one sequence: its prompt, KV cache and attention settings.

    The cache's `length` is where the next token goes; prefill runs until it covers the prompt.
    """

    prompt: np.ndarray  # [P] int64
    cache: KVCache | None  # None while the engine holds no KV for it (queued or preempted)
    sparse: SparseParams | None = None
    # sparse decode appends (layer, per-head selection records with their mass) to a list, or
    # writes each step's selections as arrays to a Selections (models.attention)
    trace: list | Selections | None = None
    mm: object | None = None  # models.qwen3_vl.MultimodalPrompt when the prompt holds images
    snapshots: dict = field(default_factory=dict)  # prefill boundary -> [L, b] importance (prefix cache)

    @property
    def prefill_done(self) -> bool:
        return self.cache.length >= len(self.prompt)


def decode_groups(n: int, rows: int) -> list[range]:
    """Splits n sequences into the fewest forwards of at most `rows`, sizes as even as possible."""
    if n == 0:
        return []
    k = -(-n // max(1, rows))
    base, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        size = base + (i < extra)
        out.append(range(start, start + size))
        start += size
    return out


class Runner:
    def __init__(self, model, prefill_chunk: int = PREFILL_CHUNK):
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        self.model = model
        self.prefill_chunk = prefill_chunk

    def new_slot(
        self,
        prompt,
        capacity: int | None,
        kv_dtype: str = "f32",
        sparse: SparseParams | None = None,
        trace: bool = False,
        images: list | None = None,
        trace_mass: bool = True,
    ) -> Slot:
        """A slot with a fresh cache of `capacity` positions (prompt plus what it may generate).
        images: preprocessed images (vision.preprocess) for the prompt's image pads, encoded here.
        trace: sparse decode records its selections in slot.trace: per-head records with each
        head's softmax mass inside them (a list), or with trace_mass False, as arrays without
        it (a models.attention.Selections, which the fused step fills too)."""
        prompt = np.asarray(prompt, np.int64)
        mm = None
        if hasattr(self.model, "prepare"):  # an image model: pads and images must match
            mm = self.model.prepare(prompt, images or [])
        elif images:
            raise SparrowError("this model is text-only: it does not take images")
        cache = None if capacity is None else self.model.new_cache(capacity, kv_dtype)  # None: the engine's budget
        recorder = ([] if trace_mass else Selections()) if trace else None
        return Slot(prompt, cache, sparse, recorder, mm)

    def prefill_step(self, slot: Slot, end: int | None = None, rows: list | None = None) -> np.ndarray | None:
        """Runs the next chunk of the prompt (up to position `end`, default the whole prompt).

        Returns the logits [V] of the chunk's last position, or None when there was nothing to
        run. rows: a list that receives the logits [T, V] of every position of the chunk (prompt
        logprobs); only then does the head run over all of them, so other prefills pay nothing.
        The returned last position's logits have the same bits either way."""
        end = len(slot.prompt) if end is None else min(end, len(slot.prompt))
        start = slot.cache.length
        if start >= end:
            return None
        stop = min(end, start + self.prefill_chunk)
        vision = slot.mm.segment(start, stop) if slot.mm is not None else None
        seg = Segment(slot.prompt[start:stop], slot.cache, start, slot.sparse, vision=vision)
        if rows is None:
            logits = self.model.forward([seg])[0]  # [V]
        else:
            every, last = self.model.forward([seg], all_logits=True, with_last=True)  # [T, V], [1, V]
            rows.append(every)
            logits = last[0]
        release_memory()  # the chunk's transient arrays and the pages of kernels' loading
        if stop % self.prefill_chunk == 0:  # a boundary the prefix cache may reuse from
            slot.snapshots[stop] = slot.cache.importance_snapshot()  # [L, stop]
            thin_snapshots(slot.snapshots, self.prefill_chunk)
            slot.cache.checkpoint(self.prefill_chunk)  # what the cache keeps at a boundary (state/)
        return logits

    def prefill(self, slot: Slot, end: int | None = None) -> np.ndarray | None:
        """Runs the prompt (up to `end`) in chunks; the logits [V] of the last position run."""
        logits = None
        while (step := self.prefill_step(slot, end)) is not None:
            logits = step
        return logits

    @staticmethod
    def decode_groups(n: int) -> list[range]:
        """How `decode` splits n sequences into forwards (callers that handle each forward's
        failure on its own iterate these and pass one group at a time)."""
        return decode_groups(n, _linear.SMALL_T)  # read each step: the kernels' threshold may change

    def decode(self, slots: list[Slot], tokens) -> np.ndarray:
        """Feeds tokens[i] to slots[i] at its cache's end, one position each -> logits [B, V]."""
        tokens = np.asarray(tokens, np.int64)  # [B]
        if len(tokens) != len(slots):
            raise ValueError(f"{len(slots)} slots but {len(tokens)} tokens")
        out = []
        for g in self.decode_groups(len(slots)):
            segs = [
                Segment(
                    tokens[i : i + 1],
                    slots[i].cache,
                    slots[i].cache.length,
                    slots[i].sparse,
                    decode=True,
                    trace=slots[i].trace,
                    rope_delta=slots[i].mm.rope_delta if slots[i].mm is not None else 0,
                )
                for i in g
            ]
            out.append(self.model.forward(segs))  # [len(g), V]
        drop_compiler_pages()  # if this step loaded kernels
        return out[0] if len(out) == 1 else np.concatenate(out)

    def verify(self, slots: list[Slot], tokens: list, starts: list[int]) -> list[np.ndarray]:
        """Feeds tokens[i] (a list) to slots[i] at positions starts[i], starts[i] + 1, ...,
        each as its own single-token decode row -> logits [len(tokens[i]), V] per slot.

        A row's logits are the bits a decode step at that position gives (speculative.py): rows
        of one sequence go in position order, so each attends over what the rows before it
        wrote, and a forward holds at most SMALL_T rows, so each row is computed as alone."""
        rows = [(i, j) for i, toks in enumerate(tokens) for j in range(len(toks))]
        out: list = [[None] * len(t) for t in tokens]
        with ExitStack() as rows_kept:  # a state that cannot be cut back keeps each row's, to roll back to
            for s in slots:
                rows_kept.enter_context(s.cache.keeping_every_row())
            self._verify_rows(slots, tokens, starts, rows, out)
        drop_compiler_pages()  # if this step loaded kernels
        return [np.stack(o) for o in out]

    def _verify_rows(self, slots, tokens, starts, rows, out) -> None:
        for g in self.decode_groups(len(rows)):
            segs = []
            for i, j in (rows[r] for r in g):
                s = slots[i]
                segs.append(
                    Segment(
                        np.asarray(tokens[i][j : j + 1], np.int64),
                        s.cache,
                        starts[i] + j,
                        s.sparse,
                        decode=True,
                        trace=s.trace,
                        rope_delta=s.mm.rope_delta if s.mm is not None else 0,
                    )
                )
            logits = self.model.forward(segs)  # [len(g), V]
            for (i, j), row in zip((rows[r] for r in g), logits):
                out[i][j] = row
