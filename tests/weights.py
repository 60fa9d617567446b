"""Random weights and activations shaped like real projections, for the kernel tests."""

import numpy as np

from sparrow.quant import Weight, f32_to_bf16_bits


def make(qtype, shape, seed=0):
    """A Weight of the given storage format [out, in] with a few large input columns."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape).astype(np.float32) * np.float32(0.05)
    a[:, :3] *= 40  # a few large columns, as in real projections
    if qtype == "f16":
        return Weight.from_array(a.astype(np.float16))
    if qtype == "bf16":
        return Weight.from_bf16(f32_to_bf16_bits(a))
    w = Weight.from_array(a)
    return w if qtype == "f32" else w.quantize(qtype)


def acts(t, k, seed=1):
    """f32 activations [t, k] with a zero column and, for t > 2, an all-zero row."""
    x = np.random.default_rng(seed).standard_normal((t, k)).astype(np.float32)
    x[:, 5] = 0
    if t > 2:
        x[2] = 0
    return x
