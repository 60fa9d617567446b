"""Decode-attention micro-benchmark: exact vs block-sparse top-k on one layer (Qwen3-0.6B's shape,
or another with --shape).

Random K/V/query and random importance; per context and KV dtype the exact and sparse kernels
run interleaved (exact, k=32, k=16, ... then again) so machine-load drift hits them alike. The
ratio is the median over repeats of exact_ms / sparse_ms from the same round. Each sparse mode's
selection alone (the blocks chosen, nothing attended) is timed in the same rounds: what the
selector costs a token, the rest being the attention over what it chose.
"""

import argparse
import math
import statistics
import sys
import time

import numba
import numpy as np

from sparrow.models.attention import decode_attention
from sparrow.params import KV_DTYPES, SparseParams
from sparrow.state.cache import KVCache

# layer shapes by name: (query heads, KV heads, head_dim)
SHAPES = {"qwen3-0.6b": (16, 8, 128), "smollm2-135m": (9, 3, 64), "qwen3.5-0.8b": (8, 2, 256)}
N_HEADS, N_KV_HEADS, HEAD_DIM = SHAPES["qwen3-0.6b"]
_FILL_CHUNK = 2048


def _filled_layer(kv_dtype, capacity, rng, kvh, d):
    """(layer cache, its sparse state) of a one-layer cache full of random K/V and importance."""
    cache = KVCache(1, kvh, d, capacity, kv_dtype)
    for s0 in range(0, capacity, _FILL_CHUNK):
        n = min(_FILL_CHUNK, capacity - s0)
        k = rng.standard_normal((n, kvh, d), dtype=np.float32)  # [n, KVH, D]
        v = rng.standard_normal((n, kvh, d), dtype=np.float32)  # [n, KVH, D]
        cache.append(0, s0, k, v)
    cache.sparse[0].importance[:] = rng.random(capacity, dtype=np.float32)
    return cache.layers[0], cache.sparse[0]


def run(
    contexts=(2048, 4096, 8192, 16384, 32768),
    ks=(32, 16, 8),
    kv_dtypes=("f32", "int8"),
    repeats=7,
    seed=0,
    threads=None,
    clock="wall",
    selectors=("seed",),
    shape=(N_HEADS, N_KV_HEADS, HEAD_DIM),
):
    """Returns one dict per (kv_dtype, context, mode): mode "exact", "k=<k>" (the seed selector)
    or "<selector> k=<k>", median ms per decoded token for this one layer, and for sparse modes
    the paired exact/sparse ratio. The layer is a sparse one: v2's dense first layers are a
    model-level choice and are not applied here.

    clock "cpu" times with process CPU time: steadier than wall time on a machine shared with
    other jobs (meaningful with threads=1; idle-spinning worker threads would count too)."""
    timer = {"wall": time.perf_counter, "cpu": time.process_time}[clock]
    saved = numba.get_num_threads()
    if threads:
        numba.set_num_threads(threads)
    n_heads, kvh, d = shape
    scale = 1.0 / math.sqrt(d)
    rows = []
    try:
        for kv_dtype in kv_dtypes:
            rng = np.random.default_rng(seed)
            layer, state = _filled_layer(kv_dtype, max(contexts), rng, kvh, d)
            for ctx in contexts:
                q = rng.standard_normal((n_heads, d), dtype=np.float32)  # [H, D]
                modes = [("exact", None)] + [
                    (f"k={k}" if sel == "seed" else f"{sel} k={k}", SparseParams.from_label(sel, k=k))
                    for k in ks
                    for sel in selectors
                ]
                times = {name: [] for name, _ in modes}
                select = {name: [] for name, sp in modes if sp is not None}
                for _, sp in modes:  # warm-up: JIT compile and page in the cache
                    decode_attention(q, layer, state, ctx, scale, sp)
                for _ in range(repeats):
                    for name, sp in modes:
                        t0 = timer()
                        decode_attention(q, layer, state, ctx, scale, sp)
                        times[name].append(1e3 * (timer() - t0))
                        if sp is not None:
                            t0 = timer()
                            decode_attention(q, layer, state, ctx, scale, sp, attend=False)
                            select[name].append(1e3 * (timer() - t0))
                for name, sp in modes:
                    row = {
                        "kv_dtype": kv_dtype,
                        "context": ctx,
                        "mode": name,
                        "k": sp.k if sp else None,
                        "selector": sp.label if sp else None,
                        "ms": statistics.median(times[name]),
                        "threads": numba.get_num_threads(),
                        "clock": clock,
                    }
                    if sp is not None:
                        nb = -(-ctx // sp.block)
                        row["blocks"] = nb
                        row["select_ms"] = statistics.median(select[name])
                        row["ratio"] = statistics.median(e / s for e, s in zip(times["exact"], times[name]))
                    rows.append(row)
            del layer
    finally:
        numba.set_num_threads(saved)
    return rows


def format_table(rows):
    """Per KV dtype and context: exact ms, each sparse mode's ms (exact / sparse) and [its
    selection alone]."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    head = f"{'kv':>5} {'context':>8} " + " ".join(
        f"{m + ' ms':>10}" if m == "exact" else f"{m + ' ms (x) [select]':>27}" for m in modes
    )
    lines = [head, "-" * len(head)]
    keys = list(dict.fromkeys((r["kv_dtype"], r["context"]) for r in rows))
    for kv, ctx in keys:
        cells = []
        for m in modes:
            r = next(r for r in rows if (r["kv_dtype"], r["context"], r["mode"]) == (kv, ctx, m))
            if m == "exact":
                cells.append(f"{r['ms']:>10.2f}")
            else:
                cells.append(f"{r['ms']:>9.2f} ({r['ratio']:>4.1f}x) [{r['select_ms']:>5.2f}]".rjust(27))
        lines.append(f"{kv:>5} {ctx:>8} " + " ".join(cells))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="sparrow bench attention",
        description="Decode attention ms/token for one layer (default Qwen3-0.6B's: "
        f"{N_HEADS} q heads, {N_KV_HEADS} KV heads, head_dim {HEAD_DIM}): "
        "exact vs block-sparse top-k, random tensors.",
    )
    p.add_argument("--shape", choices=SHAPES, default="qwen3-0.6b", help="the layer's heads, KV heads and head_dim")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--ks", type=int, nargs="+", default=[32, 16, 8])
    p.add_argument(
        "--selectors",
        default="seed",
        help="comma list of block selectors timed at every k: seed, v2 (and ablations), v3, v3-p<P>",
    )
    p.add_argument("--kv-dtypes", nargs="+", default=["f32", "int8"], choices=KV_DTYPES)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="numba threads (default: numba's)")
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or process CPU time (steadier on a busy machine; use with --threads 1)",
    )
    p.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="write the JSON record here (default runs/attention-<timestamp>/attention.json)",
    )
    a = p.parse_args(argv)
    from sparrow_lab.eval import report

    out = report.record_path("attention", a.json)
    selectors = tuple(x.strip() for x in a.selectors.split(",") if x.strip())
    for sel in selectors:
        SparseParams.from_label(sel)  # a bad name fails before the long fill
    shape = SHAPES[a.shape]
    rows = run(
        tuple(a.contexts), tuple(a.ks), tuple(a.kv_dtypes), a.repeats, a.seed, a.threads, a.clock, selectors, shape
    )
    report.write_json(
        out,
        {
            "bench": "attention",
            "argv": list(sys.argv[1:] if argv is None else argv),
            "shape": {"name": a.shape, "heads": shape[0], "kv_heads": shape[1], "head_dim": shape[2]},
            "repeats": a.repeats,
            "seed": a.seed,
            "clock": a.clock,
            "selectors": list(selectors),
            "environment": report.environment(),
            "rows": rows,
        },
    )
    print(
        f"decode attention, one layer, {a.clock}-clock ms/token (median of {a.repeats}); "
        f"(x) = exact/sparse, paired per round; [select] = the selection alone; numba threads {rows[0]['threads']}"
    )
    print(format_table(rows))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
