"""Worker-thread pinning (sparrow.kernels.runtime.pin_worker_threads) and the OpenBLAS setting."""

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, os, threading
import sparrow
from sparrow.api import set_threads
from sparrow.kernels import runtime as K
set_threads(2)
main = threading.get_native_id()
aff = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task") if int(t) != main}
print(json.dumps({"pinned": K._pinned, "aff": aff, "timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT")}))
"""


def _child(env_extra):
    env = dict(os.environ, **env_extra)
    env.pop("OPENBLAS_THREAD_TIMEOUT", None)
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="pinning needs Linux affinity and 2+ CPUs",
)
def test_workers_pinned_one_per_cpu():
    out = _child({})
    assert out["pinned"] is True
    assert out["timeout"] == "4"  # set by `import sparrow` before numpy loaded OpenBLAS
    single = [cpus[0] for cpus in out["aff"].values() if len(cpus) == 1]
    ncpu = len(os.sched_getaffinity(0))
    # numba starts one worker per CPU (NUMBA_NUM_THREADS): each CPU gets exactly one
    assert sorted(single) == sorted(os.sched_getaffinity(0))[: len(single)] and len(single) >= min(ncpu, 2)
    assert len(set(single)) == len(single)


def test_pinning_can_be_turned_off():
    out = _child({"SPARROW_PIN_THREADS": "0"})
    assert out["pinned"] is False
    assert all(len(c) == len(os.sched_getaffinity(0)) for c in out["aff"].values())


def test_numba_cache_dir_follows_kernel_sources(tmp_path):
    # any edit to any kernel file must select a fresh cache (numba itself only notices
    # edits to the file that holds a cached function, not to helpers it inlines)
    import shutil

    from sparrow.kernels import runtime as K

    src = tmp_path / "kernels"
    shutil.copytree(os.path.dirname(K.__file__), src, ignore=shutil.ignore_patterns("__pycache__"))
    a = K._cache_dir(str(src), str(tmp_path / "cache"))
    assert a == K._cache_dir(str(src), str(tmp_path / "cache")) and os.path.isdir(a)
    with open(src / "attention" / "rows.py", "a") as f:  # a kernel in a subfolder
        f.write("\n# edited\n")
    b = K._cache_dir(str(src), str(tmp_path / "cache"))
    assert b != a and os.path.isdir(b)
    (src / "newfolder").mkdir()  # and a new file in a new subfolder
    (src / "newfolder" / "rows.py").write_text("X = 1\n")
    c = K._cache_dir(str(src), str(tmp_path / "cache"))
    (src / "newfolder" / "rows.py").write_text("X = 2\n")
    assert len({a, b, c, K._cache_dir(str(src), str(tmp_path / "cache"))}) == 4
    if not os.environ.get("NUMBA_CACHE_DIR"):
        import numba

        assert numba.config.CACHE_DIR == K._cache_dir()
