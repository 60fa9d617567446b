"""A newcomer's paths (issue 18): every `sparrow bench` command on a base install (no matplotlib,
httpx or llama-cpp-python) writes its JSON record and exits cleanly; a plotting error costs only
the plots; the first run on an empty kernel cache says that it is compiling, a warm one is silent.

Benchmarks run as `python -m sparrow.cli bench ...` subprocesses on tiny budgets with a
PYTHONPATH shim whose matplotlib/httpx/llama_cpp packages raise ModuleNotFoundError on import.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from sparrow.kernels import runtime as K
from sparrow_lab.eval import report

MISSING = ("matplotlib", "httpx", "llama_cpp")  # not in the base install


def _env(tmp_path, **extra) -> dict:
    shim = tmp_path / "shim"
    for name in MISSING:
        (shim / name).mkdir(parents=True, exist_ok=True)
        (shim / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n"
        )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.update(extra)
    return env


def _sparrow(args, env, cwd, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sparrow.cli"] + args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


# (bench, its smallest options, where the record goes relative to the output dir, stderr it must say)
BENCHES = [
    (
        "activations",
        ["--positions", "12", "--decode", "2", "--json", "{d}/activations.json"],
        "activations.json",
        None,
    ),
    (
        "needle",
        ["--lengths", "1K", "--depths", "50", "--ks", "8", "--max-tokens", "2", "--out", "{d}"],
        "needle.json",
        "plots skipped (matplotlib is not installed; to get them: pip install matplotlib",
    ),
    (
        "fidelity",
        ["--lengths", "1K", "--depths", "50", "--ks", "8", "--max-tokens", "2", "--out", "{d}"],
        "fidelity.json",
        "plots skipped (matplotlib is not installed; to get them: pip install matplotlib",
    ),
    (
        "attention",
        ["--contexts", "256", "--ks", "8", "--kv-dtypes", "f32", "--repeats", "1", "--json", "{d}/attention.json"],
        "attention.json",
        None,
    ),
    (
        "speed",
        [
            "--contexts",
            "64",
            "--rounds",
            "1",
            "--decode",
            "2",
            "--no-startup",
            "--threads",
            "1",
            "--compare",
            "llama-cpp",
            "--json",
            "{d}/speed.json",
            "--md",
            "{d}/speed.md",
        ],
        "speed.json",
        "llama-cpp-python is not importable: measuring sparrow only",
    ),
    (
        "serve",
        ["--streams", "1", "--prompt-tokens", "8", "--max-tokens", "2", "--threads", "1", "--json", "{d}/serve.json"],
        "serve.json",
        None,
    ),
]


@pytest.mark.parametrize("bench,opts,record,says", BENCHES, ids=[b[0] for b in BENCHES])
def test_bench_writes_its_record_on_a_base_install(tmp_path, bench, opts, record, says):
    d = tmp_path / "out"
    r = _sparrow(["bench", bench] + [o.format(d=d) for o in opts], _env(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    rec = json.load(open(d / record))
    assert rec["rows"] if bench != "speed" else rec["table"]
    if says:
        assert says in r.stderr
    if bench in ("needle", "fidelity"):
        assert (
            (d / f"{bench}.md").read_text().startswith("Needle retrieval" if bench == "needle" else "Sparse fidelity")
        )
        assert {x["config"] for x in rec["rows"]} == {"exact", "sparse k=8"}
        assert rec["outputs"]["plots"] == [] and not list(d.glob("*.png"))
        assert r.stderr.count("plots skipped") == 1 and "pip install -e '.[lab]'" in r.stderr
    assert not (tmp_path / "runs").exists()  # the record went where it was asked to


def _record(rows) -> dict:
    return {
        "bench": "needle",
        "model": "m",
        "kv_dtype": "f32",
        "threads": 1,
        "answer_prefix": True,
        "max_tokens": 2,
        "block": 32,
        "probe": 8,
        "environment": report.environment(),
        "wall_s": 1.0,
        "rows": rows,
    }


def test_an_error_while_plotting_costs_only_the_plots(tmp_path, monkeypatch, capsys):
    from sparrow_lab.bench import needle

    def broken(prefix, rows):
        raise ValueError("bad axis")

    monkeypatch.setattr(report, "plot", broken)
    rows = [
        {"config": "exact", "k": None, "text": "ramen", "score": 1.0, "n_prompt": 1000, "attn_ms": 1.0, "total_ms": 2.0}
    ]
    needle.write_outputs(_record(rows), str(tmp_path), "Needle retrieval")
    err = capsys.readouterr().err
    assert "plots skipped (plotting failed: ValueError: bad axis)" in err
    assert json.load(open(tmp_path / "needle.json"))["rows"] == rows
    assert "| exact | 100% (1) | ramen |" in (tmp_path / "needle.md").read_text()


def test_the_record_is_written_before_the_plots(tmp_path, monkeypatch):
    from sparrow_lab.bench import needle

    seen = []
    monkeypatch.setattr(report, "plot", lambda prefix, rows: seen.append(sorted(os.listdir(tmp_path))) or [])
    needle.write_outputs(_record([{"config": "exact", "k": None, "text": "x", "n_prompt": 10}]), str(tmp_path), "T")
    assert seen == [["needle.json", "needle.md"]]


# ---------------------------------------------------------------- compile notice
def test_cache_is_cold_and_keyed_on_the_cpu(tmp_path, monkeypatch):
    assert K.cache_is_cold(str(tmp_path))
    (tmp_path / "sparrow_kernels_gemm").mkdir()
    (tmp_path / "sparrow_kernels_gemm" / "gemm.matmul-10.py311.1.nbc").write_bytes(b"")
    assert K.cache_is_cold(str(tmp_path))  # compiled code without its index is not a cache numba reads
    (tmp_path / "sparrow_kernels_gemm" / "gemm.matmul-10.py311.nbi").write_bytes(b"")
    assert not K.cache_is_cold(str(tmp_path))

    here = os.path.dirname(K.__file__)
    a = K._cache_dir(here, str(tmp_path / "c"))
    assert K._host_cpu() and a == K._cache_dir(here, str(tmp_path / "c"))
    monkeypatch.setattr(K, "_host_cpu", lambda: "some-other-cpu;+avx2")
    assert K._cache_dir(here, str(tmp_path / "c")) != a  # a cache copied to another CPU counts as empty


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_until(env, cwd, pattern: str, timeout=600) -> str:
    """Starts `sparrow serve`, returns its stderr up to the first line matching pattern, stops it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparrow.cli", "serve", "--port", str(_free_port())],
        env=env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if re.search(pattern, line):
                break
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
    return "".join(lines)


def test_first_run_says_it_compiles_and_a_warm_one_is_silent(tmp_path):
    """An empty cache (XDG_CACHE_HOME, so the sources+CPU keyed folder under it is new): one
    notice line on stderr before compiling; the second run against the same folder prints none.
    The server says it too, and is silent when warm."""
    env = _env(tmp_path, XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("NUMBA_CACHE_DIR", None)
    t0 = time.time()
    cold = _sparrow(["generate", "--max-tokens", "1", "-p", "hi"], env, cwd=tmp_path)
    assert cold.returncode == 0, cold.stderr[-3000:]
    assert cold.stderr.count(K.COMPILE_NOTICE) == 1, cold.stderr[-3000:]
    assert cold.stderr.startswith(K.COMPILE_NOTICE)  # before anything else, i.e. before compiling
    cold_s = time.time() - t0
    warm = _sparrow(["generate", "--max-tokens", "1", "-p", "hi"], env, cwd=tmp_path)
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert "compiling" not in warm.stderr, (cold_s, warm.stderr)

    out = _serve_until(env, tmp_path, r"loaded in|failed")
    assert "loaded in" in out and "compiling" not in out, out
    fresh = dict(env, XDG_CACHE_HOME=str(tmp_path / "empty"))
    out = _serve_until(fresh, tmp_path, re.escape(K.COMPILE_NOTICE) + "|loaded in|failed")
    assert K.COMPILE_NOTICE in out, out


def test_version_names_sparrow_and_its_kernel_stack():
    """`sparrow --version` answers at once (no kernels loaded) with the versions a bug report needs."""
    import numba
    import numpy

    from sparrow import __version__

    r = subprocess.run([sys.executable, "-m", "sparrow.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert r.stdout.strip() == (
        f"sparrow {__version__} (numba {numba.__version__}, numpy {numpy.__version__}, Python {sys.version.split()[0]})"
    )
