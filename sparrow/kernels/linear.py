"""y = x @ W.T for a sparrow.quant.Weight, or a weight prepared for the q8 mode (prepare), on
the stored form. choose() is the one place that picks the implementation.

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
The activations mode is the weight's: the model builder prepares each weight once for its mode
(a Q8Weight holds the q8 kernels' interleaved rows), so no call site passes or looks up a mode.
"""

import numpy as np

from sparrow.kernels import cpu
from sparrow.kernels.formats import BY_NAME, X8_KIND
from sparrow.kernels.matmul.gemm import matmul_widened
from sparrow.kernels.matmul.q8.quantized import Q8Weight, matmul_amx, matvec_q8
from sparrow.kernels.matmul.widen import matvec_widened

__all__ = ["linear", "prepare", "choose", "stored", "SMALL_T", "ACTIVATIONS", "Q8Weight"]

SMALL_T = 8  # T above this takes the prefill path (different summation order)
# "f32": exact. "q8": decode matvecs over q8_0 / q4_0 / q4_1 / q5_0 / q5_1 and K-quant weights
# quantise x to 8 bits per 32-block as llama.cpp does (kernels/matmul/q8/: faster, measured not
# exact); so do prefills over all of them but q5_k (formats.py's q8_prefill); other prefills
# and weight formats stay f32 either way.
ACTIVATIONS = ("f32", "q8")
# From this many x rows a q8 prefill over an AMX format runs on AMX tiles where the CPU has
# them (the same bits; 16-row tiles, so fewer rows would mostly multiply padding).
AMX_MIN_T = 16


def prepare(w, mode: str):
    """The weight linear() reads in activations mode `mode`, built once by whoever owns the
    mode (the model builder): the stored Weight itself in the exact mode and for formats the
    q8 mode has no kernel for, else its Q8Weight (rows interleaved for the q8 kernels)."""
    if mode not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {mode!r}")
    if mode == "q8" and not isinstance(w, Q8Weight) and w.qtype in X8_KIND:
        return Q8Weight(w)
    return w


def stored(w):
    """The stored Weight an exact path reads: w itself, or a Q8Weight's (kept only for formats
    the q8 mode leaves exact in prefill; choose() sends no other Q8Weight to an exact path)."""
    if not isinstance(w, Q8Weight):
        return w
    if w.stored is None:
        raise ValueError(f"{w!r} keeps no stored rows for an exact path")
    return w.stored


# linear()'s implementations, chosen by choose()
EXACT_ROWS = "exact rows"  # stored rows dotted with f32 x (matmul/widen.py, matmul/kquants.py)
EXACT_GEMM = "exact gemm"  # rows widened to f32 panels, outer-product GEMM (matmul/gemm.py)
Q8_ROWS = "q8 rows"  # int8 x against interleaved groups, ymm / zmm tiles (matmul/q8/)
Q8_AMX = "q8 amx"  # the same products on AMX tiles (matmul/q8/amx.py)


def choose(w, t_n: int) -> str:
    """The one place that picks linear()'s implementation: from the weight's layout (a stored
    Weight or a Q8Weight, which is the activations mode), its format's capabilities in
    formats.py, the number of x rows and this CPU (kernels/cpu.py). Inside an implementation
    only the serial / parallel split (options.PARALLEL_MIN_MACS) and the format's own kernel
    remain to pick."""
    if isinstance(w, Q8Weight):
        fmt = BY_NAME[w.qtype]
        if t_n <= SMALL_T:
            return Q8_ROWS
        if fmt.q8_prefill:
            return Q8_AMX if cpu.AMX and fmt.amx and t_n >= AMX_MIN_T else Q8_ROWS
    return EXACT_ROWS if t_n <= SMALL_T else EXACT_GEMM


# ---------------------------------------------------------------- entry point


def linear(x, w, out=None):
    """y = x @ W.T for a Weight or a prepared weight (prepare); x f32 [T, in] C-contiguous,
    returns (or fills out) f32 [T, out]."""
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
    impl = choose(w, t_n)
    if impl == Q8_ROWS:
        return matvec_q8(x, w, out)
    if impl == Q8_AMX:
        return matmul_amx(x, w, out)
    if impl == EXACT_GEMM:
        return matmul_widened(x, stored(w), out)
    return matvec_widened(x, stored(w), out)
