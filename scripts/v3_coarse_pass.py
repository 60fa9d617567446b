"""Could a coarse pass make selector v3 read fewer key codes? Measured on the default model.

v3 (docs/SPARSE_SELECT_V3.md) scores every key's int8 codes, `D + 4` bytes a key, where v2 reads
1/32 of that. A block's per-dimension min / max codes (`2 D` bytes a block) bound every key's
estimated score in it, as Quest's bound does: `sum_d max(c_q[d] hi[b, d], c_q[d] lo[b, d])`
times the scales, and the block's mass by that plus log(keys). This script decodes a few tokens
of a long prompt (sparrow's own docs) on the staged path and, at every layer and query head of
every step, asks:

- exact pruning (top-k): scoring blocks in falling bound order until the k-th best exact mass
  beats the next bound, what share of the blocks must be scored (1.0: nothing saved);
- the bound as a coarse filter: v3's rule over only the C k blocks of highest bound, how many of
  v3's own blocks it keeps and what share of their estimated mass (layers past v3's 2 dense ones).

Usage: python scripts/v3_coarse_pass.py [--tokens 8000] [--k 32]
"""

import argparse
import glob
import os

import numpy as np

import sparrow
from sparrow.api import set_threads
from sparrow.engine.generate import generate_step
from sparrow.engine.sequence import Sequence
from sparrow.models import decoder
from sparrow.params import SamplingParams, SparseParams

BLOCK = 32
FILTERS = (2, 4, 8)  # candidate blocks, in multiples of k


def codes(x):
    """v3's int8 rule for rows of x: (codes int32, scales f32)."""
    sc = (np.abs(x).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.where(sc > 0, np.rint(x / np.where(sc > 0, sc, 1)), 0)
    return np.clip(c, -127, 127).astype(np.int32), sc[..., 0]


def head_stats(cq, sq, ck, sk, n, scale, k):
    """(share of blocks exact pruning scores, then per filter (v3's blocks kept, mass kept))."""
    nb = -(-n // BLOCK)
    pad = nb * BLOCK - n
    e = (ck @ cq).astype(np.float64) * float(sq * np.float32(scale)) * sk  # [n] estimated scores
    ep = np.concatenate([e, np.full(pad, -np.inf)]).reshape(nb, BLOCK)
    m = ep.max(1)
    mass = m + np.log(np.exp(ep - m[:, None]).sum(1))  # [nb] estimated log mass
    ub = np.empty(nb)
    for b in range(nb):
        rows, s = ck[b * BLOCK : (b + 1) * BLOCK], sk[b * BLOCK : (b + 1) * BLOCK]
        dot = np.maximum(cq * rows.max(0), cq * rows.min(0)).sum() * float(sq * np.float32(scale))
        ub[b] = dot * (s.max() if dot >= 0 else s.min()) + np.log(len(rows))
    order = np.argsort(-ub, kind="stable")
    k = min(k, nb)
    best, scored = [], 0
    for b in order:
        if len(best) >= k and best[k - 1] > ub[b]:
            break
        scored += 1
        best = sorted(best + [mass[b]], reverse=True)
    top = np.argsort(-mass, kind="stable")[:k]
    w = np.exp(mass - mass.max())
    out = [scored / nb]
    for c in FILTERS:
        cand = order[: c * k]
        chosen = cand[np.argsort(-mass[cand], kind="stable")[:k]]
        out += [len(set(top) & set(chosen)) / k, w[chosen].sum() / w[top].sum()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    llm = sparrow.load(threads=2)
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "*.md")
    ids = llm.tokenizer.encode("\n\n".join(open(f).read() for f in sorted(glob.glob(docs))))[: args.tokens]
    rows, layer = [], [0]
    original = decoder.decode_attention

    def hook(q, kv, state, seq_len, scale, sparse=None, trace=None, into=None):
        q = np.asarray(q, np.float32)
        group = q.shape[0] // kv.n_kv_heads
        for kh in range(kv.n_kv_heads):
            ck, sk = codes(kv.keys_f32(kh, seq_len))
            for h in range(kh * group, (kh + 1) * group):
                cq, sq = codes(q[h][None])
                rows.append([layer[0], *head_stats(cq[0], sq[0], ck, sk, seq_len, scale, args.k)])
        layer[0] += 1
        return original(q, kv, state, seq_len, scale, None, trace, into)  # exact: the text goes on

    decoder.decode_attention, llm.model.use_fused = hook, False  # the staged path calls the hook
    set_threads(llm.threads)
    sampling = SamplingParams(max_tokens=args.steps, temperature=0.0, ignore_eos=True)
    seq = Sequence.create(llm.runner, llm.tokenizer, ids, sampling, llm.ctx, "f32", SparseParams(select="v2", k=args.k))
    for _ in generate_step(llm.runner, seq):
        layer[0] = 0
    a = np.array(rows)
    print(f"default model, {len(ids)}-token prompt, k = {args.k}, {len(a)} head-steps")
    print(f"exact pruning by the bound: share of blocks scored, mean {a[:, 1].mean():.3f}, min {a[:, 1].min():.3f}")
    sel = a[a[:, 0] >= 2]
    print(f"filters, over the {len(sel)} head-steps past v3's 2 dense layers:")
    for i, c in enumerate(FILTERS):
        kept, mass = sel[:, 2 + 2 * i], sel[:, 3 + 2 * i]
        print(
            f"filter to the {c}k blocks of highest bound: v3's blocks kept {kept.mean():.3f}, "
            f"their estimated mass kept {mass.mean():.3f} (p5 {np.quantile(mass, 0.05):.3f})"
        )


if __name__ == "__main__":
    main()
