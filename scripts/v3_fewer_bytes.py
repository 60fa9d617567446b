"""Could selector v3 read fewer bytes a key at its quality? A coarse pass, or 4-bit key codes.

v3 (docs/SPARSE_SELECT_V3.md) scores every key's int8 codes, `D + 4` bytes a key, where v2 reads
1/32 of that. A block's per-dimension min / max codes (`2 D` bytes a block) bound every key's
estimated score in it, as Quest's bound does: `sum_d max(c_q[d] hi[b, d], c_q[d] lo[b, d])`
times the scales, and the block's mass by that plus log(keys). This script decodes a few tokens
of a long prompt (sparrow's own docs) on the staged path and, at every layer and query head of
every step, asks:

- exact pruning (top-k): scoring blocks in falling bound order until the k-th best exact mass
  beats the next bound, what share of the blocks must be scored (1.0: nothing saved);
- the bound as a coarse filter: v3's rule over only the C k blocks of highest bound, how many of
  v3's own blocks it keeps and what share of their estimated mass (layers past v3's 2 dense ones);
- 4-bit key codes (`D / 2 + 4` bytes a key: scale max|x| / 7, codes rint(x / scale) in [-7, 7];
  the query's codes stay int8): v3's rule on that estimate, the same two measures.

Usage: python scripts/v3_fewer_bytes.py [--tokens 8000] [--k 32]
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


def codes(x, top=127):
    """v3's int8 rule for rows of x (top = 7: the 4-bit codes): (codes int32, scales f32)."""
    sc = (np.abs(x).max(-1, keepdims=True) / np.float32(top)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.where(sc > 0, np.rint(x / np.where(sc > 0, sc, 1)), 0)
    return np.clip(c, -top, top).astype(np.int32), sc[..., 0]


def block_mass(cq, sq, ck, sk, n, scale):
    """[blocks] v3's estimated log mass of each block from query and key codes."""
    nb = -(-n // BLOCK)
    e = (ck @ cq).astype(np.float64) * float(sq * np.float32(scale)) * sk  # [n] estimated scores
    ep = np.concatenate([e, np.full(nb * BLOCK - n, -np.inf)]).reshape(nb, BLOCK)
    m = ep.max(1)
    return m + np.log(np.exp(ep - m[:, None]).sum(1))


def kept(mass, chosen, top):
    """(share of v3's blocks top among chosen, share of their estimated mass chosen keeps)."""
    w = np.exp(mass - mass.max())
    return len(set(top) & set(chosen)) / len(top), w[chosen].sum() / w[top].sum()


def head_stats(cq, sq, ck, sk, k4, s4, n, scale, k):
    """(share of blocks exact pruning scores, then per filter and for 4-bit codes (v3's blocks
    kept, mass kept))."""
    nb = -(-n // BLOCK)
    mass = block_mass(cq, sq, ck, sk, n, scale)
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
    out = [scored / nb]
    for c in FILTERS:
        cand = order[: c * k]
        out += kept(mass, cand[np.argsort(-mass[cand], kind="stable")[:k]], top)
    mass4 = block_mass(cq, sq, k4, s4, n, scale)
    return out + list(kept(mass, np.argsort(-mass4, kind="stable")[:k], top))


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
            keys = kv.keys_f32(kh, seq_len)
            (ck, sk), (k4, s4) = codes(keys), codes(keys, 7)
            for h in range(kh * group, (kh + 1) * group):
                cq, sq = codes(q[h][None])
                rows.append([layer[0], *head_stats(cq[0], sq[0], ck, sk, k4, s4, seq_len, scale, args.k)])
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
    kept, mass = sel[:, -2], sel[:, -1]
    print(
        f"4-bit key codes: v3's blocks kept {kept.mean():.3f}, their estimated mass kept {mass.mean():.3f} "
        f"(p5 {np.quantile(mass, 0.05):.3f})"
    )


if __name__ == "__main__":
    main()
