"""Thread synchronisation inside one parallel kernel call, and the f32 -> f16 store.

The fused decode step (decode_step.py) runs a whole token as one parallel region: each
worker takes its share of every matvec and attention head, and the workers meet at a spin
barrier between dependent phases. A barrier costs well under a microsecond while both
workers run; a numba parallel launch costs ~100 us (workqueue), which is why the per-matvec
launches of the staged path stay serial at decode sizes.

A waiting worker spins with a pause hint (emit_pause) for about SPIN_SECONDS (sync[3] pause rounds, from
spin_rounds), then also yields its CPU (sched_yield), so a worker whose partner was
descheduled by another process does not burn the core the partner needs. The spin covers
the workers' own imbalance: halves of one matvec differ by up to ~10% (~1 ms for the
12-ms halves of Qwen3-1.7B's lm_head here); a 0.1-ms spin counted that imbalance as
contention at 38 of 168 barriers a token and sent every step to the slower staged path.
"""

import time

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

SPIN_SECONDS = 2e-3  # spin this long before a waiting worker starts yielding its CPU
_ROUNDS_PER_SECOND = []  # pause rounds a second on this CPU, measured once


def _i64_slot(context, builder, sig_arg, arr_val, idx):
    arr = context.make_array(sig_arg)(context, builder, arr_val)
    return builder.gep(arr.data, [idx])


@intrinsic
def atomic_add(typingctx, arr, idx, val):
    """arr[idx] += val atomically (sequentially consistent); returns the old value. arr: int64 C."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        ptr = _i64_slot(context, builder, signature.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")

    return types.int64(arr, types.intp, types.int64), codegen


@intrinsic
def atomic_load(typingctx, arr, idx):
    """arr[idx] read atomically (sequentially consistent): never hoisted out of a spin loop."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        ptr = _i64_slot(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "seq_cst", 8)

    return types.int64(arr, types.intp), codegen


@intrinsic
def atomic_store(typingctx, arr, idx, val):
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        ptr = _i64_slot(context, builder, signature.args[0], args[0], args[1])
        builder.store_atomic(args[2], ptr, "seq_cst", 8)
        return context.get_dummy_value()

    return types.void(arr, types.intp, types.int64), codegen


def emit_pause(builder, triple: str) -> None:
    """The spin-wait hint for the target `triple`: x86's `pause`; aarch64's `isb sy`, which
    stalls for tens of cycles as pause does (its `yield` is a nop on most cores, and what Rust's
    and Go's spin hints take too); nothing elsewhere."""
    if "x86" in triple or "i686" in triple or triple == "":
        fnty = ir.FunctionType(ir.VoidType(), [])
        builder.call(builder.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=fnty), [])
    elif triple.startswith(("aarch64", "arm64")):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(32)]), "llvm.aarch64.isb"
        )
        builder.call(fn, [ir.Constant(ir.IntType(32), 15)])  # 15: the full system (sy)


@intrinsic
def cpu_pause(typingctx):
    """The spin-wait hint of the CPU compiled for (emit_pause)."""

    def codegen(context, builder, signature, args):
        emit_pause(builder, builder.module.triple or "")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def sched_yield(typingctx):
    """libc's sched_yield(), called by symbol name (a ctypes pointer would keep numba from
    caching every kernel that waits at a barrier)."""

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(cache=True, nogil=True)
def _pause_rounds(sync, n):
    """n rounds of the barrier's wait loop: an atomic load and a pause. The load keeps LLVM
    from deleting the loop where the pause is no instruction (an empty loop timed ~0 s, and
    the spin limit came out ~1000 times too long)."""
    seen = 0
    for _ in range(n):
        seen += atomic_load(sync, 1)
        cpu_pause()
    return seen


def spin_rounds(seconds: float = SPIN_SECONDS) -> int:
    """How many rounds of the barrier's wait loop take about `seconds` on this CPU (a pause is
    ~10 cycles on some CPUs, ~140 on others), measured once per process."""
    if not _ROUNDS_PER_SECOND:
        sync = np.zeros(4, np.int64)
        _pause_rounds(sync, 1)  # compile
        n, best = 100_000, float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            _pause_rounds(sync, n)
            best = min(best, time.perf_counter() - t0)
        _ROUNDS_PER_SECOND.append(n / max(best, 1e-9))
    return max(1, int(_ROUNDS_PER_SECOND[0] * seconds))


@njit(cache=True, nogil=True)
def barrier(sync, n):
    """All n workers wait here until every one has arrived. sync: int64 [>= 4] (arrivals,
    generation, waits that had to yield the CPU, pause rounds before yielding), the first
    three zero before the parallel region; n == 1 returns at once."""
    if n <= 1:
        return
    gen = atomic_load(sync, 1)
    if atomic_add(sync, 0, 1) == n - 1:
        atomic_store(sync, 0, 0)  # reset before release: the next barrier counts afresh
        atomic_add(sync, 1, 1)
        return
    limit = sync[3]
    spins = 0
    while atomic_load(sync, 1) == gen:
        cpu_pause()
        spins += 1
        if spins > limit:
            if spins == limit + 1:
                atomic_add(sync, 2, 1)  # a long wait: the caller reads this as contention
            sched_yield()
