"""Where a Qwen3-MoE decode step's time goes: a few layers of the qwen3-30b-a3b shape, three ways.

`python -m sparrow_lab.bench.moe_decode [--layers 4] [--threads 2] [--activations f32|q8]`

A random-weight Q4_K_M file with Qwen3-30B-A3B's per-layer shapes and `--layers` layers
(sparrow_lab.bench.shapes; written once into a temporary folder, or --path) is decoded one token at
a time after a short prefill, by
- `widen+dot`: the staged path with the expert kernels that widen each stored row to f32 and
  dot it (kernels.moe.StackedExperts, the experts' kernels for f16 / bf16 / f32 files),
- `staged`: the staged path with the experts' exact row dots (kernels.moe.ExpertTable),
- `fused`: the fused decode step with its MoE phase (kernels/fused/moe_phase.py).
All three give the same tokens; the first two have stages to time (ms a step: attention
projections with q/k norm and RoPE, attention, output projection, the MoE block and inside it
the router with top-k and the experts, the head), the fused step only its total. The variants
alternate within each round (order flipped every round) so load drift hits all; the table
shows each variant's round with the lowest median step. On a busy machine compare only
within one run; `--threads 1 --cpu` times process CPU seconds instead of wall time, which a busy
machine disturbs less (one thread: no barrier or launch waits for a descheduled partner).
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time

import numpy as np

STAGES = ("project_qkv", "attend", "project_out", "mlp_block", "head")
MOE_PARTS = {"route": "moe: router, top-k", "expert_pairs": "moe: experts"}
VARIANTS = ("widen+dot", "staged", "fused")


def small_shape(layers: int) -> dict:
    from sparrow_lab.bench import shapes

    return dict(shapes.SHAPES["qwen3-30b-a3b"], layers=layers)


def run(
    path: str,
    threads: int = 2,
    activations: str = "f32",
    rounds: int = 5,
    steps: int = 12,
    prefill: int = 16,
    clock=time.perf_counter,
):
    """{variant: {"step_ms": median ms a step of its best round, stage: ms a step, ...}}; clock:
    time.perf_counter (wall) or time.process_time (CPU of every thread)."""
    import sparrow
    from sparrow.kernels.moe import StackedExperts
    from sparrow.models import fused as fused_mod
    from sparrow.models import qwen3_moe
    from sparrow.models.decoder import Segment

    llm = sparrow.load(path, threads=threads, activations=activations)
    model = llm.model
    blocks = [lay.mlp for lay in model.layers]
    tables = [b.stacked for b in blocks]
    lists = [StackedExperts(b.experts) for b in blocks]
    acc: dict[str, float] = {}
    saved = []

    def wrap(owner, name, key):
        fn = getattr(owner, name)
        saved.append((owner, name, owner.__dict__.get(name)))

        @functools.wraps(fn)
        def timed(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                acc[key] = acc.get(key, 0.0) + clock() - t0

        setattr(owner, name, timed)

    for name in STAGES:
        wrap(model, name, name)
    wrap(qwen3_moe.MoEBlock, "route", MOE_PARTS["route"])
    wrap(qwen3_moe, "expert_pairs", MOE_PARTS["expert_pairs"])
    contended = fused_mod.CONTENDED
    fused_mod.CONTENDED = 0  # the fused rows must run fused, not back off on a busy machine
    try:
        ids = np.random.default_rng(0).integers(0, model.config.vocab_size - 30, prefill + steps)  # no added tokens
        cache = model.new_cache(prefill + steps)
        model.forward([Segment(ids[:prefill], cache, 0)])

        def one(variant):
            for b, t, li in zip(blocks, tables, lists):
                b.stacked = li if variant == "widen+dot" else t
            model.use_fused = variant == "fused"
            acc.clear()
            times = []
            for i in range(prefill, prefill + steps):  # the same positions each time: rewritten
                t0 = clock()
                model.forward([Segment(ids[i : i + 1], cache, i, decode=True)])
                times.append(clock() - t0)
            return float(np.median(times)) * 1e3, {k: v / steps * 1e3 for k, v in acc.items()}

        for v in VARIANTS:
            one(v)  # compile, page in
        best: dict[str, tuple] = {}
        for r in range(rounds):
            for v in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                got = one(v)
                if v not in best or got[0] < best[v][0]:
                    best[v] = got
    finally:
        fused_mod.CONTENDED = contended
        model.use_fused = True
        for b, t in zip(blocks, tables):
            b.stacked = t
        for owner, name, prev in reversed(saved):
            if prev is None:
                delattr(owner, name)
            else:
                setattr(owner, name, prev)
    return {v: {"step_ms": ms, **stages} for v, (ms, stages) in best.items()}


def table(rows: dict) -> str:
    keys = [*STAGES[:3], STAGES[3], *MOE_PARTS.values(), STAGES[4]]
    out = [f"| ms a step | {' | '.join(VARIANTS)} |", "|---" * (len(VARIANTS) + 1) + "|"]
    for k in keys:
        cells = [f"{rows[v][k]:.2f}" if k in rows[v] else "-" for v in VARIANTS]
        out.append(f"| {k} | {' | '.join(cells)} |")
    steps = " | ".join(f"{rows[v]['step_ms']:.2f}" for v in VARIANTS)
    out.append(f"| **step (median)** | {steps} |")
    return "\n".join(out)


def main(argv=None):
    from sparrow_lab.bench import shapes
    from sparrow_lab.bench.host import load_avg

    ap = argparse.ArgumentParser(prog="python -m sparrow_lab.bench.moe_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--activations", choices=("f32", "q8"), default="f32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cpu", action="store_true", help="time CPU seconds of the process, not wall time")
    ap.add_argument("--path", help="the small file (written here if missing; default: a temporary folder)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = a.path or os.path.join(tmp, f"qwen3-30b-a3b-{a.layers}l-q4_k_m.gguf")
        if not os.path.exists(path):
            shapes.write_gguf(path, small_shape(a.layers), "q4_k_m", name=f"qwen3-30b-a3b, {a.layers} layers")
        load0 = load_avg()
        clock = time.process_time if a.cpu else time.perf_counter
        rows = run(path, a.threads, a.activations, a.rounds, a.steps, clock=clock)
    print(
        f"qwen3-30b-a3b shape, {a.layers} layers, Q4_K_M, activations {a.activations}, {a.threads} threads, "
        f"{'CPU' if a.cpu else 'wall'} time, "
        f"best of {a.rounds} rounds x {a.steps} steps; load {load0} -> {load_avg()}"
    )
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
