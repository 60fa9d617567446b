"""Import direction: every sparrow module imports only its own tier or lower ones, and no two
modules import each other in a cycle. The lab (sparrow_lab: benchmarks, evaluation, tooling for
tests) sits above the whole engine package: it imports sparrow, and sparrow never imports it; the
CLI alone names it, to load a benchmark by name when `sparrow bench` runs.

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
    # 0: definitions everything shares: errors, model config, option objects and the request that
    #    carries them to the engine; the process's memory as the OS sees it (madvise, heap trim,
    #    the compiler's pages)
    ("sparrow.errors", "sparrow.config", "sparrow.params", "sparrow.request", "sparrow.version", "sparrow.memory"),
    # 1: leaf machinery on plain arrays and files: numba kernels, weight storage (its formats
    #    are the kernels' format table), checkpoint readers (which build the tokenizer),
    #    tokenizer and chat template, structured output (tool specs, llguidance grammars and
    #    masks, tool-call parsers), images (decoding, preprocessing and the Qwen3-VL vision
    #    tower on kernels and stored weights)
    (
        "sparrow.kernels.*",
        "sparrow.quant",
        "sparrow.loaders.*",
        "sparrow.tokenizer",
        "sparrow.chat_template",
        "sparrow.structured.*",
        "sparrow.vision.*",
    ),
    # 2: a sequence's state (sparrow/state/): K/V storage, the selectors' side copies, a hybrid
    #    model's recurrent state, the KV budget and its manager, the prefix and disk caches; the
    #    models write it, the attention kernels read it, the engine reaches it through its interface
    ("sparrow.state", "sparrow.state.*"),
    # 3: the models: layers and decoders built from kernels, weights and caches
    ("sparrow.models.*",),
    # 4: the engine: sequences, sampling, generation loop and batching scheduler over a model
    ("sparrow.engine.*",),
    # 5: the public Python API (`import sparrow`)
    ("sparrow.api", "sparrow"),
    # 6: front ends on top of the API: command line, HTTP server
    ("sparrow.cli", "sparrow.server.*"),
    # 7: the lab, a package of its own beside sparrow: benchmarks, evaluation, tooling for tests
    ("sparrow_lab", "sparrow_lab.*"),
]
ROOT = "sparrow"
LAB = "sparrow_lab"
ROOTS = (ROOT, LAB)

# Inside tier 1's kernels, bottom to top (the same rule: a module imports its own sub-tier or
# lower ones). The concerns of sub-tier 1 (matmul, attention) never import each other.
KERNEL_TIERS = [
    # 0: what every kernel shares: the target CPU, the weight formats, compile options, LLVM IR
    #    helpers (the integer dots' too, with their forms per architecture), calls through a
    #    compiled function's address, dispatch on a format's id, the one parallel launcher,
    #    numba's setup (threading layer, disk cache, thread counts, compile progress)
    (
        "sparrow.kernels.cpu",
        "sparrow.kernels.formats",
        "sparrow.kernels.dispatch",
        "sparrow.kernels.options",
        "sparrow.kernels.ir",
        "sparrow.kernels.intdot",
        "sparrow.kernels.arch",
        "sparrow.kernels.arch.*",
        "sparrow.kernels.native_call",
        "sparrow.kernels.parallel",
        "sparrow.kernels.runtime",
    ),
    # 1: kernels by concern: products with stored weights (exact rows, GEMM, the q8 mode),
    #    attention, elementwise ops, the vision tower's ops, the gated delta rule, the fused
    #    step's barrier
    (
        "sparrow.kernels.matmul.*",
        "sparrow.kernels.attention.*",
        "sparrow.kernels.elementwise",
        "sparrow.kernels.vision",
        "sparrow.kernels.deltanet",
        "sparrow.kernels.fused.sync",
    ),
    # 2: what composes them: linear() (the one entry to the products), MoE experts, the fused
    #    decode step
    ("sparrow.kernels.linear", "sparrow.kernels.moe", "sparrow.kernels.fused.*"),
    # 3: the package, whose import sets numba up (runtime.configure)
    ("sparrow.kernels",),
]
APART = ("sparrow.kernels.matmul", "sparrow.kernels.attention")

# Inside the lab, bottom to top: the evaluation and the test tooling, then the benchmarks over them.
LAB_TIERS = [
    ("sparrow_lab", "sparrow_lab.cross", "sparrow_lab.eval.*"),
    ("sparrow_lab.bench.*",),
]


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


def all_modules() -> dict[str, tuple[Path, bool]]:
    """The engine's modules and the lab's, in one map (the lab is checked against the same tiers)."""
    return {m: v for root in ROOTS for m, v in package_modules(root).items()}


def imports_of(
    source: str, module: str, is_pkg: bool, known: set[str], roots: tuple[str, ...] = ROOTS
) -> list[tuple[int, str]]:
    """(line, imported module) for every import of a module of `roots` anywhere in source.

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
            if not any(name == root or name.startswith(root + ".") for root in roots):
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
    missing = [m for m in all_modules() if tier_of(m) is None]
    assert not missing, f"modules with no tier (add them to TIERS in {__file__}): {missing}"


def test_imports_go_down_the_tiers():
    bad = upward_imports(import_graph(all_modules()))
    assert not bad, "imports of a higher tier (see TIERS in tests/test_layers.py):\n  " + "\n  ".join(bad)


def kernel_tier_of(module: str) -> int | None:
    return tier_of(module, KERNEL_TIERS)


def test_kernels_import_down_their_sub_tiers():
    graph = {m: e for m, e in import_graph(all_modules()).items() if m.startswith("sparrow.kernels")}
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


def lab_tier_of(module: str) -> int | None:
    return tier_of(module, LAB_TIERS)


def test_lab_imports_down_its_sub_tiers():
    graph = {m: e for m, e in import_graph(all_modules()).items() if m == LAB or m.startswith(LAB + ".")}
    assert graph, "no sparrow_lab modules found: is the lab installed beside sparrow?"
    assert all(lab_tier_of(m) is not None for m in graph), [m for m in graph if lab_tier_of(m) is None]
    bad = upward_imports(graph, lab_tier_of)
    assert not bad, "lab imports of a higher sub-tier (LAB_TIERS in tests/test_layers.py):\n  " + "\n  ".join(bad)


def lab_names(source: str) -> list[int]:
    """Lines where code (not a docstring or comment) names the lab: an identifier or a string."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if LAB in node.value:
                found.add(node.lineno)
        elif isinstance(node, ast.Name) and node.id == LAB:
            found.add(node.lineno)
        elif isinstance(node, ast.alias) and (node.name == LAB or node.name.startswith(LAB + ".")):
            found.add(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module and (node.module + ".").startswith(LAB + "."):
            found.add(node.lineno)
    return sorted(found)


def test_engine_never_imports_the_lab():
    # Statically (the tiers above catch it too) and by name: an importlib call with the lab's
    # name is invisible to the walker, so the lab's name may appear in the code of one module
    # only, the CLI, whose `sparrow bench` loads sparrow_lab.bench.NAME when it runs.
    engine = package_modules(ROOT)
    graph = import_graph(all_modules())
    static = [f"{m}:{line} imports {t}" for m in engine for line, t in graph[m] if t == LAB or t.startswith(LAB + ".")]
    assert not static, "the engine package imports the lab:\n  " + "\n  ".join(static)
    named = [f"{m}:{line}" for m, (path, _) in engine.items() for line in lab_names(path.read_text())]
    assert [n.partition(":")[0] for n in named] == ["sparrow.cli"], (
        f"only sparrow.cli may name {LAB} (its lazy `sparrow bench` dispatch); found: {named}"
    )
    # the checks see the lab when it is named
    assert lab_names("import sparrow_lab.bench.speed\n") == [1]
    assert lab_names("from sparrow_lab import cross\n") == [1]
    assert lab_names('"""sparrow_lab in a docstring"""\nx = importlib.import_module("sparrow_lab.x")\n') == [2]
    assert lab_names('"""sparrow_lab in a docstring"""\n# sparrow_lab in a comment\n') == []
    assert upward_imports({"sparrow.api": [(7, "sparrow_lab.bench.speed")]}) == [
        "sparrow.api:7 (tier 5) imports sparrow_lab.bench.speed (tier 7)"
    ]


API_NAMES = ("llm", "LLM", "draft_llm")  # the public API's model object and its methods


def api_ties(source: str) -> list[int]:
    """Lines where source names the API's model object (a name, an attribute or an argument):
    an upward tie no import shows, as when the engine was handed `api.LLM` and called back into it."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        name = getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "arg", None)
        if name in API_NAMES:
            found.add(node.lineno)
    return sorted(found)


def test_engine_takes_a_model_handle_not_the_api():
    """The engine is handed an engine.handle.ModelHandle (runner, tokenizer, context, draft
    factory), never the public api.LLM: no engine module names it or calls back into it."""
    engine = {m: path for m, (path, _) in package_modules(ROOT).items() if m.startswith("sparrow.engine.")}
    ties = [f"{m}:{line}" for m, path in engine.items() for line in api_ties(path.read_text())]
    assert not ties, "the engine reaches up to the API's LLM:\n  " + "\n  ".join(ties)
    assert api_ties("def f(llm):\n    return x.draft_llm(p)\n") == [1, 2]  # the check sees a tie
    assert api_ties('"""an llm in a docstring"""\n') == []


def test_bench_without_the_lab_says_how_to_get_it(monkeypatch, capsys):
    """Where sparrow_lab is not importable, `sparrow bench` fails in one line that says how to get it."""
    import sys
    from importlib.abc import MetaPathFinder

    from sparrow import cli

    class NoLab(MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == LAB or name.startswith(LAB + "."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    for name in [m for m in sys.modules if m == LAB or m.startswith(LAB + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NoLab(), *sys.meta_path])
    assert cli.main(["bench", "speed", "--help"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"needs the {LAB} package" in err and "pip install -e '.[lab]'" in err, err


def test_no_import_cycles():
    graph = import_graph(all_modules())
    found = [_cycle_message(graph, c) for c in cycles(graph)]
    assert not found, "import cycles between modules:\n  " + "\n  ".join(found)


def test_walker_sees_every_kind_of_import():
    # The checks above must not pass because the walker misses imports.
    src = (
        "import os\n"
        "import sparrow.state.cache\n"
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
        "sparrow.state.cache",
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
        (2, "sparrow.state.cache"),
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
        "sparrow.kernels.fake:2 (tier 1) imports sparrow.state.cache (tier 2)",
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
    lab = import_graph(all_modules())["sparrow_lab.bench.needle"]
    assert {"sparrow.api", "sparrow_lab.eval.report"} <= {t for _, t in lab}  # the lab's imports, both roots
