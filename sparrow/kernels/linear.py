"""y = x @ W.T for a sparrow.quant.Weight, working on the stored form.

Small T (decode, a few batched sequences): numba kernels over the stored rows, parallel over
output rows only (serial below PARALLEL_MIN_MACS, where a thread-pool launch costs more than
it saves). Quantised rows are dotted with x block by block from the stored bytes (f32
arithmetic, weights rebuilt in vector lanes); f16/bf16 rows are widened to f32 once. The
order depends only on the row length, so a row alone is bit-identical to that row in a
batch and any number of threads gives the same bits. Activations stay f32: quantising them to int8 per
block, as llama.cpp does, costs SmolLM2-135M its greedy answers (logit errors ~1).
Large T (prefill): panels of 48 W rows are widened to packed f32 and multiplied with 8 x
rows at a time by an outer-product micro-kernel that keeps its 8 x 48 accumulators in
vector registers (sparrow.kernels.matmul.gemm, ~100 GFLOP/s a core here); each y[t, o] is a
sequential fma over k whatever T and the thread count. No BLAS: OpenBLAS's own threads spin
after each call and starve numba's threads on a shared machine.
"""

import threading
from contextlib import contextmanager

import numpy as np

from sparrow.kernels.matmul.gemm import matmul_widened
from sparrow.kernels.matmul.q8 import quantized
from sparrow.kernels.matmul.widen import matvec_widened

__all__ = ["linear", "SMALL_T", "ACTIVATIONS", "activations"]

SMALL_T = 8  # T above this takes the prefill path (different summation order)
# "f32": exact (the default). "q8": decode matvecs over q8_0 / q4_0 / q4_1 / q5_0 / q5_1 and
# K-quant weights quantise x to 8 bits per 32-block as llama.cpp does (kernels/matmul/q8/quantized.py,
# q8.groups.py, q8.kquant_groups.py: faster, measured not exact); so do prefills over all of them but q5_k
# (quantized.PREFILL_FORMATS); other prefills and weight formats stay f32 either way.
ACTIVATIONS = ("f32", "q8")
_mode = threading.local()  # the mode of the forward this thread runs (models set it per forward)


@contextmanager
def activations(mode: str):
    """Runs the block's linear() calls on this thread with activations `mode`."""
    if mode not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {mode!r}")
    prev = getattr(_mode, "act", "f32")
    _mode.act = mode
    try:
        yield
    finally:
        _mode.act = prev


# ---------------------------------------------------------------- entry point


def linear(x, w, out=None):
    """y = x @ W.T; x f32 [T, in] C-contiguous, returns (or fills out) f32 [T, out]."""
    t_n, k = x.shape
    o_n = w.shape[0]
    if x.dtype != np.float32 or not x.flags.c_contiguous or k != w.shape[1]:
        raise ValueError(f"linear: x must be C-contiguous float32 [T, {w.shape[1]}], got {x.dtype} {x.shape}")
    if out is None:
        out = np.empty((t_n, o_n), np.float32)
    elif out.dtype != np.float32 or out.shape != (t_n, o_n) or not out.flags.c_contiguous:
        raise ValueError(f"linear: out must be C-contiguous float32 [{t_n}, {o_n}]")
    if t_n == 0:
        return out
    q8 = getattr(_mode, "act", "f32") == "q8"
    if t_n > SMALL_T and not (q8 and quantized.prefills(w)):
        return matmul_widened(x, w, out)
    if q8 and quantized.supports(w):
        return quantized.matvec_q8(x, w, out)
    return matvec_widened(x, w, out)
