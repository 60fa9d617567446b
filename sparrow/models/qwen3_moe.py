"""Qwen3-MoE sparse MLP block: a linear router over all experts, top-k SwiGLU experts.

Weights stay in stored form: each `Expert` holds three `Weight`s that are views of the
checkpoint's memory map (HF folders: one tensor per expert; GGUF: one expert sliced out of the
stacked [E, out, in] tensor), so only the experts a token is routed to are ever read.

Per forward, the tokens are grouped by expert. An expert that got more than
kernels.linear.SMALL_T rows (prefill) runs one grouped linear call per projection over its
rows, so its weights are read once per chunk. All other (token, expert) pairs (every pair in
a decode step or a small decode batch) run together in kernels.moe.expert_pairs: two parallel
launches per layer, each output computed from its own token row only. Each expert's output,
scaled by its routing weight, is then added into the token rows expert by expert, so every
token sums its experts' outputs in ascending *expert index* order (as transformers'
index_add loop), whatever else is in the batch. With T <= SMALL_T rows every pair is
row-wise, so a row's bits do not depend on the other rows; a prefill token's bits depend on
whether its experts were busy (which kernel ran), within f32 rounding.

The router stays f32 even under --quantize: its top-k choice is discontinuous and cheap.
"""

from __future__ import annotations

import numpy as np

from ..errors import SparrowError
from ..kernels import linear as _linear
from ..kernels.linear import SMALL_T, linear
from ..kernels.moe import ExpertTable, expert_pairs, route, stack_experts
from ..quant import Weight
from .layers import MLP, silu


class Expert:
    """One SwiGLU expert: three stored weights, three linear calls. Unlike layers.MLP it never
    concatenates gate and up, and it is never prepared for the q8 mode: either would copy every
    expert out of the memory map (a 30B-A3B file is most of a machine's RAM), so experts stay
    exact, read from the mapping, in both activations modes."""

    __slots__ = ("gate", "up", "down")

    def __init__(self, gate: Weight, up: Weight, down: Weight):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: np.ndarray) -> np.ndarray:
        g = linear(x, self.gate)  # [T, F]
        u = linear(x, self.up)  # [T, F]
        return linear(silu(g) * u, self.down)  # [T, hidden]


class MoEBlock:
    """block(x [T, hidden] f32) -> [T, hidden] f32."""

    def __init__(self, router: Weight, experts: list[Expert], top_k: int, norm_topk_prob: bool):
        if not 0 < top_k <= len(experts) or router.shape[0] != len(experts):
            raise SparrowError(f"MoE block: top-{top_k} of {len(experts)} experts, router {router.shape}")
        self.router = router  # [E, hidden] f32
        self.experts = experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        try:
            self.stacked = stack_experts(experts)  # the expert kernels' tables or typed lists of views
        except ValueError:  # experts of mixed formats: every expert through linear()
            self.stacked = None

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Experts [T, k] (descending weight, ties to the lower index) and their weights [T, k]."""
        logits = linear(x, self.router)  # [T, E]
        return route(logits, self.top_k, self.norm_topk_prob)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        idx, w = self.route(x)  # [T, k] [T, k]
        k = self.top_k
        flat = idx.reshape(-1)  # [T*k] expert of each (token, rank)
        order = np.argsort(flat, kind="stable")  # (token, rank) pairs grouped by expert, tokens ascending
        bounds = np.searchsorted(flat[order], np.arange(len(self.experts) + 1))
        counts = np.diff(bounds)  # [E] rows routed to each expert
        # SMALL_T is read at call time, through the module: it is the linear kernels' own threshold
        few = counts <= _linear.SMALL_T if self.stacked is not None else np.zeros(len(counts), bool)
        # Experts with few rows: every pair in one fused call (row-wise kernels, two launches).
        pairs = order[few[flat[order]]]  # grouped by expert, like order
        y_few = expert_pairs(x, pairs // k, flat[pairs], self.stacked) if len(pairs) else None  # [P, hidden]
        out = np.zeros_like(x)  # [T, hidden]
        at = 0
        for e in np.flatnonzero(counts):
            grp = order[bounds[e] : bounds[e + 1]]
            rows, ranks = grp // k, grp % k  # a token picks an expert at most once: rows unique
            if few[e]:
                y = y_few[at : at + len(grp)]
                at += len(grp)
            else:  # many rows: one grouped linear call per projection reads the expert once
                y = self.experts[e](np.ascontiguousarray(x[rows]))  # [n_e, hidden]
            out[rows] += y * w[rows, ranks][:, None]
        return out


def moe_mlp_factory(cfg, get, i: int, prefix: str):
    """Layer i's MLP: the dense SwiGLU `MLP`, or a `MoEBlock` when the layer is sparse."""
    sparse = cfg.is_sparse_layer(i)
    if sparse and not get.has(prefix + "gate.weight") and get.has(prefix + "gate_proj.weight"):
        sparse = False  # GGUF metadata has no mlp_only_layers: trust the tensors present
    if not sparse:
        return MLP(
            get.weight(prefix + "gate_proj.weight"),
            get.weight(prefix + "up_proj.weight"),
            get.weight(prefix + "down_proj.weight"),
            get.activations,
        )
    n, hidden = cfg.num_experts, cfg.hidden_size
    router = Weight.from_array(get.array(prefix + "gate.weight"))
    if router.shape != (n, hidden):
        raise SparrowError(f"{prefix}gate.weight has shape {router.shape}, expected {(n, hidden)}")
    experts = [Expert(*(_expert_weight(get, prefix, p, e) for p in ("gate", "up", "down"))) for e in range(n)]
    ffn = cfg.moe_intermediate_size
    if ffn and experts[0].gate.shape != (ffn, hidden):
        raise SparrowError(f"{prefix}experts: gate_proj is {experts[0].gate.shape}, expected {(ffn, hidden)}")
    return MoEBlock(router, experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)


def _expert_weight(get, prefix: str, proj: str, e: int) -> Weight:
    """Expert e's {gate,up,down}_proj as a Weight: a per-expert HF tensor or a stacked slice."""
    name = f"{prefix}experts.{e}.{proj}_proj.weight"
    if get.has(name):
        return get.weight(name)
    stacked = f"{prefix}experts.{proj}_proj.weight"
    if not get.has(stacked):
        raise SparrowError(f"checkpoint is missing tensor {name} (or stacked {stacked})")
    w = get.stored(stacked).expert(e).to_weight()  # a view of the mmap, no copy
    if get.quantize and w.qtype in ("f32", "f16", "bf16"):
        w = w.quantize(get.quantize)
    return w


def fused_moe_ok(mlp) -> bool:
    """Whether the fused decode step runs this MLP as a MoE phase: a MoEBlock whose experts
    are in a block format (an ExpertTable) and whose router is f32 rows."""
    return isinstance(mlp, MoEBlock) and isinstance(mlp.stacked, ExpertTable) and mlp.router.qtype == "f32"


def step_moe(layers):
    """The fused step's record of a model's MoE layers (kernels/fused/moe_phase.StepMoE), or
    None where no layer is sparse. Every MoE layer must pass fused_moe_ok; ValueError where
    they differ in expert count, top-k or expert shapes (the fused step then does not apply)."""
    from ..kernels.fused.moe_phase import StepMoE

    mlps = [getattr(lay.mlp, "routed", lay.mlp) for lay in layers]  # Qwen3.5-MoE: the routed part
    blocks = [m if isinstance(m, MoEBlock) else None for m in mlps]
    first = next((b for b in blocks if b is not None), None)
    if first is None:
        return None
    t0 = first.stacked
    ne, k, e_n, f_n = len(first.experts), first.top_k, t0.hidden, t0.ffn
    if any(
        b is not None
        and (len(b.experts), b.top_k, b.stacked.hidden, b.stacked.ffn, b.norm_topk_prob)
        != (ne, k, e_n, f_n, first.norm_topk_prob)
        for b in blocks
    ):
        raise ValueError("fused decode: MoE layers differ in experts, top-k or shapes")
    L = len(layers)
    router = np.zeros((L, 3), np.int64)
    etab = np.zeros((L, 3, ne), np.int64)
    dims = np.zeros((L, 3, 2), np.int64)
    kinds = np.zeros((L, 3), np.int64)
    kq = 0
    for i, b in enumerate(blocks):
        if b is None:
            continue
        r = b.router.data
        if r.dtype != np.float32 or not r.flags.c_contiguous:
            raise SparrowError("fused decode: a MoE router is not C-contiguous f32 rows")
        router[i] = (r.ctypes.data, *r.shape)
        etab[i], dims[i], kinds[i] = b.stacked.etab, b.stacked.dims, b.stacked.kinds
        kq = kq or b.stacked.addrs[1]
    addrs = (first.stacked.addrs[0], kq)
    return StepMoE(
        sparse=np.array([b is not None for b in blocks], np.int64),
        router=router, etab=etab, dims=dims, kinds=kinds, addrs=addrs, top_k=int(k),
        norm=bool(first.norm_topk_prob), logits=np.empty((SMALL_T, ne), np.float32),
        g=np.empty((SMALL_T * k, f_n), np.float32), u=np.empty((SMALL_T * k, f_n), np.float32),
        act=np.empty((SMALL_T * k, f_n), np.float32), ys=np.empty((SMALL_T * k, e_n), np.float32),
    )  # fmt: skip
