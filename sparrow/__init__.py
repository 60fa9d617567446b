"""sparrow: CPU inference for Qwen-family models with block-sparse top-k attention."""

import os

# OpenBLAS (numpy's BLAS, used by exact prefill attention) keeps its worker threads spinning
# for ~0.1 s after each call; on a 2-CPU machine that spin took a core from numba's GEMM
# workers (2-thread matmuls at 1-thread speed). Sleeping at once costs BLAS nothing here.
# Read when numpy loads, so it only helps if sparrow is imported first (the CLI always is).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from .api import LLM, load
from .errors import SparrowError
from .version import __version__

__all__ = ["LLM", "load", "SparrowError", "__version__"]
