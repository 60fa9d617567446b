"""Per-stage timing of a model's forwards, added from outside so that it costs nothing when off.

`with timed(model) as timer:` wraps the model's stage methods on that instance for the
duration of the block (the decoder's code never mentions timing) and restores them after.
One thread owns the model, so nothing else runs a forward while the wrappers are in place.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import wraps


class Timer:
    """Seconds spent per stage, summed over the forwards run while timing."""

    def __init__(self):
        self.attn = 0.0  # attention kernels only (scores, softmax, selection, weighted sum)
        self.mlp = 0.0  # post-attention norm + MLP (or MoE) block
        self.matmul = 0.0  # projections: qkv (+ bias, q/k norm, RoPE), o, the MLP block, lm_head
        self.total = 0.0  # whole forwards


# Decoder stage method -> the Timer fields its time counts towards.
STAGES = {
    "forward": ("total",),
    "project_qkv": ("matmul",),
    "attend": ("attn",),
    "project_out": ("matmul",),
    "mlp_block": ("mlp", "matmul"),
    "head": ("matmul",),
}


def _wrap(fn, timer: Timer, fields: tuple[str, ...]):
    @wraps(fn)
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            for f in fields:
                setattr(timer, f, getattr(timer, f) + dt)

    return run


@contextmanager
def timed(model):
    """Times the stages of `model` (a Decoder) while the block runs; yields the Timer.

    The forwards run on the staged path meanwhile: the fused decode step (models/fused.py) is
    one compiled call with no stages to time. Its tokens are the same bits, not the same speed."""
    timer = Timer()
    saved = {name: model.__dict__.get(name) for name in STAGES}  # an outer timed() block's wrappers
    fused = model.use_fused
    model.use_fused = False
    for name, fields in STAGES.items():
        setattr(model, name, _wrap(getattr(model, name), timer, fields))
    try:
        yield timer
    finally:
        model.use_fused = fused
        for name, prev in saved.items():
            if prev is None:
                del model.__dict__[name]
            else:
                setattr(model, name, prev)
