"""Start-up of both engines measured in fresh subprocesses: cold (empty numba cache) and warm
load-to-first-token time, peak resident memory."""

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from sparrow_lab.bench.host import load_avg, rss_now_mb, rss_peak_mb


def _mapped_mb(*names):
    """Resident MiB of file mappings whose path ends with one of names (from smaps)."""
    total, cur = 0, None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                parts = line.split()
                if parts and "-" in parts[0] and not parts[0].endswith(":"):
                    cur = parts[5] if len(parts) > 5 else ""
                elif parts and parts[0] == "Rss:" and cur and cur.endswith(names):
                    total += int(parts[1])
    except OSError:
        return None
    return total / 1024


def startup_child(path, threads):
    """Child process: load, first forward; prints a JSON line (times in s, RSS in MiB)."""
    rss0 = rss_peak_mb()
    t0 = time.perf_counter()
    from sparrow.api import load

    llm = load(path, threads=threads)
    t_load = time.perf_counter() - t0
    rss_load, rss_now = rss_peak_mb(), rss_now_mb()
    slot = llm.runner.new_slot(np.arange(100, 116), 64)
    llm.runner.prefill(slot)
    t_prefill = time.perf_counter() - t0
    llm.runner.decode([slot], [5])
    t_first = time.perf_counter() - t0
    # where the resident set goes: the model file's mapped pages, LLVM's code (numba links
    # the cached kernels with it) and everything else
    print(
        json.dumps(
            {
                "load_s": t_load,
                "first_prefill_s": t_prefill,
                "first_decode_s": t_first,
                "rss_python_mb": rss0,
                "rss_loaded_mb": rss_load,
                "rss_now_mb": rss_now,
                "rss_peak_mb": rss_peak_mb(),
                "rss_after_forward_mb": rss_now_mb(),
                "rss_model_file_mb": _mapped_mb(os.path.basename(path)),
                "rss_llvm_mb": _mapped_mb("libllvmlite.so"),
            }
        )
    )


def llama_rss(path, threads):
    from llama_cpp import Llama

    rss0 = rss_peak_mb()
    Llama(model_path=path, n_ctx=512, n_threads=threads, verbose=False)
    print(json.dumps({"rss_python_mb": rss0, "rss_loaded_mb": rss_peak_mb()}))


def _child(args, env=None):
    r = subprocess.run(
        [sys.executable, "-m", "sparrow_lab.bench.speed"] + args, capture_output=True, text=True, env=env, timeout=1200
    )
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def startup_runs(path, threads, compare):
    res = {"load_before": load_avg()}
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d)
        base = ["--_child", "startup", "--threads", str(threads), "--model", path]
        res["cold"] = _child(base, env)
        res["warm"] = _child(base, env)
    if compare:
        res["llama"] = _child(["--_child", "llama_rss", "--threads", str(threads), "--model", path])
    res["load_after"] = load_avg()
    return res
