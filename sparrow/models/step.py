"""The one place that decides how a forward runs, as kernels.linear.choose decides a matmul.

`Decoder.forward` asks `choose` and runs what it names; every path gives the same bits, so the
choice changes speed only. Whether a model can take the fused step at all is decided once,
when it is planned (`FusedDecode.plan`: block-format projections with matching formats inside
each fused group, Qwen3.5's Gated DeltaNet layers included; None for any other model).
"""

from __future__ import annotations

import os

FUSED = "fused"  # one sequence's decode step as one compiled call (FusedDecode.__call__)
FUSED_BATCH = "fused_batch"  # decode rows of several sequences, or one's verification rows (FusedDecode.batch)
BACKOFF = "backoff"  # a step the fused path would take, run staged after contention (FusedDecode.staged_step)
STAGED = "staged"  # the stage by stage forward (Decoder._staged): prefill, traced rows, every other case
PATHS = (FUSED, FUSED_BATCH, BACKOFF, STAGED)


def fused_switch() -> bool:
    """SPARROW_FUSED=0 turns the fused step off: read once, where a model is built
    (models.build_model sets the model's `use_fused` from it); tests and benchmarks flip
    `use_fused` on the model itself."""
    return os.environ.get("SPARROW_FUSED", "1") != "0"


def choose(model, segments, all_logits: bool = False) -> str:
    """The path a forward of `segments` (models.decoder.Segment) takes on `model`: one of PATHS.

    - STAGED when every position's logits are asked for (all_logits: the fused steps give each
      segment's last row only), when the model's fused step is off (`model.use_fused`: the
      SPARROW_FUSED switch, or a test or benchmark that wants the staged path), while a timer
      times the stages (`model.timer`, a models.timing.Timer with stages: the fused step is
      one call), or when the model has no fused step (`model.fused_step()` is None: FusedDecode.plan refused its
      weights).
    - A single sequence's decode step (one segment, decode): FUSED unless its trace is a list
      (per-head records with their softmax mass, which the fused step does not write; a
      models.attention.Selections trace is filled by either path), which runs STAGED.
    - Several segments: FUSED_BATCH when FusedDecode.batches takes them (2 to SMALL_T untraced
      single-token decode rows, no images, one row a sequence or, with exact attention, one
      sequence's verification rows at consecutive positions); else STAGED (prefill chunks,
      traced rows, mixed batches).
    - Contention: after a fused step whose workers waited long at its barriers
      (models/fused.py), the next steps the fused path would take (a sequence's, a batch's or a
      verification's) take BACKOFF instead (the staged forward, counted and timed per row)
      until FusedDecode.backoff runs out.
    """
    if all_logits or not model.use_fused:
        return STAGED
    if model.timer is not None and model.timer.stages:
        return STAGED
    plan = model.fused_step()
    if plan is None:
        return STAGED
    if len(segments) == 1 and segments[0].decode:
        if plan.backoff > 0:
            return BACKOFF
        return STAGED if isinstance(segments[0].trace, list) else FUSED
    if not plan.batches(segments):
        return STAGED
    return BACKOFF if plan.backoff > 0 else FUSED_BATCH
