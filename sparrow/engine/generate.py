"""Single-sequence generation as a generator: the prompt, then one token per step.

The CLI and the Python API iterate `generate_step`; the server's engine drives the same
`Sequence` objects through the same `Runner`, batching their decode steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from ..models.decoder import Segment
from ..models.step import FUSED, choose
from ..models.timing import Timer, timed
from .runner import Runner
from .sequence import Sequence, StepOutput
from .speculative import speculative_step


def generate_step(runner: Runner, seq: Sequence, timings: bool = False, spec=None) -> Iterator[StepOutput]:
    """Yields one StepOutput per generated token until the sequence finishes.

    spec: a speculative.Speculator; each step then drafts, verifies and yields every token it
    settled (the same tokens and logits as without it). With timings each of a step's tokens
    reports an equal share of the step's time, attn and mlp None.

    With timings, the first output's `timing` holds prefill stats and every later output its
    own decode step in ms: {"total", "attn", "mlp"}. A fused decode step (models/fused.py) is
    one compiled call, so it reports its total only (attn and mlp None); with the fused step
    off (model.use_fused = False, SPARROW_FUSED=0) every step is split by stage.
    """
    t0 = time.perf_counter()
    logits = runner.prefill(seq.slot)  # [V]
    prefill_s = time.perf_counter() - t0
    out = seq.accept(logits)
    if timings:
        out.timing = {"prefill_ms": prefill_s * 1e3, "prefill_tokens": len(seq.prompt)}
        if seq.slot.mm is not None:  # per image: {"ms", "tokens", "grid"} of its vision encoding
            out.timing["vision"] = seq.slot.mm.timings
    yield out
    while not seq.done and spec is not None:
        t0 = time.perf_counter()
        outs = speculative_step(runner, seq, spec)
        share = (time.perf_counter() - t0) * 1e3 / len(outs)
        for out in outs:
            if timings:
                out.timing = {"total": share, "attn": None, "mlp": None}
            if out.finish_reason:
                out.speculative = spec.counts
            yield out
    while not seq.done:
        if timings and _runs_fused(runner.model, seq.slot):
            t0 = time.perf_counter()
            logits = runner.decode([seq.slot], [seq.last_token])  # [1, V]
            out = seq.accept(logits[0])
            out.timing = {"total": (time.perf_counter() - t0) * 1e3, "attn": None, "mlp": None}
        elif timings:
            with timed(runner.model) as timer:
                logits = runner.decode([seq.slot], [seq.last_token])  # [1, V]
            out = seq.accept(logits[0])
            out.timing = _split(timer)
        else:
            out = seq.accept(runner.decode([seq.slot], [seq.last_token])[0])
        yield out


def _runs_fused(model, slot) -> bool:
    """Whether a decode step of slot alone takes the fused path (models.step.choose decides)."""
    row = Segment(np.zeros(1, np.int64), slot.cache, slot.cache.length, slot.sparse, decode=True, trace=slot.trace)
    return choose(model, [row]) == FUSED


def _split(timer: Timer) -> dict:
    return {"total": timer.total * 1e3, "attn": timer.attn * 1e3, "mlp": timer.mlp * 1e3}
