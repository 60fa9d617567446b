"""Dispatch on a weight format's id from a table, the way ggml's type_traits_cpu[] drives its
kernels: by_kind(name, {kind: kernel}) is one compiled function that calls the kernel of the
kind it is given. Each module builds its table from formats.FORMATS (the formats claiming what
its kernels do), so a new format is a record there and its kernels, not an edit of every
`if kind == ...` chain; tests/test_formats.py checks each table's kinds against the records.

numba cannot index a tuple of functions with a run-time id, so the dispatcher is a chain of
small compiled links, one per entry: `kind == k ? kernel(*args) : next(kind, *args)`; the
kernels' calls are inlined as a hand-written chain's were. Each link is its own function with
the entry's kernel and its successor as globals, named after the dispatcher and its kind, so
numba's disk cache keeps each link under its own name (closure cells would put the kernels'
per-process ids in the cache key, and every process would compile the links again).
"""

import types as _pytypes

from numba import njit

from sparrow.kernels.options import KW

# The links' templates: each link runs one of them with its own KIND, KERNEL and NEXT as globals.
KIND = KERNEL = NEXT = None


def _link(kind, *args):
    if kind == KIND:
        return KERNEL(*args)
    return NEXT(kind, *args)


def _last(kind, *args):
    return KERNEL(*args)


_NAMES = set()  # the dispatchers' names: each link's cache files are named after its dispatcher


def by_kind(name: str, table: dict, default=None):
    """name(kind, *args) -> table[kind](*args). default: the kernel for a kind the table does not
    name; without one the table's last entry takes them (callers dispatch only the kinds their
    table claims: their inputs come from formats' ids). The result's `.kinds` is the table's
    kinds, in dispatch order."""
    if name in _NAMES:
        raise ValueError(f"by_kind: a second dispatcher named {name!r} would share the first's cache files")
    _NAMES.add(name)
    entries = list(table.items())
    if default is not None:
        chain = _make(_last, f"{name}_other", None, default, None)
    else:
        (k, kernel), entries = entries[-1], entries[:-1]
        chain = _make(_last, f"{name}_{k}", k, kernel, None)
    for k, kernel in reversed(entries):
        chain = _make(_link, f"{name}_{k}", k, kernel, chain)
    chain.kinds = tuple(table)
    return chain


def _make(template, qualname, kind, kernel, nxt):
    glb = {"__name__": __name__, "KIND": kind, "KERNEL": kernel, "NEXT": nxt}
    fn = _pytypes.FunctionType(template.__code__, glb, qualname)
    fn.__qualname__ = qualname
    return njit(**KW)(fn)
