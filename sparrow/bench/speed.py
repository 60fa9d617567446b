"""Speed benchmark: sparrow beside llama.cpp (llama-cpp-python) on the same GGUF and threads.

`sparrow bench speed [--model PATH | --shape qwen3-1.7b --type q8_0] [--contexts 512,2048,7000]
[--compare llama-cpp] [--contention]`

One random prompt of max(contexts) token ids is prefilled in chunks of 512 (llama.cpp:
n_batch 512); at each context C the prefill time so far is the prefill of a C-token prompt,
then --decode tokens are decoded one at a time (fixed token feed, no sampling; both engines
compute the last row's logits) and the cache is rewound to C. sparrow decodes exact, sparse
top-k (k=--sparse-k), each with the f32 KV cache and with f16 and int8 copies of it (re-encoded
as appending would). llama.cpp runs with its bindings' defaults (f16 KV, flash attention off,
OpenMP's default spin-wait: no OMP_WAIT_POLICY is set); only the thread count is set, equal for
both engines. Engines alternate within each round (order flipped every round) so load drift hits
both; per-token times are medians within a round, results medians over rounds, ratios the
median of per-round sparrow/llama ratios. Start-up (cold: empty numba cache; warm) and peak
RSS are measured in fresh subprocesses. The header names the CPU and its vector extensions and
the load average at start and end (a warning when the machine is busy at the start).

Decode as users meet it: for each context, a fresh random prompt of that length goes through
`LLM.stream` (prefill, then --decode tokens), then the same prompt again, which the prefix cache
serves; exact and sparse. The runner rows above rewind one cache and so never show a difference
between a freshly prefilled context and a reused one; these rows do (--no-stream skips them).

Roofline: the machine's read bandwidth is measured first (sparrow.bench.bandwidth: a sum over a
buffer far larger than the last-level cache, on the bench's threads), and every decode cell
gives the bytes a token reads (weights from the file's tensor table, KV rows by mode) and the
share of that bandwidth reached, for both engines.

--shape NAME --type q8_0|q4_0|q4_k_m benches a random-weight GGUF with a real model's exact tensor shapes
(sparrow.bench.shapes; written once into the cache directory). --contention adds a separately
labelled row: decode after the first context while one busy-looping process competes for the CPUs.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from sparrow.bench import bandwidth
from sparrow.engine.runner import PREFILL_CHUNK as CHUNK  # llama.cpp's n_batch matches sparrow's chunk
from sparrow.params import SELECTORS

MB = 1 << 20
# decode modes: (KV cache dtype, sparse top-k?, activations); the q8 ones with --activations q8
MODES = {
    "exact": ("f32", False, "f32"),
    "sparse": ("f32", True, "f32"),
    "f16": ("f16", False, "f32"),
    "sparse_f16": ("f16", True, "f32"),
    "int8": ("int8", False, "f32"),
    "sparse_int8": ("int8", True, "f32"),
    "q8_f16": ("f16", False, "q8"),
    "sparse_q8_f16": ("f16", True, "q8"),
}
LABELS = {
    "exact": "exact, f32 KV",
    "sparse": "sparse k={k}, f32 KV",
    "f16": "exact, f16 KV",
    "sparse_f16": "sparse k={k}, f16 KV",
    "int8": "exact, int8 KV",
    "sparse_int8": "sparse k={k}, int8 KV",
    "q8_f16": "exact, f16 KV, q8 activations",
    "sparse_q8_f16": "sparse k={k}, f16 KV, q8 activations",
}


def _load_avg():
    return round(os.getloadavg()[0], 2)


def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak; Linux: KiB


def _rss_now_mb():
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return None


# vector extensions worth naming (x86 /proc/cpuinfo "flags", ARM "Features"; asimddp = dotprod)
_EXTENSIONS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx512vbmi",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "asimdhp",
    "i8mm",
    "bf16",
    "sve",
    "sve2",
)


def cpu_info() -> dict:
    """CPU model, vector extensions, CPU count and L2 size per core, from /proc/cpuinfo and sysfs."""
    import platform

    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                fields.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    model = (
        fields.get("model name")
        or fields.get("Model")
        or fields.get("Hardware")
        or platform.processor()
        or platform.machine()
    )
    if "model name" not in fields and "CPU part" in fields:  # ARM: implementer/part ids
        model = f"{model} (implementer {fields.get('CPU implementer')}, part {fields['CPU part']})"
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    l2 = None
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
            l2 = f.read().strip()
    except OSError:
        pass
    return {
        "model": model,
        "extensions": [e for e in _EXTENSIONS if e in flags],
        "cpus": os.cpu_count(),
        "l2_per_core": l2,
        "machine": platform.machine(),
    }


def cpu_busy(interval=1.0) -> float | None:
    """Fraction of all CPUs' time spent busy (not idle/iowait) over `interval` s, from /proc/stat."""

    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)

    try:
        t0, i0 = sample()
        time.sleep(interval)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return round(1 - (i1 - i0) / max(1, t1 - t0), 3)


def busy_threshold(cpus=None) -> float:
    """1-minute load above which the machine counts as busy: a quarter of a CPU each, at least 0.5."""
    return max(0.5, 0.25 * (cpus or os.cpu_count() or 1))


def _versions(compare) -> dict:
    from sparrow import __version__

    out = {"sparrow": __version__, "numpy": np.__version__}
    try:
        import numba

        out["numba"] = numba.__version__
    except ImportError:
        pass
    if compare:
        import llama_cpp

        out["llama_cpp_python"] = llama_cpp.__version__
        try:
            info = llama_cpp.llama_print_system_info()
            out["llama_cpp_system_info"] = (info.decode() if isinstance(info, bytes) else str(info)).strip()
        except Exception:  # noqa: BLE001 - informational only
            pass
    return out


SPLIT_STEPS = 4  # staged steps timed stage by stage after each fused measurement


class SparrowRunner:
    name = "sparrow"

    def __init__(self, path, threads, capacity, select="seed"):
        from sparrow.api import load

        self.select = select  # the block selector of the sparse modes
        self.llm = load(path, threads=threads)
        self.model = self.llm.model
        self.cache = self.model.new_cache(capacity, "f32")
        self.cache_q8 = None  # the q8 mode's prefill rows write here (prefill(act="q8"))
        self.capacity = capacity

    def prefill(self, tokens, start, act="f32"):
        """Prefills tokens at positions start.. (the cache is rewound to start first); act
        "q8" times the q8 mode's prefill into a cache of its own, so the decode rows keep
        starting from the exact one."""
        from sparrow.engine.runner import Slot

        if act == "q8" and self.cache_q8 is None:
            self.cache_q8 = self.model.new_cache(self.capacity, "f32")
        cache = self.cache_q8 if act == "q8" else self.cache
        cache.truncate(start)
        # positions below start are in the cache already; the slot only needs their count
        prompt = np.concatenate([np.zeros(start, np.int64), np.asarray(tokens, np.int64)])  # [start + T]
        self.model.activations = act
        try:
            t0 = time.perf_counter()
            self.llm.runner.prefill(Slot(prompt, cache))
            return time.perf_counter() - t0
        finally:
            self.model.activations = "f32"

    def _copy(self, n, kv_dtype):
        if kv_dtype == "f32":
            return self.cache
        c = self.model.new_cache(self.capacity, kv_dtype)
        for i, src in enumerate(self.cache.layers):
            c.append(i, 0, src.k[:, :n].transpose(1, 0, 2), src.v[:, :n].transpose(1, 0, 2))  # [n, KVH, D]
            c.sparse[i].importance[:n] = self.cache.sparse[i].importance[:n]
        c.length = n
        return c

    def decode(self, feed, start, mode="exact", sparse_k=32):
        """Per-token seconds of len(feed) decode steps after start (the path users get: the
        fused step where the model allows it), then the time split (ms) of SPLIT_STEPS more
        steps on the staged path, whose stages can be timed (the fused step is one call)."""
        from sparrow.engine.runner import Slot
        from sparrow.models.timing import timed
        from sparrow.params import SparseParams

        kv_dtype, sparse, act = MODES[mode]
        cache = self._copy(start, kv_dtype)
        sp = SparseParams(k=sparse_k, select=self.select) if sparse else None
        slot = Slot(np.zeros(start, np.int64), cache, sp)
        times, parts = [], []
        self.model.activations = act
        try:
            for tok in feed:
                t0 = time.perf_counter()
                self.llm.runner.decode([slot], [tok])
                times.append(time.perf_counter() - t0)
        finally:
            self.model.activations = "f32"
        cache.truncate(start)
        for tok in feed[:SPLIT_STEPS]:
            with timed(self.model) as timer:
                self.llm.runner.decode([slot], [tok])
            parts.append((timer.total, timer.matmul, timer.attn, timer.total - timer.matmul - timer.attn))
        self.cache.truncate(start)
        # medians per component, like the per-token time (a one-off stall does not count)
        split = {
            k: statistics.median(p[j] for p in parts) * 1e3
            for j, k in enumerate(("staged_ms", "matmul_ms", "attention_ms", "other_ms"))
        }
        split["fused"] = self.model.fused_step() is not None
        kv = {
            "kv_bytes_per_token": cache.nbytes / cache.capacity,
            "probe_copy_bytes_per_token": cache.probe_nbytes / cache.capacity,
        }
        return times, split, kv

    def stream(self, ids, n_decode, sparse_k=None):
        """One request through LLM.stream, as users and the server meet decode: prefill of the
        prompt (from the prefix cache where LLM.stream's entry covers it), then n_decode tokens.
        Returns {"prefill_s", "ms" (median decode step), "end_ms" (from the last token to the
        stream's end), "loop_tok_s" (tokens after the first over the time from the first token to
        the end), "cached_tokens"} and what the machine did during the decode steps (minor page
        faults, involuntary context switches, CPU time stolen by the hypervisor), which tell an
        environmental slowdown from the engine's."""
        from sparrow.params import SamplingParams, SparseParams

        sp = SparseParams(k=sparse_k, select=self.select) if sparse_k else None
        params = SamplingParams(max_tokens=n_decode + 1, temperature=0.0, ignore_eos=True)
        times, first, cached, before, after = [], None, 0, None, None
        t0 = time.perf_counter()
        for out in self.llm.stream([int(t) for t in ids], sampling=params, sparse=sp):
            t1 = time.perf_counter()
            if first is None:
                first, cached, before = t1 - t0, out.cached_tokens or 0, _machine_counters()
            else:
                times.append(t1 - t0)
                after = _machine_counters()  # at the last token: not the prefix-cache insert that ends a stream
            t0 = time.perf_counter()
        end = time.perf_counter() - t0  # from the last token to the stream's end (LLM.stream's prefix-cache insert)
        return {
            "prefill_s": first,
            "ms": statistics.median(times) * 1e3,
            "end_ms": end * 1e3,
            "loop_tok_s": len(times) / (sum(times) + end),  # what a loop over the stream sees after its first token
            "cached_tokens": cached,
            "during_decode": {k: after[k] - before[k] for k in after},
        }


def _machine_counters() -> dict:
    """This process's minor faults and involuntary switches, and the machine's stolen CPU ticks."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {"minor_faults": ru.ru_minflt, "involuntary_switches": ru.ru_nivcsw, "steal_ticks": 0}
    try:
        with open("/proc/stat") as f:
            v = f.readline().split()
        out["steal_ticks"] = int(v[8]) if len(v) > 8 else 0
    except (OSError, ValueError):
        pass
    return out


class LlamaRunner:
    name = "llama.cpp"

    def __init__(self, path, threads, capacity, flash_attn=False):
        from llama_cpp import Llama

        # the bindings' defaults except the thread count (their default is cpu_count // 2 for
        # decode); n_batch 512 is their default too. flash attention only when asked for.
        kw = {"flash_attn": True} if flash_attn else {}
        self.llm = Llama(
            model_path=path,
            n_ctx=capacity,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=CHUNK,
            logits_all=False,
            verbose=False,
            **kw,
        )
        self.settings = self.describe(self.llm)

    @staticmethod
    def describe(llm) -> dict:
        """The context settings llama.cpp actually runs with (flash attention, KV types, batch)."""
        import gguf

        cp = llm.context_params

        def ggml(t):
            try:
                return gguf.GGMLQuantizationType(int(t)).name.lower()
            except ValueError:
                return str(int(t))

        fa = getattr(cp, "flash_attn_type", None)
        if fa is None:
            fa = str(getattr(cp, "flash_attn", "?"))
        else:
            fa = {-1: "auto", 0: "off", 1: "on"}.get(int(fa), str(fa))
        return {
            "flash_attn": fa,
            "type_k": ggml(cp.type_k),
            "type_v": ggml(cp.type_v),
            "n_batch": int(cp.n_batch),
            "n_ubatch": int(cp.n_ubatch),
            "n_threads": int(cp.n_threads),
            "n_threads_batch": int(cp.n_threads_batch),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "unset (OpenMP default)",
        }

    def prefill(self, tokens, start):
        self.llm.n_tokens = start  # eval drops cache entries from n_tokens on
        t0 = time.perf_counter()
        self.llm.eval([int(t) for t in tokens])
        return time.perf_counter() - t0

    def decode(self, feed, start, mode="exact", sparse_k=32):
        self.llm.n_tokens = start
        times = []
        for tok in feed:
            t0 = time.perf_counter()
            self.llm.eval([int(tok)])
            times.append(time.perf_counter() - t0)
        self.llm.n_tokens = start
        return times, None, None


def random_ids(rng, config, n) -> np.ndarray:
    """n random token ids, valid in small test vocabularies too."""
    top = min(40000, config.vocab_size)
    return rng.integers(min(100, top // 2), top, n)


def _pass(runner, prompt, contexts, feed, modes, sparse_k, stream_rng=None):
    """One prefill of the prompt, decoding at each context; {C: measurements}. With stream_rng
    (sparrow only), each context also gets the STREAM_ROWS: a fresh random prompt of C tokens
    through LLM.stream, then the same prompt again (from the prefix cache), exact and sparse."""
    out, pos, pre, pre_q8 = {}, 0, 0.0, 0.0
    q8 = any(MODES[m][2] == "q8" for m in modes)
    for c in contexts:
        pre += runner.prefill(prompt[pos:c], pos)
        rec = {"prefill_s": pre, "load_prefill": _load_avg()}
        if q8:
            pre_q8 += runner.prefill(prompt[pos:c], pos, "q8")
            rec["prefill_q8_s"] = pre_q8
        pos = c
        for mode in modes:
            times, split, kv = runner.decode(feed, c, mode, sparse_k)
            rec[mode] = {"ms": statistics.median(times) * 1e3, "split": split, "kv": kv, "load": _load_avg()}
        if stream_rng is not None:
            for sparse in (False, True):
                ids = random_ids(stream_rng, runner.model.config, c)
                k = sparse_k if sparse else None
                name = "sparse" if sparse else "exact"
                rec[f"stream_{name}_fresh"] = runner.stream(ids, len(feed), k)
                rec[f"stream_{name}_cached"] = runner.stream(ids, len(feed), k)
        out[c] = rec
    return out


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


def _startup(path, threads):
    """Child process: load, first forward; prints a JSON line (times in s, RSS in MiB)."""
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    from sparrow.api import load

    llm = load(path, threads=threads)
    t_load = time.perf_counter() - t0
    rss_load, rss_now = _rss_mb(), _rss_now_mb()
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
                "rss_peak_mb": _rss_mb(),
                "rss_after_forward_mb": _rss_now_mb(),
                "rss_model_file_mb": _mapped_mb(os.path.basename(path)),
                "rss_llvm_mb": _mapped_mb("libllvmlite.so"),
            }
        )
    )


def _llama_rss(path, threads):
    from llama_cpp import Llama

    rss0 = _rss_mb()
    Llama(model_path=path, n_ctx=512, n_threads=threads, verbose=False)
    print(json.dumps({"rss_python_mb": rss0, "rss_loaded_mb": _rss_mb()}))


def _child(args, env=None):
    r = subprocess.run(
        [sys.executable, "-m", "sparrow.bench.speed"] + args, capture_output=True, text=True, env=env, timeout=1200
    )
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _startup_runs(path, threads, compare):
    res = {"load_before": _load_avg()}
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d)
        base = ["--_child", "startup", "--threads", str(threads), "--model", path]
        res["cold"] = _child(base, env)
        res["warm"] = _child(base, env)
    if compare:
        res["llama"] = _child(["--_child", "llama_rss", "--threads", str(threads), "--model", path])
    res["load_after"] = _load_avg()
    return res


def _median(xs):
    return statistics.median(xs) if xs else None


def summarise(rounds, contexts, modes, compare):
    """Medians over rounds: prefill tok/s, decode tok/s per mode, paired ratios."""
    table = {}
    for c in contexts:
        s_runs = [r["sparrow"][c] for r in rounds]
        row = {"prefill_tok_s": _median([c / r["prefill_s"] for r in s_runs])}
        if "prefill_q8_s" in s_runs[0]:
            row["prefill_q8_tok_s"] = _median([c / r["prefill_q8_s"] for r in s_runs])
        for m in modes:
            row[f"decode_{m}_tok_s"] = _median([1e3 / r[m]["ms"] for r in s_runs])
            row[f"split_{m}"] = {k: _median([r[m]["split"][k] for r in s_runs]) for k in s_runs[0][m]["split"]}
            row[f"kv_bytes_per_token_{m}"] = s_runs[0][m]["kv"]["kv_bytes_per_token"]
            row[f"copy_bytes_per_position_{m}"] = s_runs[0][m]["kv"]["probe_copy_bytes_per_token"]
        if "sparse" in modes:
            row["probe_copy_bytes_per_token"] = s_runs[0]["sparse"]["kv"]["probe_copy_bytes_per_token"]
        for name in STREAM_ROWS:
            if name in s_runs[0]:
                row[f"{name}_tok_s"] = _median([1e3 / r[name]["ms"] for r in s_runs])
                row[f"{name}_cached_tokens"] = min(r[name]["cached_tokens"] for r in s_runs)
                row[f"{name}_loop_tok_s"] = _median([r[name]["loop_tok_s"] for r in s_runs])
                row[f"{name}_end_ms"] = _median([r[name]["end_ms"] for r in s_runs])
        for name in ("exact", "sparse"):
            if f"stream_{name}_fresh" in s_runs[0]:
                row[f"stream_{name}_fresh_vs_cached"] = _median(
                    [r[f"stream_{name}_cached"]["ms"] / r[f"stream_{name}_fresh"]["ms"] for r in s_runs]
                )
        if "int8" in modes:
            row["int8_vs_f32"] = _median([r["exact"]["ms"] / r["int8"]["ms"] for r in s_runs])
        if compare:
            l_runs = [r["llama"][c] for r in rounds]
            row["llama_prefill_tok_s"] = _median([c / r["prefill_s"] for r in l_runs])
            row["llama_decode_tok_s"] = _median([1e3 / r["exact"]["ms"] for r in l_runs])
            row["ratio_prefill"] = _median([lr["prefill_s"] / sr["prefill_s"] for sr, lr in zip(s_runs, l_runs)])
            if "prefill_q8_tok_s" in row:
                pairs = zip(s_runs, l_runs)
                row["ratio_prefill_q8"] = _median([lr["prefill_s"] / sr["prefill_q8_s"] for sr, lr in pairs])
            for m in modes:
                row[f"ratio_decode_{m}"] = _median([lr["exact"]["ms"] / sr[m]["ms"] for sr, lr in zip(s_runs, l_runs)])
        table[c] = row
    return table


STREAM_ROWS = ("stream_exact_fresh", "stream_exact_cached", "stream_sparse_fresh", "stream_sparse_cached")


def roofline(table, config, weights, gb_s, sparse_k, select, llama_kv="f16"):
    """Adds to each row the bytes a decode token reads (weights + KV, MB) and the fraction of the
    measured read bandwidth reached, per sparrow decode mode and for llama.cpp (f16 KV, all
    positions). Rows stay as they were when the weights' bytes are unknown."""
    from sparrow.params import SparseParams

    if not weights:
        return
    sp = SparseParams(k=sparse_k, select=select)
    for c, row in table.items():
        for m in MODES:
            tok_s = row.get(f"decode_{m}_tok_s")
            if tok_s is None:
                continue
            kv_dtype, sparse, _ = MODES[m]
            copy = row.get(f"copy_bytes_per_position_{m}", 0.0) if sparse else 0.0
            total = weights + bandwidth.kv_read_bytes(config, c, kv_dtype, sp if sparse else None, copy)
            row[f"read_mb_{m}"] = total / 1e6
            row[f"bandwidth_{m}"] = bandwidth.fraction(total, tok_s, gb_s)
        if row.get("llama_decode_tok_s"):
            total = weights + bandwidth.kv_read_bytes(config, c, llama_kv)
            row["llama_read_mb"] = total / 1e6
            row["llama_bandwidth"] = bandwidth.fraction(total, row["llama_decode_tok_s"], gb_s)


_BUSY_LOOP = "while True: pass"


def contention(runners, context, feed, rounds, sparse_k):
    """Decode after `context` tokens (exact, f32 KV for sparrow) while one busy-looping process runs.

    The caches hold at least `context` prefilled tokens (after the main rounds); engines alternate
    as in the main rounds. Returns per-round medians (ms/token) and the paired ratio.
    """
    busy = subprocess.Popen([sys.executable, "-c", _BUSY_LOOP])
    out = {"context": context, "busy_processes": 1, "load_start": _load_avg(), "rounds": []}
    try:
        time.sleep(1.0)  # let the busy process get going
        for i in range(rounds):
            res = {}
            for r in runners if i % 2 == 0 else runners[::-1]:
                if r.name == "sparrow":
                    r.cache.truncate(context)
                times, _, _ = r.decode(feed, context, "exact", sparse_k)
                res["sparrow" if r.name == "sparrow" else "llama"] = statistics.median(times) * 1e3
            out["rounds"].append(res)
    finally:
        busy.kill()
        busy.wait()
    out["load_end"] = _load_avg()
    out["sparrow_tok_s"] = _median([1e3 / r["sparrow"] for r in out["rounds"]])
    if all("llama" in r for r in out["rounds"]):
        out["llama_tok_s"] = _median([1e3 / r["llama"] for r in out["rounds"]])
        out["ratio"] = _median([r["llama"] / r["sparrow"] for r in out["rounds"]])
    return out


def header(rec) -> list[str]:
    """Markdown lines above the table: model, CPU, versions, settings, load averages, warning."""
    cfg, cpu, ver = rec["config"], rec.get("cpu") or {}, rec.get("versions") or {}
    model = os.path.basename(cfg["model"])
    if cfg.get("shape"):
        model += f" (random weights, {cfg['shape']} shapes, {cfg['type']})"
    ext = ", ".join(cpu.get("extensions") or []) or "none detected"
    l2 = f", L2 {cpu['l2_per_core']} per core" if cpu.get("l2_per_core") else ""
    lines = [
        f"Model `{model}`, {cfg['threads']} threads each, {cfg['rounds']} rounds, "
        f"{cfg['decode']} decode tokens per point.",
        "",
        f"CPU: {cpu.get('model', '?')} ({cpu.get('cpus', os.cpu_count())} CPUs{l2}); vector extensions: {ext}.",
        "",
        f"Load average (1 min): {rec['load_start']} at start, {rec.get('load_end', '-')} at end"
        + (" (1/5/15 min at start: {}/{}/{})".format(*rec["loadavg_start"]) if rec.get("loadavg_start") else "")
        + (
            f"; CPUs {rec['cpu_busy_start']:.0%} busy in the second before the start."
            if rec.get("cpu_busy_start") is not None
            else "."
        ),
    ]
    if rec.get("busy_warning"):
        lines += ["", f"**Warning: {rec['busy_warning']}**"]
    engines = f"sparrow {ver.get('sparrow', '?')} (numba {ver.get('numba', '?')})"
    ls = rec.get("llama_settings")
    if cfg["compare"] and ls:
        engines += (
            f"; llama.cpp via llama-cpp-python {ver.get('llama_cpp_python', '?')} at its defaults: "
            f"flash attention {ls['flash_attn']}, {ls['type_k']}/{ls['type_v']} KV, n_batch "
            f"{ls['n_batch']}, OMP_WAIT_POLICY {ls['omp_wait_policy']}"
        )
        if ver.get("llama_cpp_system_info"):
            engines += f" (build: `{ver['llama_cpp_system_info']}`)"
    lines += ["", f"Engines: {engines}.", ""]
    bw = rec.get("bandwidth")
    if bw:
        weights = rec.get("weight_bytes")
        lines += [
            f"Read bandwidth: {bw['gb_s']:.1f} GB/s (a sum over {bw['buffer_mib']:.0f} MiB on {bw['threads']} "
            f"threads, best of {bw['passes']}). A decode token reads "
            + (f"{weights / 1e6:.0f} MB of weights" if weights else "weights of unknown size")
            + " plus its KV rows; each decode cell gives those bytes and the share of the bandwidth they reach.",
            "",
        ]
    return lines


def _roof(mb, frac) -> str:
    """' (X MB read a token, Y% of the read bandwidth)' for a decode cell, '' when unknown."""
    return "" if mb is None or frac is None else f" ({mb:.4g} MB/token, {frac:.0%} of bandwidth)"


def markdown(rec):
    t, cmp = rec["table"], rec["config"]["compare"]
    f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = header(rec) + [
        "| context | metric | sparrow | llama.cpp (exact) | sparrow / llama.cpp |",
        "|---|---|---|---|---|",
    ]
    for c, row in t.items():
        lines.append(
            f"| {c} | prefill tok/s | {f(row['prefill_tok_s'])} | {f(row.get('llama_prefill_tok_s'))} "
            f"| {f(row.get('ratio_prefill'), 2)} |"
        )
        if "prefill_q8_tok_s" in row:
            lines.append(
                f"| {c} | prefill tok/s, q8 activations | {f(row['prefill_q8_tok_s'])} | "
                f"{f(row.get('llama_prefill_tok_s'))} | {f(row.get('ratio_prefill_q8'), 2)} |"
            )
        for m in MODES:
            label = "decode tok/s, " + LABELS[m].format(k=rec["config"]["sparse_k"])
            if rec["config"].get("sparse_select", "seed") != "seed":
                label = label.replace("sparse k=", f"sparse {rec['config']['sparse_select']} k=")
            if f"decode_{m}_tok_s" in row:
                llama = f(row.get("llama_decode_tok_s")) + _roof(row.get("llama_read_mb"), row.get("llama_bandwidth"))
                mine = f(row[f"decode_{m}_tok_s"]) + _roof(row.get(f"read_mb_{m}"), row.get(f"bandwidth_{m}"))
                lines.append(
                    f"| {c} | {label} | {mine} | {llama if cmp else '-'} | {f(row.get(f'ratio_decode_{m}'), 2)} |"
                )
        for name in ("exact", "sparse"):
            if f"stream_{name}_fresh_tok_s" in row:
                cfg = rec["config"]
                what = "exact" if name == "exact" else f"sparse {cfg.get('sparse_select', 'seed')} k={cfg['sparse_k']}"
                lines.append(
                    f"| {c} | decode tok/s through LLM.stream, {what}, f32 KV: fresh prompt / same prompt again "
                    f"({row[f'stream_{name}_cached_cached_tokens']} tokens from the prefix cache) | "
                    f"{f(row[f'stream_{name}_fresh_tok_s'])} / {f(row[f'stream_{name}_cached_tok_s'])} "
                    f"(fresh = {f(row[f'stream_{name}_fresh_vs_cached'], 2)}x cached) | | |"
                )
                lines.append(
                    f"| {c} | the same, as a loop over the stream sees it (to the stream's end): tok/s, and ms "
                    f"from the last token to the end, fresh / again | {f(row[f'stream_{name}_fresh_loop_tok_s'])} / "
                    f"{f(row[f'stream_{name}_cached_loop_tok_s'])}; {f(row[f'stream_{name}_fresh_end_ms'], 0)} / "
                    f"{f(row[f'stream_{name}_cached_end_ms'], 0)} ms | | |"
                )
        sp = row["split_exact"]
        lines.append(
            f"| {c} | exact decode ms/token, staged path (timed by stage): matmul / attention / other | "
            f"{f(sp['matmul_ms'])} / {f(sp['attention_ms'])} / {f(sp['other_ms'])} | | |"
        )
        if "int8_vs_f32" in row:
            lines.append(
                f"| {c} | int8 KV speed vs f32 KV; KV bytes/token int8 / f32 | "
                f"{f(row['int8_vs_f32'], 2)}x; {row['kv_bytes_per_token_int8']:.0f} / "
                f"{row['kv_bytes_per_token_exact']:.0f} | | |"
            )
        if row.get("probe_copy_bytes_per_token"):
            lines.append(
                f"| {c} | sparse probe-key copy, bytes/token (f32 KV) | {row['probe_copy_bytes_per_token']:.0f} | | |"
            )
    st = rec.get("startup") or {}
    for k in ("cold", "warm"):
        s = st.get(k, {})
        if "load_s" in s:
            lines.append(
                f"| start | {k} numba cache: load / first prefill / first token (s) | "
                f"{s['load_s']:.1f} / {s['first_prefill_s']:.1f} / {s['first_decode_s']:.1f} | | |"
            )
    w, lw = st.get("warm", {}), st.get("llama", {})
    if "rss_loaded_mb" in w:
        lines.append(
            f"| memory | peak RSS MiB: python+imports -> loaded (GGUF {rec['gguf_mb']:.0f} MiB) | "
            f"{w['rss_python_mb']:.0f} -> {w['rss_loaded_mb']:.0f} | "
            f"{f(lw.get('rss_python_mb'), 0)} -> {f(lw.get('rss_loaded_mb'), 0)} | |"
        )
        if w.get("rss_now_mb"):
            lines.append(f"| memory | RSS MiB after load (not peak) | {w['rss_now_mb']:.0f} | | |")
        if w.get("rss_after_forward_mb"):
            lines.append(
                f"| memory | RSS MiB after the first forward: total / model file pages / LLVM code | "
                f"{w['rss_after_forward_mb']:.0f} / {f(w.get('rss_model_file_mb'), 0)} / "
                f"{f(w.get('rss_llvm_mb'), 0)} | | |"
            )
    ct = rec.get("contention")
    if ct:
        lines.append(
            f"| {ct['context']} | CONTENTION (one busy-looping process running; load "
            f"{ct['load_start']} -> {ct['load_end']}): decode tok/s, exact, f32 KV | "
            f"{f(ct.get('sparrow_tok_s'))} | {f(ct.get('llama_tok_s'))} | {f(ct.get('ratio'), 2)} |"
        )
    return "\n".join(lines)


def _moe_rows(threads):
    try:
        from sparrow.bench import speed_moe
    except ImportError:
        return None
    return speed_moe.run(threads=threads)


def main(argv=None):
    from sparrow.bench import shapes

    ap = argparse.ArgumentParser(prog="sparrow bench speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF or HF folder (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument(
        "--shape",
        choices=list(shapes.SHAPES),
        help="bench a random-weight GGUF with this model's exact tensor shapes (written once "
        "into the cache directory, sparrow.bench.shapes)",
    )
    ap.add_argument("--type", default="q8_0", choices=shapes.TYPES, help="weight type of the --shape file")
    ap.add_argument("--contexts", default="512,2048,7000")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", choices=["llama-cpp"], help="also measure llama.cpp (llama-cpp-python)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--decode", type=int, default=16, help="decoded tokens per context and mode")
    ap.add_argument("--sparse-k", type=int, default=32)
    ap.add_argument("--sparse-select", choices=SELECTORS, default="seed", help="block selector of the sparse rows")
    ap.add_argument(
        "--flash-attn", action="store_true", help="turn llama.cpp's flash attention on (the bindings' default is off)"
    )
    ap.add_argument(
        "--contention",
        action="store_true",
        help="add a labelled row: decode after the first context with one busy-looping process running",
    )
    ap.add_argument("--no-startup", action="store_true", help="skip cold/warm start and RSS")
    ap.add_argument(
        "--no-stream",
        action="store_true",
        help="skip the rows through LLM.stream (per context a fresh prompt, then the same one from the prefix cache)",
    )
    ap.add_argument(
        "--activations",
        default="f32",
        choices=["f32", "q8"],
        help="q8: add prefill and decode rows with 8-bit activations (the named non-exact mode)",
    )
    ap.add_argument("--moe", action="store_true", help="add the MoE layer row (sparrow.bench.speed_moe)")
    ap.add_argument("--json", help="write the JSON record here (default runs/speed-<timestamp>/speed.json)")
    ap.add_argument("--md", help="write the markdown table here")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._child == "startup":
        return _startup(a.model, a.threads)
    if a._child == "llama_rss":
        return _llama_rss(a.model, a.threads)
    if a.shape and shapes.SHAPES[a.shape].get("vision"):  # an image model: its own rows (speed_vl.py)
        from sparrow.bench import speed_vl

        return speed_vl.main(a)

    from sparrow.errors import SparrowError
    from sparrow.eval import report
    from sparrow.loaders import default_model_path

    load_start = _load_avg()  # before anything of ours runs
    cpu = cpu_info()
    limit = busy_threshold(cpu["cpus"])
    busy_now = cpu_busy()  # the load average lags by a minute or more; this is the last second
    busy_warning = None
    now = f", CPUs {busy_now:.0%} busy in the last second" if busy_now is not None else ""
    if (busy_now or 0) > 0.25 or (load_start > limit and busy_now is None):
        busy_warning = (
            f"the machine was busy at the start (1-minute load {load_start}, warning above {limit} "
            f"for {cpu['cpus']} CPUs{now}): figures are unreliable, compare only within this run"
        )
    elif load_start > limit:
        busy_warning = (
            f"1-minute load {load_start} at the start is above {limit} for {cpu['cpus']} CPUs{now}: "
            "the average may still be decaying from earlier work; check the per-round loads"
        )
    if busy_warning:
        print(f"warning: {busy_warning}", file=sys.stderr)
    if a.shape and a.model:
        raise SparrowError("give --model or --shape, not both")
    contexts = sorted(int(c) for c in a.contexts.split(","))
    if a.shape:
        path = shapes.ensure(a.shape, a.type)
    else:
        path = a.model or default_model_path()
    out = report.record_path("speed", a.json)
    compare = a.compare == "llama-cpp"
    if compare:
        # llama.cpp as its users run it: OpenMP's default (spin-)wait, no OMP_WAIT_POLICY set here
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama-cpp-python is not importable: measuring sparrow only", file=sys.stderr)
            compare = False
    rec = {
        "load_start": load_start,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "cpu_busy_start": busy_now,
        "busy_warning": busy_warning,
        "busy_threshold": limit,
        "cpu": cpu,
        "versions": _versions(compare),
        "gguf_mb": os.path.getsize(path) / MB if os.path.isfile(path) else None,
        "config": {
            "model": path,
            "shape": a.shape,
            "type": a.type if a.shape else None,
            "threads": a.threads,
            "contexts": contexts,
            "rounds": a.rounds,
            "decode": a.decode,
            "sparse_k": a.sparse_k,
            "sparse_select": a.sparse_select,
            "compare": compare,
            "flash_attn": a.flash_attn,
            "chunk": CHUNK,
            "contention": a.contention,
            "activations": a.activations,
            "stream": not a.no_stream,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        },
    }
    rec["startup"] = None if a.no_startup else _startup_runs(path, a.threads, compare)
    capacity = contexts[-1] + a.decode + 16
    modes = tuple(m for m in MODES if a.activations == "q8" or MODES[m][2] == "f32")
    runners = [SparrowRunner(path, a.threads, capacity, a.sparse_select)]
    rng = np.random.default_rng(0)
    prompt = random_ids(rng, runners[0].model.config, contexts[-1]).tolist()
    feed = random_ids(rng, runners[0].model.config, a.decode).tolist()
    if compare:
        runners.append(LlamaRunner(path, a.threads, capacity, a.flash_attn))
        rec["llama_settings"] = runners[-1].settings
    for r in runners:  # warm-up: JIT load / compile, page in the weights
        r.prefill(prompt[:64], 0)
        if r.name == "sparrow" and a.activations == "q8":  # its prefill kernels too (AMX tiles:
            r.prefill(prompt[:64], 0, "q8")  # compiling them once made a first round 29 s, not 5)
        for m in modes if r.name == "sparrow" else ("exact",):
            r.decode(feed[:2], 64, m, a.sparse_k)
    rec["bandwidth"] = bandwidth.read_bandwidth(a.threads)
    rec["weight_bytes"] = bandwidth.weight_bytes(path)
    stream_rng = None if a.no_stream else np.random.default_rng(1)  # prompts no other row uses
    rounds = []
    for i in range(a.rounds):
        res = {}
        for r in runners if i % 2 == 0 else runners[::-1]:
            mine = r.name == "sparrow"
            ms = modes if mine else ("exact",)
            res["sparrow" if mine else "llama"] = _pass(
                r, prompt, contexts, feed, ms, a.sparse_k, stream_rng if mine else None
            )
            print(f"round {i + 1}: {r.name} done (load {_load_avg()})", file=sys.stderr)
        rounds.append(res)
    rec["rounds"] = rounds
    rec["table"] = summarise(rounds, contexts, modes, compare)
    config = runners[0].model.config
    roofline(rec["table"], config, rec["weight_bytes"], rec["bandwidth"]["gb_s"], a.sparse_k, a.sparse_select)
    rec["load_end"] = _load_avg()
    report.write_json(out, rec)  # the record first: nothing optional below can lose it
    if a.moe:
        try:
            rec["moe"] = _moe_rows(a.threads)
        except Exception as e:  # noqa: BLE001 - the optional row costs only itself
            print(f"MoE row skipped ({type(e).__name__}: {e})", file=sys.stderr)
            rec["moe"] = None
        rec["load_end"] = _load_avg()
        report.write_json(out, rec)
    if a.contention:
        try:
            rec["contention"] = contention(runners, contexts[0], feed, a.rounds, a.sparse_k)
            print(f"contention row done (load {_load_avg()})", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - the optional row costs only itself
            print(f"contention row skipped ({type(e).__name__}: {e})", file=sys.stderr)
            rec["contention"] = None
        report.write_json(out, rec)  # load_end stays that of the main rounds; the row has its own
    md = markdown(rec)
    print(md)
    if rec.get("moe"):
        print("\nMoE layer (sparrow.bench.speed_moe):")
        for row in rec["moe"]:
            print("  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    print(f"wrote {out}", file=sys.stderr)
    if a.md:
        with open(a.md, "w") as fh:
            fh.write(md + "\n")
    return rec


if __name__ == "__main__":
    main()
