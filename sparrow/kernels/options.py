"""How every kernel compiles, and how the matvec kernels split their work: defined once here.

KW: numba's options for every kernel. cache: compiled code is kept on disk, in the folder
kernels/runtime.py keys on these sources and this CPU; nogil: a kernel releases the GIL, so
the server's HTTP threads run while the model thread computes.
"""

KW = dict(cache=True, nogil=True)
ROWS = 16  # weight rows a parallel matvec work item takes
# Matvecs below this many multiply-adds skip the thread pool: a parallel launch costs 50-180 us
# of wall time on the 2-CPU machines measured, as much as a 2M-MAC matvec on one core (with the
# second core busy, the usual state of a shared machine). Results are identical either way.
PARALLEL_MIN_MACS = 4_000_000
