"""Where block-sparse decode starts to pay on this CPU: the context length from which
`--sparse-attn auto` decodes sparse (state.sparse.sparse_at reads it; below it, exact).

Auto's selector (v3 on 4-bit key codes, SparseParams.auto) scores every key before it attends
over the blocks it chose, so at short contexts it costs more than exact attention and past a
length it costs less. That length is a property of the attention kernels on the CPU's vector
width and of the layer's head_dim (v3 pays an exp and a scale a key whatever its width, exact
attention's reads grow with it), not of the model's weights. SPARSE_FROM holds, per vector width
and head_dim, the first context measured (2K, 3K, 4K, 6K, 8K, ...) from which auto's selector
(`v3-q4-p0.95`; on random tensors it takes all its 32 blocks, its costliest case) decoded one
layer at least 1.1x faster than exact attention for every KV kind, on the default model's
(head_dim 64), Qwen3-0.6B's (128) and Qwen3.5's (256) layer shapes, 2 threads (`sparrow bench
attention --shape ...`; docs/evaluation.md, "Where auto turns sparse on").
"""

from ..cpu import VECTOR_PATH

# vector path -> {head_dim: context from which sparse pays}; a head_dim between two rows takes
# the smaller head_dim's (the later) crossover. CPUs without AVX2 (generic, aarch64) take the
# 8-lane path's rows: their widths were not measured.
SPARSE_FROM = {
    "avx512": {64: 3072, 128: 2048, 256: 2048},  # AMD EPYC Zen 5
    "avx2": {64: 3072, 128: 2048, 256: 2048},  # the same CPU, compiled for haswell (AVX2 + FMA)
}


def vector_path() -> str:
    """The row of SPARSE_FROM this CPU takes: its own, else the 8-lane (AVX2) one."""
    return VECTOR_PATH if VECTOR_PATH in SPARSE_FROM else "avx2"


def sparse_from(head_dim: int) -> int:
    """Context length (tokens) from which auto decodes sparse on this CPU, for head_dim."""
    rows = SPARSE_FROM[vector_path()]
    fits = [d for d in rows if d <= head_dim]
    return rows[max(fits)] if fits else rows[min(rows)]
