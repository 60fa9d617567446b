"""Import direction: every sparrow module imports only its own tier or lower ones, and no two
modules import each other in a cycle.

Read statically with `ast` (nothing is imported): every import statement counts, at module level
or inside a function, class or `if TYPE_CHECKING`, and relative imports are resolved.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
from pathlib import Path

# Bottom to top. A module may import modules of its own tier or below, never above.
# "pkg.*" is the package pkg and every module in it.
TIERS = [
    # 0: definitions everything shares: errors, model config, weight storage, option objects
    ("sparrow.errors", "sparrow.config", "sparrow.quant", "sparrow.params", "sparrow.version"),
    # 1: leaf machinery on plain arrays and files: numba kernels, checkpoint readers (which
    #    build the tokenizer), tokenizer and chat template, structured output (tool specs,
    #    llguidance grammars and masks, tool-call parsers), images (decoding, preprocessing and
    #    the Qwen3-VL vision tower on kernels and stored weights)
    (
        "sparrow.kernels.*",
        "sparrow.loaders.*",
        "sparrow.tokenizer",
        "sparrow.chat_template",
        "sparrow.structured.*",
        "sparrow.vision.*",
    ),
    # 2: the KV cache: per-sequence state the models write and the attention kernels read
    ("sparrow.kv_cache",),
    # 3: the models: layers and decoders built from kernels, weights and caches
    ("sparrow.models.*",),
    # 4: the engine: sequences, sampling, generation loop and batching scheduler over a model
    ("sparrow.engine.*",),
    # 5: the public Python API (`import sparrow`)
    ("sparrow.api", "sparrow"),
    # 6: front ends on top of the API: command line, HTTP server, benchmarks, evaluation
    ("sparrow.cli", "sparrow.server.*", "sparrow.bench.*", "sparrow.eval.*"),
]
ROOT = "sparrow"

# Inside tier 1's kernels, bottom to top (the same rule: a module imports its own sub-tier or
# lower ones). The concerns of sub-tier 1 (matmul, attention) never import each other.
KERNEL_TIERS = [
    # 0: what every kernel shares: the target CPU, the weight formats, compile options, LLVM IR
    #    helpers, calls through a compiled function's address, the one parallel launcher, IR
    #    compiled for other CPUs (tests and scripts)
    (
        "sparrow.kernels.cpu",
        "sparrow.kernels.cross",
        "sparrow.kernels.formats",
        "sparrow.kernels.options",
        "sparrow.kernels.ir",
        "sparrow.kernels.native_call",
        "sparrow.kernels.parallel",
    ),
    # 1: kernels by concern: products with stored weights (exact rows, GEMM, the q8 mode),
    #    attention, elementwise ops, the vision tower's ops, the fused step's barrier
    (
        "sparrow.kernels.matmul.*",
        "sparrow.kernels.attention.*",
        "sparrow.kernels.elementwise",
        "sparrow.kernels.vision",
        "sparrow.kernels.fused.sync",
    ),
    # 2: what composes them: linear() (the one entry to the products), MoE experts, the fused
    #    decode step
    ("sparrow.kernels.linear", "sparrow.kernels.moe", "sparrow.kernels.fused.*"),
    # 3: the package: threading layer, disk cache, thread counts, compile progress
    ("sparrow.kernels",),
]
APART = ("sparrow.kernels.matmul", "sparrow.kernels.attention")


# ---------------------------------------------------------------------- the walker
def package_modules(root: str = ROOT) -> dict[str, tuple[Path, bool]]:
    """module name -> (source file, is a package) for every .py file of the package."""
    spec = importlib.util.find_spec(root)
    base = Path(list(spec.submodule_search_locations)[0])
    mods = {}
    for path in sorted(base.rglob("*.py")):
        parts = [root, *path.relative_to(base).with_suffix("").parts]
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def imports_of(source: str, module: str, is_pkg: bool, known: set[str], root: str = ROOT) -> list[tuple[int, str]]:
    """(line, imported module) for every import of a `root` module anywhere in source.

    `from X import name` counts as an import of X.name when that is a module, else of X; a
    target that is no known module is cut back to its longest known prefix."""
    package = module if is_pkg else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            if name != root and not name.startswith(root + "."):
                continue
            while name not in known and "." in name:
                name = name.rpartition(".")[0]
            if name != module:
                found.append((node.lineno, name))
    return sorted(set(found))


def tier_of(module: str, tiers=None) -> int | None:
    for i, patterns in enumerate(tiers or TIERS):
        if any(module == p.removesuffix(".*") or fnmatch.fnmatchcase(module, p) for p in patterns):
            return i
    return None


def import_graph(mods: dict[str, tuple[Path, bool]]) -> dict[str, list[tuple[int, str]]]:
    known = set(mods)
    return {m: imports_of(path.read_text(), m, is_pkg, known) for m, (path, is_pkg) in mods.items()}


def upward_imports(graph, tier=tier_of) -> list[str]:
    """One message per import that goes to a higher tier."""
    bad = []
    for m, edges in sorted(graph.items()):
        for line, target in edges:
            if tier(target) is not None and tier(m) is not None and tier(target) > tier(m):
                bad.append(f"{m}:{line} (tier {tier(m)}) imports {target} (tier {tier(target)})")
    return bad


def cycles(graph) -> list[list[str]]:
    """One concrete cycle [a, b, ..., a] per strongly connected component of the module graph."""
    succ = {m: sorted({t for _, t in edges if t in graph}) for m, edges in graph.items()}
    index, low, stack, on, comps = {}, {}, [], set(), []

    def strong(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(succ):
        if v not in index:
            strong(v)
    out = []
    for comp in comps:  # the shortest way back to the smallest member, breadth first
        start = min(comp)
        prev, queue = {start: None}, [start]
        for v in queue:
            if start in succ[v]:
                break
            for w in succ[v]:
                if w in comp and w not in prev:
                    prev[w] = v
                    queue.append(w)
        path = []
        while v is not None:
            path.append(v)
            v = prev[v]
        out.append(path[::-1] + [start])
    return sorted(out)


def _cycle_message(graph, cyc) -> str:
    lines = {(m, t): line for m, edges in graph.items() for line, t in edges}
    return " -> ".join(f"{a} (line {lines[a, b]})" for a, b in zip(cyc, cyc[1:])) + f" -> {cyc[-1]}"


# ---------------------------------------------------------------------- the checks
def test_every_module_has_a_tier():
    missing = [m for m in package_modules() if tier_of(m) is None]
    assert not missing, f"modules with no tier (add them to TIERS in {__file__}): {missing}"


def test_imports_go_down_the_tiers():
    bad = upward_imports(import_graph(package_modules()))
    assert not bad, "imports of a higher tier (see TIERS in tests/test_layers.py):\n  " + "\n  ".join(bad)


def kernel_tier_of(module: str) -> int | None:
    return tier_of(module, KERNEL_TIERS)


def test_kernels_import_down_their_sub_tiers():
    graph = {m: e for m, e in import_graph(package_modules()).items() if m.startswith("sparrow.kernels")}
    assert all(kernel_tier_of(m) is not None for m in graph), [m for m in graph if kernel_tier_of(m) is None]
    bad = upward_imports(graph, kernel_tier_of)
    assert not bad, "kernel imports of a higher sub-tier (KERNEL_TIERS in tests/test_layers.py):\n  " + "\n  ".join(bad)
    crossing = [
        f"{m}:{line} imports {t}"
        for m, edges in graph.items()
        for line, t in edges
        for a, b in (APART, APART[::-1])
        if (m == a or m.startswith(a + ".")) and (t == b or t.startswith(b + "."))
    ]
    assert not crossing, crossing
    # the check sees an upward import when there is one
    assert upward_imports({"sparrow.kernels.ir": [(3, "sparrow.kernels.linear")]}, kernel_tier_of)


def test_no_import_cycles():
    graph = import_graph(package_modules())
    found = [_cycle_message(graph, c) for c in cycles(graph)]
    assert not found, "import cycles between modules:\n  " + "\n  ".join(found)


def test_walker_sees_every_kind_of_import():
    # The checks above must not pass because the walker misses imports.
    src = (
        "import os\n"
        "import sparrow.kv_cache\n"
        "from sparrow import api\n"
        "from . import linear\n"
        "from ..models import decoder as d\n"
        "from .. import errors, params\n"
        "def f():\n"
        "    from ..engine.scheduler import Scheduler\n"
        "class C:\n"
        "    def m(self):\n"
        "        if True:\n"
        "            import sparrow.server.app.thing\n"
        "            from .gemm import gemm_stored\n"
        "            from .fake import x\n"
    )
    known = {
        "sparrow",
        "sparrow.api",
        "sparrow.kv_cache",
        "sparrow.errors",
        "sparrow.params",
        "sparrow.models",
        "sparrow.models.decoder",
        "sparrow.engine",
        "sparrow.engine.scheduler",
        "sparrow.server",
        "sparrow.server.app",
        "sparrow.kernels",
        "sparrow.kernels.linear",
        "sparrow.kernels.gemm",
        "sparrow.kernels.fake",
    }
    got = imports_of(src, "sparrow.kernels.fake", False, known)
    assert got == [
        (2, "sparrow.kv_cache"),
        (3, "sparrow.api"),
        (4, "sparrow.kernels.linear"),
        (5, "sparrow.models.decoder"),
        (6, "sparrow.errors"),
        (6, "sparrow.params"),
        (8, "sparrow.engine.scheduler"),
        (12, "sparrow.server.app"),
        (13, "sparrow.kernels.gemm"),
    ]
    # In a package __init__, one dot is the package itself.
    assert imports_of("from .linear import linear\nfrom . import gemm\n", "sparrow.kernels", True, known) == [
        (1, "sparrow.kernels.linear"),
        (2, "sparrow.kernels.gemm"),
    ]
    assert (
        tier_of("sparrow"),
        tier_of("sparrow.kernels"),
        tier_of("sparrow.kernels.gemm"),
        tier_of("sparrowx"),
    ) == (
        5,
        1,
        1,
        None,
    )
    graph = {"sparrow.kernels.fake": got}
    assert upward_imports(graph) == [
        "sparrow.kernels.fake:2 (tier 1) imports sparrow.kv_cache (tier 2)",
        "sparrow.kernels.fake:3 (tier 1) imports sparrow.api (tier 5)",
        "sparrow.kernels.fake:5 (tier 1) imports sparrow.models.decoder (tier 3)",
        "sparrow.kernels.fake:8 (tier 1) imports sparrow.engine.scheduler (tier 4)",
        "sparrow.kernels.fake:12 (tier 1) imports sparrow.server.app (tier 6)",
    ]
    # Cycles, including one only closed by a function-level import.
    g = {"a": [(1, "b")], "b": [(3, "c")], "c": [(9, "a"), (2, "d")], "d": [], "e": [(1, "f")], "f": [(4, "e")]}
    assert cycles(g) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert _cycle_message(g, ["e", "f", "e"]) == "e (line 1) -> f (line 4) -> e"
    assert cycles({"a": [(1, "b")], "b": [(1, "c")], "c": []}) == []
    # And on the real tree: it finds the package, function-level and relative imports.
    mods = package_modules()
    assert {"sparrow", "sparrow.cli", "sparrow.kernels", "sparrow.kernels.linear", "sparrow.models"} <= mods.keys()
    real = import_graph(mods)
    assert "sparrow.api" in {t for _, t in real["sparrow.cli"]}  # `from .api import load` inside a function
    assert "sparrow.errors" in {t for _, t in real["sparrow.config"]}  # `from .errors import ...`
