"""numba kernels. Importing this package picks the threading layer before any kernel runs.

numba's default OpenMP layer spin-waits between parallel regions; with ~150 short kernel calls
per decoded token on a shared 2-core machine that collapses throughput (measured 0.4 tok/s
against 6 tok/s with `workqueue` under load 9). `workqueue` never spins. Its one limit, no
parallel kernels from two Python threads at once, matches sparrow's design: one thread owns
the model. Set NUMBA_THREADING_LAYER to choose another layer.
"""

import os

import numba

if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"
