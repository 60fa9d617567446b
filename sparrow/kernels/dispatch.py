"""Dispatch on a weight format's id from a table, the way ggml's type_traits_cpu[] drives its
kernels: by_kind(name, {kind: kernel}) is one compiled function that calls the kernel of the
kind it is given. Each module builds its tables from formats.FORMATS (the formats claiming what
its kernels do), so a new format is a record there and its kernels, not an edit of every
`if kind == ...` chain; tests/test_formats.py checks each table's kinds against the records.

numba cannot index a tuple of functions with a run-time id, so by_kind writes the chain a
person would, `if kind == k: return kernel_k(*args)` for each entry, as one function whose
globals are the kernels: one function, so LLVM inlines the kernels into it as it did the
hand-written chains (a chain of one small function per entry called each other un-inlined and
widened a q4_k row 50% slower). It is compiled from text under this file's name and its own
qualified name, so numba's disk cache keeps it beside the kernels (a closure would put the
kernels' per-process ids into the cache key, and every process would compile it again).
"""

from numba import njit

from sparrow.kernels.options import KW

_NAMES = set()  # the dispatchers' names: each one's cache files are named after it


def by_kind(name: str, table: dict, default=None):
    """name(kind, *args) -> table[kind](*args). default: the kernel for a kind the table does not
    name; without one the table's last entry takes them (callers dispatch only the kinds their
    table claims: their inputs come from formats' ids). The result's `.kinds` is the table's
    kinds, in dispatch order."""
    if name in _NAMES:
        raise ValueError(f"by_kind: a second dispatcher named {name!r} would share the first's cache files")
    if not name.isidentifier() or not table:
        raise ValueError(f"by_kind: {name!r} needs a Python name and at least one kernel")
    _NAMES.add(name)
    kinds = list(table)
    tested = kinds if default is not None else kinds[:-1]
    glb = {"__name__": __name__, "OTHER": default if default is not None else table[kinds[-1]]}
    lines = [f"def {name}(kind, *args):"]
    for i, k in enumerate(tested):
        glb[f"KERNEL_{i}"] = table[k]
        lines += [f"    if kind == {int(k)}:", f"        return KERNEL_{i}(*args)"]
    lines.append("    return OTHER(*args)")
    exec(compile("\n".join(lines) + "\n", __file__, "exec"), glb)
    fn = glb[name]
    fn.__qualname__ = name
    dispatcher = njit(**KW)(fn)
    dispatcher.kinds = tuple(kinds)
    return dispatcher
