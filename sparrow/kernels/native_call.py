"""Calling a compiled kernel through its address, so that its callers do not compile it again.

numba links the whole IR of every jitted callee into its caller, optimises the result again and
emits its machine code again: a helper three calls deep is optimised three times (its own
library, and each caller's), and a `parallel=True` kernel adds its gufunc's. For the fused decode
step that was about 6 s of a cold start per level (`NUMBA_LLVM_PASS_TIMINGS=1`). Here the caller
holds only an indirect call: the callee is compiled once, on its own, and called through the
address `address()` gives, in numba's own calling convention. Same code, same bits; the
addresses are found at run time, so the kernels that take them stay cacheable on disk.

The caller must pass exactly the argument types the address was compiled for. Where those are
the caller's own argument types (kernels/parallel.py) or fixed ones (C-contiguous x from
np.ascontiguousarray, a column slice y[:, a:b]), call_native; where they are derived outside
numba (the fused step's views of its tables' arrays), call_checked, which compares a key of the types its call site
compiled with against the key given with the address and calls only if they match.
"""

import hashlib

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


@intrinsic
def view(typingctx, addr, shape, like):
    """view(addr, (n0, n1, ...), like): the C-ordered array at the int address addr with this
    shape, of like's dtype and read-only flag (like: an array used for its type only). It
    owns nothing: whoever gave the address keeps the memory alive while the view is used.
    This lets a kernel take many arrays as one table of addresses and sizes instead of
    numba typed lists, which compile their own code for each item type."""
    nd = len(shape)
    aryty = types.Array(like.dtype, nd, "C", readonly=not like.mutable)
    sig = aryty(addr, shape, like)

    def codegen(context, builder, signature, llargs):
        from numba.np.arrayobj import make_array, populate_array

        intp = types.intp
        ary = make_array(aryty)(context, builder)
        itemsize = context.get_abi_sizeof(context.get_data_type(aryty.dtype))
        dims = [context.cast(builder, v, t, intp) for v, t in zip(cgutils.unpack_tuple(builder, llargs[1], nd), shape)]
        strides, step = [], context.get_constant(intp, itemsize)
        for d in reversed(dims):
            strides.insert(0, step)
            step = builder.mul(step, d)
        data = builder.inttoptr(context.cast(builder, llargs[0], addr, types.int64), ary.data.type)
        populate_array(ary, data=data, shape=dims, strides=strides, itemsize=itemsize, meminfo=None)
        return ary._getvalue()

    return sig, codegen


def type_key(argtypes) -> int:
    """A stable 63-bit key of a signature (numba types; literals count as their plain types)."""
    text = ",".join(str(types.unliteral(t)) for t in argtypes)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


@intrinsic
def call_checked(typingctx, addr, key, args):
    """call_checked(addr, key, (a, b, ...)) -> whether it called: call_native for a callee whose
    argument types are derived outside numba (address_checked), where a mismatch would be
    undefined behaviour. The call's own types (literals as their plain types) are fixed when
    the caller compiles, and their type_key is a constant of its code: it calls only where the
    key given at run time is that one, and otherwise returns False for the caller to report."""
    argtys = tuple(types.unliteral(t) for t in args.types)
    want = type_key(argtys)
    sig = types.boolean(addr, key, args)

    def codegen(context, builder, signature, llargs):
        vals = cgutils.unpack_tuple(builder, llargs[2], len(argtys))
        vals = [context.cast(builder, v, t, u) for v, t, u in zip(vals, args.types, argtys)]
        got = context.cast(builder, llargs[1], key, types.int64)
        ok = builder.icmp_signed("==", got, context.get_constant(types.int64, want))
        with builder.if_then(ok):
            fnty = context.call_conv.get_function_type(types.none, argtys)
            fptr = builder.inttoptr(llargs[0], fnty.as_pointer())
            context.call_conv.call_function(builder, fptr, types.none, argtys, vals)
        return ok

    return sig, codegen


def address_checked(dispatcher, argtypes: tuple) -> tuple[int, int]:
    """(address(dispatcher, argtypes), type_key(argtypes)): what call_checked takes."""
    return address(dispatcher, argtypes), type_key(argtypes)


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
    scalars and None: their Python type; a tuple: its items'), without typing it; _UNKEYED
    for anything else."""
    if isinstance(a, np.ndarray):
        f = a.flags
        return (a.dtype, a.ndim, f.c_contiguous, f.f_contiguous, f.writeable, f.aligned)
    if a is None or isinstance(a, (bool, int, float, np.generic)):
        return type(a)
    if isinstance(a, tuple):
        keys = tuple(_key(v) for v in a)
        return _UNKEYED if any(k is _UNKEYED for k in keys) else (tuple, keys)
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
