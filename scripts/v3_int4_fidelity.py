"""Selector v3 on 4-bit key codes, before any kernel: its teacher-forced KL beside v3's and the
oracle's on the default model's needle prompts (issue 70 item 5's next step).

scripts/v3_fewer_bytes.py found that 4-bit key codes keep v3's block choice almost whole. Here
the choice meets the logits: a hook replaces the staged path's sparse decode attention with v3's
rule in numpy (docs/SPARSE_SELECT_V3.md, top-k: key codes at 8 or 4 bits, the query's int8, each
block's log-sum-exp of the estimates, the k largest, ties to the lower block) and attends
exactly in float64 over the chosen blocks, as the oracle (sparrow_lab/eval/oracle.py) does. Rows:
the replica at 8 bits (it should match the v3 kernel's row), at 4 bits, the v3 kernel itself and
the oracle, each teacher-forced on exact attention's greedy continuation (sparrow bench
fidelity's measures: KL mean, top-1 agreement).

Usage: python scripts/v3_int4_fidelity.py [--length 8000] [--depths 25,50,75] [--k 32] [--tokens 32]
"""

import argparse
import contextlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from v3_fewer_bytes import BLOCK, block_mass, codes  # noqa: E402

import sparrow  # noqa: E402
from sparrow.params import SparseParams  # noqa: E402
from sparrow_lab.eval import fidelity as fid  # noqa: E402
from sparrow_lab.eval.oracle import attend_chosen, decode_attention_by, oracle_attention, oracle_params  # noqa: E402
from sparrow_lab.eval.prompts import make_prompt  # noqa: E402


def attend(q, kv, seq_len, scale, k, bits):
    """q [H, D] over positions 0..seq_len-1, each head over v3's k blocks by `bits`-bit key codes."""
    H, D = q.shape
    group = H // kv.n_kv_heads
    out = np.empty((H, D), np.float32)
    for kh in range(kv.n_kv_heads):
        keys = kv.keys_f32(kh, seq_len)
        ck, sk = codes(keys, 127 if bits == 8 else 7)
        K, V = keys.astype(np.float64), kv.values_f32(kh, seq_len).astype(np.float64)
        for h in range(kh * group, (kh + 1) * group):
            cq, sq = codes(q[h][None])
            mass = block_mass(cq[0], sq[0], ck, sk, seq_len, scale)
            s = (K @ q[h].astype(np.float64)) * scale  # [n]
            out[h] = attend_chosen(np.exp(s - s.max()), V, np.argsort(-mass, kind="stable")[:k], BLOCK)
    return out


def v3_replica(model, bits):
    """While active, the model's sparse decode rows take v3's blocks by `bits`-bit key codes."""
    return decode_attention_by(
        model, lambda q, kv, seq_len, scale, sp, trace: attend(q, kv, seq_len, scale, sp.k, bits)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=8000)
    ap.add_argument("--depths", default="25,50,75")
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    llm = sparrow.load(threads=2)
    rows = {"v3 replica, 8-bit keys": [], "v3 replica, 4-bit keys": [], "v3 kernel": [], "oracle": []}
    for depth in (int(d) / 100 for d in args.depths.split(",")):
        prompt = make_prompt(llm.tokenizer, "needle", args.length, depth)
        ids = prompt.ids
        pre = fid.prefill(llm, ids, args.tokens)
        exact = fid.greedy(llm, pre, args.tokens, None, keep_logits=True)
        runs = {
            "v3 replica, 8-bit keys": (v3_replica(llm.model, 8), oracle_params(k=args.k)),
            "v3 replica, 4-bit keys": (v3_replica(llm.model, 4), oracle_params(k=args.k)),
            "v3 kernel": (contextlib.nullcontext(), SparseParams(select="v3", k=args.k)),
            "oracle": (oracle_attention(llm.model), oracle_params(k=args.k)),
        }
        for name, (ctx, sp) in runs.items():
            with ctx:
                forced = fid.teacher_forced(llm, pre, exact.tokens, sp, trace=False)
            rows[name].append(fid.compare(exact, forced))
        print(f"depth {depth:.2f}: {len(ids)} prompt tokens, {len(exact.tokens)} generated", flush=True)
    print(f"\nneedle prompts of ~{args.length} tokens at depths {args.depths}, k = {args.k}, teacher-forced:")
    print("| selection | KL mean | top-1 |\n|---|---|---|")
    for name, rs in rows.items():
        print(f"| {name} | {np.mean([r['kl_mean'] for r in rs]):.4f} | {np.mean([r['top1'] for r in rs]):.3f} |")


if __name__ == "__main__":
    main()
