"""MoE micro-benchmark: one Qwen3-30B-A3B-shaped sparse MLP layer beside a dense SwiGLU layer
with the same active parameter count.

MoE: hidden 2048, 128 experts, top-8, expert FFN 768, router f32. Dense: FFN 8 * 768 = 6144.
Weights are random quantised blocks written directly (no f32 master copy); the experts are
row slices of three stacked arrays, as in a GGUF file (q4_0: ~340 MB, q8_0: ~640 MB). Each
timed call gets a fresh random input, so the routed experts change from call to call and are
mostly read from memory, not cache, as in a real decode. MoE and dense calls alternate in each
round so machine-load drift hits both alike; the ratio is the median of moe_ms / dense_ms over
rounds. Both layers read the same bytes per token (8 of 128 experts = one dense layer), so a
ratio above 1 is routing, grouping and per-expert call overhead.
"""

import argparse
import statistics
import time

import numba
import numpy as np

from sparrow.kernels.formats import BLOCK_BYTES, BLOCK_VALUES
from sparrow.models.layers import MLP
from sparrow.models.qwen3_moe import Expert, MoEBlock
from sparrow.quant import Weight

HIDDEN, N_EXPERTS, TOP_K, MOE_FFN = 2048, 128, 8, 768  # Qwen3-30B-A3B


def random_blocks(rng, rows, cols, qtype, scale):
    """Random stored rows [rows, cols] of qtype with every block scale equal to `scale`."""
    bb = BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (rows, cols // BLOCK_VALUES[qtype], bb), dtype=np.uint8)  # [rows, nb, bb]
    raw[:, :, 0:2] = np.array([scale], np.float16).view(np.uint8)
    if qtype == "q4_1":
        raw[:, :, 2:4] = np.array([-8 * scale], np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def build_layers(qtype="q4_0", n_experts=N_EXPERTS, seed=0):
    """(MoEBlock, dense MLP) with random weights; the dense FFN is TOP_K * MOE_FFN wide and
    is the decoder's own layers.MLP (gate and up fused into one launch)."""
    rng = np.random.default_rng(seed)
    # Scales keep activations O(1): uniform 4-bit codes have std ~4.6 (q8_0 codes ~74).
    s_in = 0.005 if qtype != "q8_0" else 0.0003
    s_out = 0.01 if qtype != "q8_0" else 0.0006
    stacked = {
        "gate": random_blocks(rng, n_experts * MOE_FFN, HIDDEN, qtype, s_in),  # [E*F, row bytes]
        "up": random_blocks(rng, n_experts * MOE_FFN, HIDDEN, qtype, s_in),
        "down": random_blocks(rng, n_experts * HIDDEN, MOE_FFN, qtype, s_out),  # [E*H, row bytes]
    }

    def expert(e):
        f, h = slice(e * MOE_FFN, (e + 1) * MOE_FFN), slice(e * HIDDEN, (e + 1) * HIDDEN)
        return Expert(
            Weight(qtype, stacked["gate"][f], (MOE_FFN, HIDDEN)),
            Weight(qtype, stacked["up"][f], (MOE_FFN, HIDDEN)),
            Weight(qtype, stacked["down"][h], (HIDDEN, MOE_FFN)),
        )

    router = Weight.from_array(rng.standard_normal((n_experts, HIDDEN), dtype=np.float32) * np.float32(0.05))
    moe = MoEBlock(router, [expert(e) for e in range(n_experts)], TOP_K, True)
    ffn = TOP_K * MOE_FFN
    dense = MLP(
        Weight(qtype, random_blocks(rng, ffn, HIDDEN, qtype, s_in), (ffn, HIDDEN)),
        Weight(qtype, random_blocks(rng, ffn, HIDDEN, qtype, s_in), (ffn, HIDDEN)),
        Weight(qtype, random_blocks(rng, HIDDEN, ffn, qtype, s_out), (HIDDEN, ffn)),
    )
    return moe, dense


def run(threads=None, qtype="q4_0", batches=(1, 4), prefill=128, repeats=9, n_experts=N_EXPERTS, seed=0):
    """One dict per (mode, tokens): median ms per call of the MoE and the dense layer, ms per
    token of each, and the paired moe/dense ratio. mode "decode" is a batch of `tokens`
    single-token sequences; "prefill" one chunk of `prefill` tokens (skipped when 0)."""
    saved = numba.get_num_threads()
    if threads:
        numba.set_num_threads(threads)
    try:
        moe, dense = build_layers(qtype, n_experts, seed)
        rng = np.random.default_rng(seed + 1)
        cases = [("decode", t) for t in batches] + ([("prefill", prefill)] if prefill else [])
        rows = []
        for mode, t_n in cases:
            xs = rng.standard_normal((repeats + 1, t_n, HIDDEN), dtype=np.float32)  # [R, T, H]
            moe(xs[0])  # warm-up: JIT compile / load from cache
            dense(xs[0])
            tm, td, ratio = [], [], []
            for r in range(1, repeats + 1):
                t0 = time.perf_counter()
                moe(xs[r])
                t1 = time.perf_counter()
                dense(xs[r])
                t2 = time.perf_counter()
                tm.append(1e3 * (t1 - t0))
                td.append(1e3 * (t2 - t1))
                ratio.append((t1 - t0) / (t2 - t1))
            m, d = statistics.median(tm), statistics.median(td)
            rows.append(
                {
                    "mode": mode,
                    "tokens": t_n,
                    "qtype": qtype,
                    "threads": numba.get_num_threads(),
                    "moe_ms": m,
                    "dense_ms": d,
                    "moe_ms_per_token": m / t_n,
                    "dense_ms_per_token": d / t_n,
                    "ratio": statistics.median(ratio),
                }
            )
        return rows
    finally:
        numba.set_num_threads(saved)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="sparrow bench speed_moe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--qtype", choices=("q4_0", "q4_1", "q8_0"), default="q4_0")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="decode batch sizes")
    ap.add_argument("--prefill", type=int, default=128, help="prefill chunk length (0: skip)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--experts", type=int, default=N_EXPERTS, help="fewer experts: less memory")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows to this file")
    a = ap.parse_args(argv)
    rows = run(a.threads, a.qtype, tuple(a.batches), a.prefill, a.repeats, a.experts)
    if a.json:  # before the table
        from sparrow_lab.eval import report

        report.write_json(report.record_path("speed_moe", a.json), {"bench": "speed_moe", "rows": rows})
    print(
        f"one MoE layer (hidden {HIDDEN}, {a.experts} experts, top-{TOP_K}, FFN {MOE_FFN}) vs dense "
        f"SwiGLU (FFN {TOP_K * MOE_FFN}), {a.qtype}, {rows[0]['threads']} threads"
    )
    print(
        f"{'mode':<8} {'tokens':>6} {'moe ms':>9} {'dense ms':>9} {'moe ms/tok':>11} {'dense ms/tok':>12} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['mode']:<8} {r['tokens']:>6} {r['moe_ms']:>9.3f} {r['dense_ms']:>9.3f} "
            f"{r['moe_ms_per_token']:>11.3f} {r['dense_ms_per_token']:>12.3f} {r['ratio']:>6.2f}"
        )
    return rows


if __name__ == "__main__":
    main()
