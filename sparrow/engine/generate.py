"""Single-sequence generation as a generator: the prompt, then one token per step.

The CLI and the Python API iterate `generate_step`; the server's engine drives the same
`Sequence` objects through the same `Runner`, batching their decode steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from ..models.step import FUSED, FUSED_BATCH
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
    one compiled call, so it reports its total only (attn and mlp None); a staged one (the fused
    step off: model.use_fused = False, SPARROW_FUSED=0; or models.step.choose's other reasons)
    is split by stage, reported through the model's timer (models.timing).
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
        if timings:  # each step takes its usual path; a staged one reports its stages
            t0 = time.perf_counter()
            with timed(runner.model, stages=False) as timer:
                logits = runner.decode([seq.slot], [seq.last_token])  # [1, V]
            wall = (time.perf_counter() - t0) * 1e3
            out = seq.accept(logits[0])
            fused = timer.paths.get(FUSED, 0) + timer.paths.get(FUSED_BATCH, 0)
            out.timing = {"total": wall, "attn": None, "mlp": None} if fused else _split(timer)
        else:
            out = seq.accept(runner.decode([seq.slot], [seq.last_token])[0])
        yield out


def _split(timer: Timer) -> dict:
    return {"total": timer.total * 1e3, "attn": timer.attn * 1e3, "mlp": timer.mlp * 1e3}
