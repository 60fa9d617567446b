"""Per-stage timing of a model's forwards through an explicit hook.

A model's `timer` is None when off: each stage of the staged forward (Decoder's stage methods,
and Qwen3.5's gated attention and Gated DeltaNet mixing) checks it once and, when set, adds its
seconds to the Timer's fields (`Timer.add`). `with timed(model) as timer:` sets it for the
duration of the block and restores the previous one after; nothing of the model is replaced.
One thread owns the model, so nothing else runs a forward while a timer is set.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

# Stage -> the Timer fields its time counts towards.
STAGES = {
    "forward": ("total",),
    "project_qkv": ("matmul",),
    "attend": ("attn",),
    "project_out": ("matmul",),
    "mlp_block": ("mlp", "matmul"),
    "head": ("matmul",),
}


class Timer:
    """Seconds spent per stage, summed over the forwards run while timing. stages: the forwards
    run staged (models.step.choose), so that every one is split by stage (the fused step is one
    call); else they take their usual path and only the staged ones report stages. `paths`
    counts the forwards by the path they took (models.step.PATHS). An outer timer (a timed()
    block around this one) sees the same seconds."""

    def __init__(self, stages: bool = True, outer: Timer | None = None):
        self.attn = 0.0  # attention kernels only (scores, softmax, selection, weighted sum; a DeltaNet's mixing)
        self.mlp = 0.0  # post-attention norm + MLP (or MoE) block
        self.matmul = 0.0  # projections: qkv (+ bias, q/k norm, RoPE), o, the MLP block, lm_head
        self.total = 0.0  # whole forwards
        self.stages = stages
        self.paths: dict[str, int] = {}
        self.outer = outer

    def add(self, stage: str, t0: float) -> None:
        """A stage (STAGES) that started at time.perf_counter() t0 has ended."""
        dt = time.perf_counter() - t0
        t = self
        while t is not None:
            for f in STAGES[stage]:
                setattr(t, f, getattr(t, f) + dt)
            t = t.outer

    def forward(self, path: str, t0: float) -> None:
        """A forward that took `path` (models.step.PATHS) and started at t0 has ended."""
        self.add("forward", t0)
        t = self
        while t is not None:
            t.paths[path] = t.paths.get(path, 0) + 1
            t = t.outer


@contextmanager
def timed(model, stages: bool = True):
    """Times the forwards of `model` (a Decoder) while the block runs; yields the Timer.

    stages=True: the forwards run on the staged path meanwhile (models.step.choose): the fused
    decode step (models/fused.py) is one compiled call with no stages to time. Its tokens are
    the same bits, not the same speed. stages=False: each forward takes its usual path."""
    outer = model.timer
    timer = Timer(stages or (outer is not None and outer.stages), outer)
    model.timer = timer
    try:
        yield timer
    finally:
        model.timer = outer
