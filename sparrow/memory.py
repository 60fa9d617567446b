"""The process's memory as the OS sees it: what stays resident, and handing pages back.

- advise_mapped_pages: madvise over the pages under a view of a read-only file mapping (a
  model file's weights), e.g. MADV_RANDOM for an embedding read a row at a time, MADV_DONTNEED
  for bytes the q8 mode's copies replaced;
- trim_heap: the C heap's free pages back to the OS (glibc's malloc_trim);
- drop_compiler_pages: llvmlite's code pages out of the resident set after numba compiled;
- release_memory: both, where transient arrays die (after a model build, after a prefill chunk);
- libc: the C library, opened once (madvise here, the AMX permission syscall in kernels/cpu.py).

Linux does all of this; elsewhere each call is a no-op.
"""

import ctypes
import functools
import mmap
import os
import sys

import numba.core.event
import numpy as np

# madvise advice for the pages under a view of a read-only file mapping (advise_mapped_pages)
MADV_RANDOM = 1  # fault in only the page touched: no readahead around it
MADV_DONTNEED = 4  # out of this process's resident set; the page cache keeps the bytes


def _mapping(a):
    """The np.memmap of a file opened read-only that array a is a view into, or None."""
    while a is not None:
        if isinstance(a, np.memmap):
            return a if a.mode == "r" else None
        a = getattr(a, "base", None)
    return None


def advise_mapped_pages(a, advice: int) -> bool:
    """madvise(advice) over the whole pages under a C-contiguous view a of a read-only file
    mapping (Linux). Anonymous memory is never advised: DONTNEED would zero it. True when the
    call was made and succeeded."""
    m = _mapping(a)
    if m is None or not a.flags.c_contiguous or not sys.platform.startswith("linux"):
        return False
    page = mmap.PAGESIZE
    lo, hi = a.ctypes.data, a.ctypes.data + a.nbytes
    m_lo = m.ctypes.data
    if not (m_lo <= lo and hi <= m_lo + m.nbytes):
        return False
    start, end = -(-lo // page) * page, hi // page * page
    if end <= start:
        return False
    return _madvise()(start, end - start, advice) == 0


def trim_heap() -> None:
    """Hands the C heap's free pages back to the OS (glibc's malloc_trim; nothing elsewhere).

    A prefill's transient arrays (tens of MiB a layer) are freed into the heap, not unmapped:
    glibc raises its mmap threshold to the largest freed block (up to 32 MiB), so later arrays
    of that size come from the heap, and the free ones stay resident until this call
    (docs/benchmarks/xeon-amx-m167.md, "Resident memory in the q8 mode"). With nothing to give
    back it costs a few microseconds."""
    f = _malloc_trim()
    if f is not None:
        f(0)


def release_memory() -> None:
    """Gives back what the process holds resident but no longer uses: the C heap's free pages
    (trim_heap) and the compiler's code pages (drop_compiler_pages). Called where transient
    arrays die: after a model is built and after each prefill chunk."""
    trim_heap()
    drop_compiler_pages()


class _CompilerUse(numba.core.event.Listener):
    """Notes that numba took its compiler lock (it compiles or loads a kernel from its disk
    cache under it, and sparrow's IR kernels go through it too): LLVM's code ran. Registered
    by the first drop_compiler_pages, not at import: until then `used` is True anyway."""

    used = True  # importing numba ran LLVM

    def on_start(self, event):
        _CompilerUse.used = True

    def on_end(self, event):
        pass


@functools.cache
def _listen_for_the_compiler() -> None:
    numba.core.event.register("numba:compiler_lock", _CompilerUse())


def drop_compiler_pages() -> None:
    """Takes llvmlite's code pages out of the resident set if the compiler ran since the last
    call (a flag check otherwise).

    numba runs LLVM only to compile a kernel or to load one from its disk cache, yet the
    library's pages it touched doing so (55-69 MiB once the first kernels are loaded) stayed
    resident: half of the q8 mode's margin over file + KV (issue 34's bound). madvise(DONTNEED)
    drops them from this process's page tables; the page cache keeps the bytes, so the next
    compile faults them back in from memory. Only mappings that can never hold data of their
    own are advised: not writable, and no page copied on write (a relocated read-only segment
    has some, and would lose its relocations)."""
    _listen_for_the_compiler()
    if not _CompilerUse.used:
        return
    _CompilerUse.used = False
    advise = _madvise()
    for lo, hi in _compiler_segments():
        advise(lo, hi - lo, MADV_DONTNEED)


@functools.cache
def _compiler_segments() -> tuple[tuple[int, int], ...]:
    """(start, end) of each read-only segment of llvmlite's shared library whose pages are all
    the file's, read once from /proc/self/smaps (Linux; nothing elsewhere)."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return ()
    out, seg = [], None
    for line in lines:
        f = line.split()
        if f and "-" in f[0] and not f[0].endswith(":"):  # a mapping's header: range perms offset dev inode [path]
            seg = None
            if len(f) > 5 and os.path.basename(f[5]).startswith("libllvmlite") and "w" not in f[1]:
                lo, hi = (int(v, 16) for v in f[0].split("-"))
                seg = [lo, hi]
        elif seg is not None and f[0] == "Anonymous:":
            if int(f[1]) == 0:
                out.append(tuple(seg))
            seg = None
    return tuple(out)


@functools.cache
def libc():
    """The C library this process runs on, opened once (errno kept for madvise's and the AMX
    permission syscall's callers)."""
    return ctypes.CDLL(None, use_errno=True)


@functools.cache
def _malloc_trim():
    f = getattr(libc(), "malloc_trim", None)  # glibc's; musl and macOS have none
    if f is not None:
        f.argtypes = (ctypes.c_size_t,)
    return f


@functools.cache
def _madvise():
    """libc's madvise, looked up once: a decode step calls it (Decoder.embed_rows)."""
    f = libc().madvise
    f.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return f
