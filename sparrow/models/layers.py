"""Small building blocks shared by the decoders: RMSNorm, fused projections, SwiGLU MLP (their
numba kernels live in sparrow.kernels.elementwise; RoPE is models/rope.py)."""

from __future__ import annotations

import numpy as np

from ..kernels.elementwise import rms_norm, silu_mul
from ..kernels.linear import linear, prepare
from ..quant import Weight

__all__ = ["rms_norm", "FusedLinear", "MLP", "silu"]


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) -> inf for very negative x gives silu = -0, as wanted
        return x / (1.0 + np.exp(-x))


class FusedLinear:
    """Several projections of the same input as one kernel launch when their formats agree
    (q/k/v, gate/up): per-token decode is dominated by launch overhead, not arithmetic. The
    fused weight (or each part) is prepared for activations `mode` (kernels.linear.prepare)."""

    def __init__(self, weights: list[Weight], mode: str = "f32"):
        self.sizes = [w.shape[0] for w in weights]
        same = len({(w.qtype, w.shape[1]) for w in weights}) == 1
        fused = Weight.concat_rows(weights) if same and len(weights) > 1 else None
        self.fused = prepare(fused, mode) if fused is not None else None
        self.parts = None if fused is not None else [prepare(w, mode) for w in weights]

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        if self.fused is None:
            return [linear(x, w) for w in self.parts]
        y = linear(x, self.fused)  # [T, sum(sizes)]
        return np.split(y, np.cumsum(self.sizes)[:-1], axis=1)


class MLP:
    """SwiGLU: down(silu(gate(x)) * up(x)), its weights prepared for activations `mode`."""

    def __init__(self, gate: Weight, up: Weight, down: Weight, mode: str = "f32"):
        self.gate_up = FusedLinear([gate, up], mode)
        self.down = prepare(down, mode)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.gate_up.fused is None:
            g, u = self.gate_up(x)  # [T, F] [T, F]
            return linear(silu(g) * u, self.down)  # [T, E]
        gu = linear(x, self.gate_up.fused)  # [T, 2F]
        h = silu_mul(gu, self.gate_up.sizes[0])  # [T, F]
        del gu  # freed before down's arrays exist: a prefill chunk's peak (24 MiB at 512 x 12288)
        return linear(h, self.down)  # [T, E]
