"""One parallel launcher for every kernel: body(i, *args) for i in range(n) on numba's threads.

A `parallel=True` kernel costs 1-2 s of compile per argument types on top of its body (numba
builds, types and optimises a gufunc for the prange loop, and its wrapper; five such kernels
were a sixth of a cold start). Here one prange loop, `_launch_on_threads`, is compiled once, for int64
arguments only: it calls, on each thread, an adapter that reads the call's arguments from a
tuple the caller put in its own stack frame and calls the body through its address
(native_call.py). Per argument types, what compiles is the adapter and `_stash_and_launch`,
both a few lines (~0.1 s each, against 1-2 s for a parfor), and the body itself once.

The iterations are split between threads as a prange loop over range(n) splits them, so a
kernel moved here keeps its schedule; which thread runs which i never changes results.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from sparrow.kernels.native_call import _UNKEYED, _key, address, call_native
from sparrow.kernels.options import KW

_I64 = types.int64
# The adapter's arguments as the launcher passes them: i, the stashed tuple's address, and
# the tuple's type, a TypeRef, which numba passes as an opaque pointer whatever the type, so
# one launcher calls every adapter (it passes null: the adapter never reads it).
_ADAPTER_ARGS = (_I64, _I64, types.TypeRef(types.none))


@intrinsic
def _call_adapter(typingctx, addr, i, ctx):
    sig = types.none(addr, i, ctx)

    def codegen(context, builder, signature, llargs):
        fnty = context.call_conv.get_function_type(types.none, _ADAPTER_ARGS)
        fptr = builder.inttoptr(llargs[0], fnty.as_pointer())
        null = context.get_constant_null(_ADAPTER_ARGS[2])
        context.call_conv.call_function(builder, fptr, types.none, _ADAPTER_ARGS, [llargs[1], llargs[2], null])
        return context.get_dummy_value()

    return sig, codegen


@njit(parallel=True, **KW)
def _launch_on_threads(adapter, n, ctx):
    """adapter(i, ctx) for i in range(n), on numba's threads (prange's split)."""
    for i in prange(n):
        # prange's index is unsigned in the parallel region: the adapter takes it signed
        _call_adapter(adapter, np.int64(i), ctx)


@intrinsic
def _stash(typingctx, tup):
    """The address of a copy of tup in the calling function's stack frame (valid until it
    returns; its arrays' references are the caller's, not counted again)."""
    sig = _I64(tup)

    def codegen(context, builder, signature, llargs):
        slot = cgutils.alloca_once(builder, context.get_value_type(tup))
        builder.store(llargs[0], slot)
        return builder.ptrtoint(slot, context.get_value_type(_I64))

    return sig, codegen


@intrinsic
def _unstash(typingctx, ctx, T):
    """The tuple of type T at address ctx (from _stash), as a new reference."""
    ty = T.instance_type
    sig = ty(ctx, T)

    def codegen(context, builder, signature, llargs):
        val = builder.load(builder.inttoptr(llargs[0], context.get_value_type(ty).as_pointer()))
        context.nrt.incref(builder, ty, val)
        return val

    return sig, codegen


@njit(**KW)
def _adapter(i, ctx, T):
    """body(i, *args), the stashed tuple being (body's address, *args)."""
    tup = _unstash(ctx, T)
    call_native(tup[0], (i,) + tup[1:])


@njit(**KW)
def _stash_and_launch(launch, adapter, n, tup):
    call_native(launch, (adapter, n, _stash(tup)))


_launch_address = None


def launcher(body, args: tuple, slp: bool = False):
    """run(n, args): body(i, *args) for i in range(n) on numba's threads, for arguments of the
    types of args (numba.typeof's; the caller keeps them so), compiling body (slp: with
    LLVM's SLP vectoriser, widen.call_slp), the adapter and the stash for them on first use
    or loading them from the disk cache. Errors body raises are not propagated."""
    global _launch_address
    if _launch_address is None:
        _launch_address = address(_launch_on_threads, (_I64, _I64, _I64))
    sig = (_I64,) + tuple(numba.typeof(a) for a in args)
    body_addr = address(body, sig, slp)
    T = types.BaseTuple.from_types(sig)  # (body's address, *args)
    adapter = address(_adapter, (_I64, _I64, types.TypeRef(T)))
    outer = (_I64, _I64, _I64, T)
    _stash_and_launch.compile(outer)
    entry, launch = _stash_and_launch.overloads[outer].entry_point, _launch_address

    def run(n: int, args: tuple) -> None:
        entry(launch, adapter, n, (body_addr, *args))

    return run


_launchers = {}  # (body, slp, argument keys) -> run


def run_parallel(n: int, body, args: tuple, slp: bool = False) -> None:
    """body(i, *args) for i in range(n) on numba's threads (launcher's run), memoised on what
    decides the argument types where args are arrays, scalars and tuples of them."""
    keys = tuple(_key(a) for a in args)
    if any(k is _UNKEYED for k in keys):
        launcher(body, args, slp)(n, args)
        return
    run = _launchers.get((body, slp, keys))
    if run is None:
        run = _launchers[(body, slp, keys)] = launcher(body, args, slp)
    run(n, args)
