"""Calling a compiled kernel through its address, so that a parallel region does not compile it
again.

numba links the whole IR of every jitted callee into its caller and optimises the result again,
and a `parallel=True` kernel compiles its loop body as a gufunc of its own that is linked into
the kernel: a helper called from a prange loop is optimised three times (its own library, the
gufunc's, the kernel's). For the fused decode step that was about 6 s each of a cold start
(`NUMBA_LLVM_PASS_TIMINGS=1`). Here the parallel region holds only an indirect call: the helper
is compiled once, on its own, and each thread calls its machine code through the address
`address()` gives, in numba's own calling convention. Same code, same bits; the addresses are
found at run time, so the kernels that take them stay cacheable on disk.
"""

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.core import config as _nbconfig
from numba.extending import intrinsic


@intrinsic
def call_native(typingctx, addr, args):
    """call_native(addr, (a, b, ...)): calls the numba function compiled for exactly the types
    of (a, b, ...) whose machine code is at addr (an int from address()); it returns nothing.
    Errors the callee raises are not propagated (the kernels called this way raise none)."""
    sig = types.none(addr, args)

    def codegen(context, builder, signature, llargs):
        argtys = args.types
        vals = cgutils.unpack_tuple(builder, llargs[1], len(argtys))
        fnty = context.call_conv.get_function_type(types.none, argtys)
        fptr = builder.inttoptr(llargs[0], fnty.as_pointer())
        context.call_conv.call_function(builder, fptr, types.none, argtys, vals)
        return context.get_dummy_value()

    return sig, codegen


def address(dispatcher, argtypes: tuple, slp: bool = False) -> int:
    """The address of dispatcher's machine code for argtypes (numba types), compiling it (or
    loading it from the disk cache) on first use; slp: compile with LLVM's SLP vectoriser on
    (the block kernels need it, see widen.call_slp). The caller must pass arguments of
    exactly these types to call_native: a mismatch is undefined behaviour, not an error."""
    cres = dispatcher.overloads.get(argtypes)
    if cres is None:
        old = _nbconfig.SLP_VECTORIZE
        _nbconfig.SLP_VECTORIZE = 1 if slp else old
        try:
            dispatcher.compile(argtypes)
        finally:
            _nbconfig.SLP_VECTORIZE = old
        cres = dispatcher.overloads[argtypes]
    return cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)


_UNKEYED = object()
_addresses = {}  # (dispatcher, argument keys) -> address


def _key(a):
    """What decides numba's type of a (array: dtype, dimensions, layout, read-only, aligned;
    scalars and None: their Python type), without typing it; _UNKEYED for anything else."""
    if isinstance(a, np.ndarray):
        f = a.flags
        return (a.dtype, a.ndim, f.c_contiguous, f.f_contiguous, f.writeable, f.aligned)
    if a is None or isinstance(a, (bool, int, float, np.generic)):
        return type(a)
    return _UNKEYED


def address_for(dispatcher, args: tuple, slp: bool = False) -> int:
    """address() for the numba types of the values args, as a call would type them; memoised
    on what decides those types when args are arrays and scalars (typing them costs ~5 us an
    array, ~40 us a prefill GEMM call), typed in full otherwise."""
    keys = tuple(_key(a) for a in args)
    if any(k is _UNKEYED for k in keys):
        return address(dispatcher, tuple(numba.typeof(a) for a in args), slp)
    got = _addresses.get((dispatcher, keys))
    if got is None:
        got = _addresses[(dispatcher, keys)] = address(dispatcher, tuple(numba.typeof(a) for a in args), slp)
    return got
