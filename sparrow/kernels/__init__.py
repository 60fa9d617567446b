"""numba kernels, on arrays.

Importing the package sets numba up for them (runtime.configure: the threading layer and the
disk cache folder) before any kernel module is imported; kernels/runtime.py says why that
cannot wait for the edges. Thread counts, pinning and compile progress are in runtime too.
"""

from sparrow.kernels import runtime as _runtime

_runtime.configure()
