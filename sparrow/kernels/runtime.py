"""numba set up for the kernels, in one place: the threading layer, the disk cache, the worker
threads (count, pinning) and the compile progress lines.

configure() is the process setup: the threading layer (workqueue) and the cache folder. It runs
when sparrow.kernels is imported (the package's __init__ calls it), not at the edges (CLI, API,
server), and must stay there:
- numba binds a kernel to its disk cache folder when @njit(cache=True) decorates it, i.e. when
  the kernel's module is imported. Whoever imports a kernel module (the CLI and the API, and
  also the tests, the lab, a user's `from sparrow.kernels.linear import linear`, and the child
  processes tests/test_cpu_paths.py starts to compile other CPU paths) goes through the
  package's __init__ first: the one hook sure to run before the first kernel is decorated. A
  kernel decorated before a later setup would keep numba's default folder beside the sources,
  keyed on its own file only, so an edit to a helper in another file would leave stale code.
- numba reads the threading layer when its pool starts, at the first parallel kernel whoever
  imported it runs; a caller that skipped an explicit setup would get numba's OpenMP layer,
  which spin-waits between parallel regions: with ~150 short kernel calls per decoded token on
  a shared 2-core machine that collapsed throughput (0.4 tok/s against 6 with workqueue under
  load 9). workqueue never spins; its one limit, no parallel kernels from two Python threads at
  once, matches sparrow's design: one thread owns the model.
configure() is idempotent. The rest is explicit: set_threads (which pins the workers first,
pin_worker_threads) is called by whoever runs a model (sparrow.load, the engine's thread, the
lab), announce_compiles by the CLI and the server.

Compiled kernels are cached in a folder keyed by the kernel sources and this CPU (_cache_dir);
cache_is_cold() says whether it still holds nothing, i.e. the next run compiles.

The environment switches read here, and nowhere else: NUMBA_THREADING_LAYER (set: numba's
choice stands), NUMBA_CACHE_DIR (set: it wins over sparrow's folder), XDG_CACHE_HOME (the root
of sparrow's cache folders, cache_root()), SPARROW_PIN_THREADS=0 (no pinning).
"""

import hashlib
import os
import time

import numba

from sparrow.kernels import cpu

_configured = False


def configure() -> None:
    """numba's threading layer (workqueue, unless NUMBA_THREADING_LAYER is set) and its disk
    cache folder (_cache_dir, unless NUMBA_CACHE_DIR is set); once a process. Called by
    sparrow.kernels' __init__, before any kernel module is imported (the module docstring says
    why it cannot wait)."""
    global _configured
    if _configured:
        return
    _configured = True
    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER = "workqueue"
    if not os.environ.get("NUMBA_CACHE_DIR"):
        path = _cache_dir()
        if path:
            numba.config.CACHE_DIR = path


def cache_root() -> str:
    """The folder sparrow's caches live under: $XDG_CACHE_HOME/sparrow, else ~/.cache/sparrow."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sparrow")


def _host_cpu() -> str:
    """The CPU numba compiles for: name and features (kernels/cpu.py)."""
    return cpu.NAME + ";" + cpu.FEATURES


def _cache_dir(here=None, base=None):
    """A numba cache directory named after a hash of every kernel source file here (in
    subfolders too) and of the host CPU.

    numba keys a cached function on its own file only, so an edit to a jitted helper or
    intrinsic in another file (the row kernels, widen_row, sparse_select) would leave stale
    machine code behind. Keying the whole directory on all sources makes any kernel edit
    (or upgrade) start from a clean cache; keying it on the CPU makes a cache copied to
    another machine count as empty (numba would recompile everything there anyway).
    base: the folder it goes under (default cache_root()). NUMBA_CACHE_DIR, when set, wins
    (configure)."""
    here = here or os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256(numba.__version__.encode() + b"\0" + _host_cpu().encode())
    sources = []
    for folder, dirs, files in os.walk(here):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        sources += [os.path.relpath(os.path.join(folder, f), here) for f in files if f.endswith(".py")]
    for name in sorted(s.replace(os.sep, "/") for s in sources):
        with open(os.path.join(here, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    base = os.path.join(base, "sparrow") if base else cache_root()
    path = os.path.join(base, "numba-" + h.hexdigest()[:16])
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".writable")
        with open(probe, "w"):
            pass
    except OSError:
        return None  # numba's default (next to the sources, or its own user cache)
    return path


def cache_is_cold(path=None) -> bool:
    """Whether the kernel cache (path, default numba's CACHE_DIR, else the in-tree
    __pycache__ folders numba falls back to) holds no compiled index files (*.nbi)."""
    path = path or numba.config.CACHE_DIR or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for _, _, files in os.walk(path):
        if any(f.endswith(".nbi") for f in files):
            return False
    return True


# The estimate is measured: 37 s of CPU for a cold `sparrow generate` on 2 Zen 4 cores (DEVELOPMENT.md).
COMPILE_NOTICE = "sparrow: compiling kernels for this CPU (first run only: about 30 s on 2 cores)."
# A model in the q8 mode compiles its integer tiles as well (the measured cold starts behind both
# estimates: DEVELOPMENT.md).
COMPILE_NOTICE_Q8 = (
    "sparrow: compiling kernels for this CPU (first run only: about 45 s on 2 cores for the q8 activations mode)."
)

_progress = None  # the numba listener announce_compiles registered (one a process)


def announce_compiles(write, min_seconds: float = 1.0, notice: str = COMPILE_NOTICE, cold: bool | None = None) -> None:
    """write(notice) when the kernel cache is cold (or `cold`: taken by a caller before work
    that compiles, such as a q8-mode load), then, from now on, write(line) after each kernel
    compile (outermost only) that took at least min_seconds: what it was and how long it took,
    so a first run shows its progress (any run may still compile a path it has not used
    before). A second call only replaces write."""
    global _progress
    from numba.core import event

    if cache_is_cold() if cold is None else cold:
        write(notice)

    class _Progress(event.Listener):
        def __init__(self):
            self.starts = []

        def on_start(self, ev):
            self.starts.append(time.perf_counter())

        def on_end(self, ev):
            dt = time.perf_counter() - self.starts.pop()
            if self.starts or dt < min_seconds:
                return
            self.write(f"sparrow: compiled {kernel_name(ev.data.get('dispatcher'))} in {dt:.0f} s")

    if _progress is None:
        _progress = _Progress()
        event.register("numba:compile", _progress)
    _progress.write = write


def kernel_name(dispatcher) -> str:
    """A compiled kernel's name for the progress lines: its module below sparrow.kernels and
    its own name (attention.decode.decode_kernel, fused.decode_step.fused_decode_step)."""
    fn = getattr(dispatcher, "py_func", None)
    if fn is None:
        return "?"
    module = fn.__module__.removeprefix("sparrow.kernels.")
    return f"{module}.{fn.__qualname__}"


_pinned = None


def pin_worker_threads() -> bool:
    """Pins numba's worker threads one per allowed CPU (once per process, before the pool
    starts; SPARROW_PIN_THREADS=0 turns it off). Returns whether it pinned.

    Why: on this 2-CPU machine the scheduler often woke both workers on the same CPU after
    a serial phase, and a 2-thread prefill GEMM then ran at exactly 1-thread speed for tens
    of milliseconds (~105 GFLOP/s inside the model against ~190 alone). The fastest cores
    come first (cpu.fast_first: the big cores of a big.LITTLE CPU), so n threads run on the
    n fastest. Which thread runs which part of a kernel never changes results."""
    global _pinned
    if _pinned is not None:
        return _pinned
    _pinned = False
    from numba.np.ufunc import parallel

    if (
        os.environ.get("SPARROW_PIN_THREADS", "1") == "0"
        or not hasattr(os, "sched_setaffinity")
        or not os.path.isdir("/proc/self/task")
        or parallel._is_initialized
    ):
        return False
    before = set(os.listdir("/proc/self/task"))
    parallel._launch_threads()
    workers = sorted(int(t) for t in set(os.listdir("/proc/self/task")) - before)
    cpus = cpu.fast_first(os.sched_getaffinity(0))  # numba gives n threads' work to workers 0 .. n-1
    if len(workers) < 2 or len(cpus) < 2:
        return False
    try:
        for i, tid in enumerate(workers):
            os.sched_setaffinity(tid, {cpus[i % len(cpus)]})
    except OSError:
        return False
    _pinned = True
    return True


def default_threads(root: str | None = None) -> int:
    """The thread count when the user gives none: one per fast core this process may run on
    (cpu.fast_cores: every core, unless the cores are of unequal speed), at most
    NUMBA_NUM_THREADS. The one place that decides it."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    fast = cpu.fast_cores(allowed, root or cpu.SYSFS_CPU)
    return max(1, min(len(fast), numba.config.NUMBA_NUM_THREADS))


def set_threads(n: int | None) -> int:
    """Sets numba's thread count for the calling thread (numba keeps it per thread, so every
    thread that runs the model calls this) and returns it: n, or default_threads() when n is
    None, capped at NUMBA_NUM_THREADS. Pins the workers first (pin_worker_threads)."""
    n = max(1, min(n or default_threads(), numba.config.NUMBA_NUM_THREADS))
    pin_worker_threads()
    numba.set_num_threads(n)
    return n
