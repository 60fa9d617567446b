"""Single-sequence generation as a generator: the prompt, then one token per step.

The CLI and the Python API iterate `generate_step`; the server's engine drives the same
`Sequence` objects through the same `Runner`, batching their decode steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from ..models.timing import Timer, timed
from .runner import Runner
from .sequence import Sequence, StepOutput


def generate_step(runner: Runner, seq: Sequence, timings: bool = False) -> Iterator[StepOutput]:
    """Yields one StepOutput per generated token until the sequence finishes.

    With timings, the first output's `timing` holds prefill stats and every later output its
    own decode step split: {"total", "attn", "mlp"} in ms.
    """
    t0 = time.perf_counter()
    logits = runner.prefill(seq.slot)  # [V]
    prefill_s = time.perf_counter() - t0
    out = seq.accept(logits)
    if timings:
        out.timing = {"prefill_ms": prefill_s * 1e3, "prefill_tokens": len(seq.prompt)}
    yield out
    while not seq.done:
        if timings:
            with timed(runner.model) as timer:
                logits = runner.decode([seq.slot], [seq.last_token])  # [1, V]
            out = seq.accept(logits[0])
            out.timing = _split(timer)
        else:
            out = seq.accept(runner.decode([seq.slot], [seq.last_token])[0])
        yield out


def _split(timer: Timer) -> dict:
    return {"total": timer.total * 1e3, "attn": timer.attn * 1e3, "mlp": timer.mlp * 1e3}
