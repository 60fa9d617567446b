"""The exact-block-mass oracle: the block choice a selector would make if it could read every
key, as an evaluation reference for `seed` and `v2` (bench --selectors oracle).

Each query head ranks all blocks by the exact softmax mass inside them and attends over the k
heaviest, in float64 numpy. Nothing is forced in (no sink, no recency) and no importance is
used; early layers stay exact as they do for v2 (the same `dense_layers`), so the gap between v2
and the oracle is only which blocks were chosen. It reads every key each step, so it measures
what a block budget of k can keep, not a speed: it never runs outside evaluation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from sparrow.errors import SparrowError
from sparrow.params import V2_DENSE_LAYERS, SparseParams


@dataclass
class OracleParams(SparseParams):
    """SparseParams that the fidelity runs attend with the oracle (select stays "v2": its
    dense layers and block size apply)."""

    @property
    def label(self) -> str:
        return "oracle" if self.dense_layers == V2_DENSE_LAYERS else f"oracle-dense{self.dense_layers}"


def is_oracle(label) -> bool:
    """Whether a record's selector label is the oracle's (`oracle`, `oracle-dense<N>`)."""
    return isinstance(label, str) and label.split("-")[0] == "oracle"


def oracle_from_label(label: str, **kw) -> OracleParams:
    """`oracle` or `oracle-dense<N>` (bench --selectors: N first KV layers exact, as v2's
    dense<N>; a hybrid model's few attending layers all select with dense0)."""
    _, *mods = label.split("-")
    if len(mods) > 1 or (mods and not (mods[0].startswith("dense") and mods[0][5:].isdigit())):
        raise SparrowError(f"unknown oracle {label!r} (oracle, oracle-dense<N>)")
    return oracle_params(dense_layers=int(mods[0][5:]) if mods else V2_DENSE_LAYERS, **kw)


def oracle_params(**kw) -> OracleParams:
    return OracleParams(select="v2", **kw)


def attend_chosen(p, V, chosen, block) -> np.ndarray:
    """Exact attention over the blocks `chosen`, from every position's softmax numerator p [n]
    (float64, any common shift) and the values V [n, D] -> [D]."""
    keep = np.zeros(len(p), bool)
    for b in chosen:
        keep[b * block : (b + 1) * block] = True
    w = p * keep
    return (w @ V) / w.sum()


def attend(q, layer, seq_len, scale, k, block, trace=None) -> np.ndarray:
    """q [H, D] over positions 0..seq_len-1 of `layer`, each head over its k blocks of largest
    exact softmax mass (ties: the lower block) -> [H, D] float32."""
    H, D = q.shape
    group = H // layer.n_kv_heads
    starts = np.arange(0, seq_len, block)
    out = np.empty((H, D), np.float32)
    for kh in range(layer.n_kv_heads):
        K = layer.keys_f32(kh, seq_len).astype(np.float64)  # [n, D]
        V = layer.values_f32(kh, seq_len).astype(np.float64)  # [n, D]
        for h in range(kh * group, (kh + 1) * group):
            s = (K @ q[h].astype(np.float64)) * scale  # [n]
            p = np.exp(s - s.max())
            mass = np.add.reduceat(p, starts)  # [blocks]
            chosen = np.sort(np.argsort(-mass, kind="stable")[:k])
            out[h] = attend_chosen(p, V, chosen, block)
            if trace is not None:
                trace.append((h, chosen.tolist(), ["oracle"] * len(chosen), float(mass[chosen].sum() / mass.sum())))
    return out


@contextlib.contextmanager
def decode_attention_by(model, attend_rows):
    """While active, `model`'s decode attention with sparse settings that leave blocks out is
    attend_rows(q [H, D] float32, layer, seq_len, scale, sparse, trace) -> [H, D] (the staged
    path: the fused step's attention is compiled and cannot be replaced); other rows are exact."""
    from sparrow.models import decoder

    original = decoder.decode_attention

    def decode_attention(q, layer, state, seq_len, scale, sparse=None, trace=None, into=None):
        if sparse is None or sparse.k * sparse.block >= seq_len:
            return original(q, layer, state, seq_len, scale, sparse, trace, into)
        return attend_rows(np.asarray(q, np.float32), layer, seq_len, scale, sparse, trace)

    fused = model.use_fused
    decoder.decode_attention, model.use_fused = decode_attention, False
    try:
        yield
    finally:
        decoder.decode_attention, model.use_fused = original, fused


def oracle_attention(model):
    """While active (a context manager), `model`'s decode attention with sparse settings is the
    oracle's (decode_attention_by)."""
    return decode_attention_by(
        model, lambda q, layer, seq_len, scale, sp, trace: attend(q, layer, seq_len, scale, sp.k, sp.block, trace)
    )
