"""Sparse-vs-exact fidelity on one prompt: shared exact prefill, greedy decoding, teacher forcing.

The prompt is prefilled once with exact attention (as `llm.stream` does unless sparse_prefill);
each configuration decodes from a copy of that cache, so every configuration sees the same
prompt state and the same first token (it comes from the prefill logits). A configuration
with SparseParams.prefill instead prefills the prompt itself with its sparse attention (as
`llm.stream` does with sparse_prefill) and decodes from that cache; its first token comes from
its own prefill logits, which are compared with the exact prefill's (kl_prompt, top1_prompt),
so its row measures the whole cost of sparse prefill plus sparse decode.

Teacher forcing: the exact greedy continuation c_0..c_{n-1} is fed token by token to the
sparse model; step i's logits predict c_{i+1} and are compared with the exact step i logits.
The first step whose sparse argmax differs is where free-running sparse greedy decoding
first leaves the exact text (earlier steps see identical prefixes).
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from sparrow.engine.runner import Slot
from sparrow.errors import SparrowError
from sparrow.kernels.runtime import set_threads
from sparrow.models.timing import timed
from sparrow.params import SparseParams

from .oracle import OracleParams, oracle_attention


# ---------------------------------------------------------------- metrics on logits
def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)  # [..., V]
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def kl_per_token(p_logits, q_logits) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) per row, in nats: [T, V] x [T, V] -> [T]."""
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)  # [T, V]
    return np.maximum((np.exp(lp) * (lp - lq)).sum(axis=-1), 0.0)


def top1_agreement(a_logits, b_logits) -> float:
    """Share of rows whose argmax agrees."""
    a, b = np.argmax(a_logits, axis=-1), np.argmax(b_logits, axis=-1)
    return float(np.mean(a == b)) if len(a) else float("nan")


def first_divergence(a_tokens, b_tokens) -> int | None:
    """Index of the first differing token over the common length; None if none differs."""
    for i, (x, y) in enumerate(zip(a_tokens, b_tokens)):
        if int(x) != int(y):
            return i
    return None


# ---------------------------------------------------------------- running the model
@dataclass
class Prefilled:
    slot: Slot  # the prompt in its KV cache, exact or (slot.sparse.prefill) sparse prefill, importance recorded
    logits: np.ndarray  # [V] last prompt position
    prefill_ms: float

    @property
    def n_prompt(self) -> int:
        return len(self.slot.prompt)

    @property
    def cache(self):
        return self.slot.cache

    def fork(self, sparse: SparseParams | None, trace: bool = False) -> Slot:
        """A slot on a copy of the prompt's cache, so every configuration starts from one state."""
        return Slot(self.slot.prompt, copy.deepcopy(self.slot.cache), sparse, [] if trace else None)


def prefill(llm, ids, extra: int, sparse: SparseParams | None = None) -> Prefilled:
    """Prefill (the runner's chunking) into a cache with room for `extra` generated tokens: exact,
    or with `sparse` (its prefill set) block-sparse."""
    set_threads(llm.threads)
    ids = np.asarray(ids, np.int64)
    slot = llm.runner.new_slot(ids, len(ids) + extra + 1, llm.kv_dtype, sparse)
    t0 = time.perf_counter()
    logits = llm.runner.prefill(slot)  # [V]
    return Prefilled(slot, logits, 1e3 * (time.perf_counter() - t0))


@dataclass
class Decoded:
    tokens: list[int]  # generated ids, c_0 first (c_0 comes from the prefill logits)
    logits: list[np.ndarray] = field(default_factory=list)  # step i: [V] after feeding tokens[i]
    attn_ms: list[float] = field(default_factory=list)  # per decode step
    total_ms: list[float] = field(default_factory=list)
    traces: list[list] = field(default_factory=list)  # step i: [(layer, [(head, ids, stages, mass)])]

    def step(self, llm, slot: Slot, tok: int) -> np.ndarray:
        """Feeds tok to slot, timing it; returns the logits [V]."""
        with timed(llm.model) as timer:
            row = llm.runner.decode([slot], [tok])[0]  # [V]
        self.attn_ms.append(1e3 * timer.attn)
        self.total_ms.append(1e3 * timer.total)
        if slot.trace is not None:
            self.traces.append(list(slot.trace))  # [(layer, [(head, blocks, stages, mass)])]
            slot.trace.clear()
        return row


def greedy(llm, pre: Prefilled, n_tokens: int, sparse: SparseParams | None, keep_logits: bool = False) -> Decoded:
    """Free-running greedy decoding from a copy of the prefilled cache, stopping at EOS."""
    slot = pre.fork(sparse)
    tok = int(np.argmax(pre.logits))
    out = Decoded([tok])
    eos = set(llm.tokenizer.eos_token_ids)
    for _ in range(n_tokens - 1):
        if tok in eos:
            break
        row = out.step(llm, slot, tok)
        if keep_logits:
            out.logits.append(row)
        tok = int(np.argmax(row))
        out.tokens.append(tok)
    return out


def teacher_forced(llm, pre: Prefilled, tokens: list[int], sparse: SparseParams | None, trace: bool = True) -> Decoded:
    """Feeds tokens[0..n-2] after the prompt; step i's logits predict tokens[i+1]."""
    slot = pre.fork(sparse, trace=trace and sparse is not None)
    out = Decoded(list(tokens))
    for tok in tokens[:-1]:
        out.logits.append(out.step(llm, slot, tok))
    return out


# ---------------------------------------------------------------- softmax mass of the selection
def selected_mass(q, layer_cache, seq_len, scale, block, heads_blocks) -> dict[int, float]:
    """Exact softmax mass inside the selected blocks per head, in float64: q [H, D]; heads_blocks
    {h: ids}. An independent check of the `mass` the attention kernel puts in trace records."""
    H = q.shape[0]
    group = H // layer_cache.n_kv_heads
    starts = np.arange(0, seq_len, block)
    out = {}
    for kh in range(layer_cache.n_kv_heads):
        K = layer_cache.keys_f32(kh, seq_len)  # [S, D]
        for h in range(kh * group, (kh + 1) * group):
            if h not in heads_blocks:
                continue
            s = (K.astype(np.float64) @ q[h].astype(np.float64)) * scale  # [S]
            p = np.exp(s - s.max())
            p /= p.sum()
            blocks = np.add.reduceat(p, starts)  # [n_blocks]
            out[h] = float(blocks[np.asarray(heads_blocks[h], np.int64)].sum())
    return out


# ---------------------------------------------------------------- summaries
def mass_summary(traces) -> dict:
    """Per layer (median, 5th percentile) over heads and steps, plus the same over all layers,
    and `blocks`: the mean number of blocks a head read in a selecting layer (k, or fewer where
    a top-p budget stopped early)."""
    per = {}
    counts = []
    for step in traces:
        for li, recs in step:
            per.setdefault(li, []).extend(r[3] for r in recs)
            counts.extend(len(r[1]) for r in recs)
    allm = [m for v in per.values() for m in v]
    if not allm:
        return {}
    q = lambda v, p: float(np.percentile(np.asarray(v), p))  # noqa: E731
    return {
        "per_layer": {int(li): {"median": q(v, 50), "p5": q(v, 5)} for li, v in sorted(per.items())},
        "median": q(allm, 50),
        "p5": q(allm, 5),
        "min_layer_median": min(q(v, 50) for v in per.values()),
        "blocks": float(np.mean(counts)),
    }


def compare(exact: Decoded, forced: Decoded, prompt_logits: tuple | None = None) -> dict:
    """KL(exact || sparse) per teacher-forced step, top-1 agreement, first divergence.
    prompt_logits: (exact, sparse) logits [V] of the prompt's last position, which predict
    token 0, when the sparse side prefilled on its own: their KL and agreement are reported
    apart (kl_prompt, top1_prompt), the decode steps' means stay over the same steps as with a
    shared prefill, and a disagreement there makes token 0 the first to differ."""
    n = min(len(exact.logits), len(forced.logits))
    out = {} if prompt_logits is None else prompt_agreement(*prompt_logits)
    if n == 0:
        first = 0 if out.get("top1_prompt", 1.0) < 1.0 else None
        return {"kl_mean": 0.0, "kl_max": 0.0, "top1": 1.0, "first_diff": first, "steps": 0, **out}
    E, S = np.stack(exact.logits[:n]), np.stack(forced.logits[:n])  # [n, V]
    kl = kl_per_token(E, S)
    # Step i predicts generated token i+1; token 0 comes from the prefill logits (the same with
    # a shared exact prefill).
    d = first_divergence(np.argmax(E, axis=-1), np.argmax(S, axis=-1))
    first = None if d is None else d + 1
    if out.get("top1_prompt", 1.0) < 1.0:
        first = 0
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1": top1_agreement(E, S),
        "first_diff": first,
        "steps": n,
        **out,
    }


def prompt_agreement(exact_logits, sparse_logits) -> dict:
    """KL(exact || sparse) and top-1 agreement of two prefills' last-position logits [V]."""
    pe, ps = np.asarray(exact_logits)[None], np.asarray(sparse_logits)[None]  # [1, V]
    return {"kl_prompt": float(kl_per_token(pe, ps)[0]), "top1_prompt": top1_agreement(pe, ps)}


def ms_summary(values) -> float:
    """Median ms per decoded token (robust to the shared machine's load spikes)."""
    return float(statistics.median(values)) if values else float("nan")


def nan_to_none(x):
    return None if isinstance(x, float) and math.isnan(x) else x


# ---------------------------------------------------------------- one prompt, many configurations
def config_label(sp: SparseParams | None) -> str:
    """ "exact", "sparse k=32" (the seed selector, as before selectors existed), "v2 k=32", ...;
    with sparse prefill "... sparse-prefill"."""
    if sp is None:
        return "exact"
    return (
        ("sparse" if sp.select == "seed" else sp.label)
        + f" k={sp.k}"
        + (f" b={sp.block}" if sp.block != 32 else "")
        + (f" p={sp.probe}" if sp.probe != 8 and sp.select == "seed" else "")
        + (" sparse-prefill" if sp.prefill else "")
    )


def run_prompt(
    llm, ids, configs, n_tokens: int = 16, fidelity: bool = True, pre: Prefilled | None = None
) -> list[dict]:
    """One row per configuration (None = exact): greedy text and ms/token, and with fidelity the
    teacher-forced KL/top-1/first divergence/mass against the exact greedy continuation.
    `pre` is the shared exact prefill; a configuration with sparse prefill makes its own."""
    for sp in configs:
        if isinstance(sp, OracleParams) and sp.prefill:
            raise SparrowError("the oracle selects blocks for decode only: it cannot be combined with sparse prefill")
    pre = pre or prefill(llm, ids, n_tokens)
    exact = greedy(llm, pre, n_tokens, None, keep_logits=True)
    rows = []
    for sp in configs:
        own = prefill(llm, ids, n_tokens, sp) if sp is not None and sp.prefill else None
        with oracle_attention(llm.model) if isinstance(sp, OracleParams) else contextlib.nullcontext():
            rows.append(_config_row(llm, pre, exact, sp, n_tokens, fidelity, own))
    return rows


def _config_row(
    llm, pre: Prefilled, exact: Decoded, sp, n_tokens: int, fidelity: bool, own: Prefilled | None = None
) -> dict:
    """One configuration's row: greedy text and timing, and with fidelity its teacher-forced
    comparison against the exact continuation. own: the configuration's sparse prefill (None:
    it decodes from the shared exact prefill `pre`)."""
    start = own or pre
    run = exact if sp is None else greedy(llm, start, n_tokens, sp)
    row = {
        "config": config_label(sp),
        "sparse": sp is not None,
        "k": sp.k if sp else None,
        "block": sp.block if sp else None,
        "probe": sp.probe if sp else None,
        "selector": sp.label if sp else None,
        "sparse_prefill": own is not None,
        "tokens": run.tokens,
        "text": llm.tokenizer.decode(run.tokens, skip_special_tokens=True),
        "attn_ms": nan_to_none(ms_summary(run.attn_ms)),
        "total_ms": nan_to_none(ms_summary(run.total_ms)),
        "prefill_ms": start.prefill_ms,
        "n_prompt": start.n_prompt,
        "first_diff_free": first_divergence(exact.tokens, run.tokens) if sp else None,
    }
    if sp is None:
        row.update({"kl_mean": 0.0, "kl_max": 0.0, "top1": 1.0, "first_diff": None, "steps": len(exact.logits)})
    elif fidelity:
        forced = teacher_forced(llm, start, exact.tokens, sp, trace=True)
        row.update(compare(exact, forced, None if own is None else (pre.logits, own.logits)))
        row["mass"] = mass_summary(forced.traces)
    elif own is not None:
        row.update(prompt_agreement(pre.logits, own.logits))
    return row
