"""Speed benchmark: sparrow beside llama.cpp (llama-cpp-python) on the same GGUF and threads.

`sparrow bench speed [--model PATH] [--contexts 512,2048,7000] [--compare llama-cpp]`

One random prompt of max(contexts) token ids is prefilled in chunks of 512 (llama.cpp:
n_batch 512); at each context C the prefill time so far is the prefill of a C-token prompt,
then --decode tokens are decoded one at a time (fixed token feed, no sampling; both engines
compute the last row's logits) and the cache is rewound to C. sparrow decodes exact, sparse
top-k (k=--sparse-k), each with the f32 KV cache and with f16 and int8 copies of it (re-encoded
as appending would; llama.cpp's default KV is f16). Engines alternate within each round (order flipped every round) so load drift hits
both; per-token times are medians within a round, results medians over rounds, ratios the
median of per-round sparrow/llama ratios. Start-up (cold: empty numba cache; warm) and peak
RSS are measured in fresh subprocesses. Load average is recorded with every measurement.
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

CHUNK = 512
MB = 1 << 20
# decode modes: (KV cache dtype, sparse top-k?)
MODES = {"exact": ("f32", False), "sparse": ("f32", True), "f16": ("f16", False),
         "sparse_f16": ("f16", True), "int8": ("int8", False), "sparse_int8": ("int8", True)}
LABELS = {"exact": "exact, f32 KV", "sparse": "sparse k={k}, f32 KV", "f16": "exact, f16 KV",
          "sparse_f16": "sparse k={k}, f16 KV", "int8": "exact, int8 KV",
          "sparse_int8": "sparse k={k}, int8 KV"}


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


class SparrowRunner:
    name = "sparrow"

    def __init__(self, path, threads, capacity):
        from sparrow.api import load

        self.llm = load(path, threads=threads)
        self.model = self.llm.model
        self.cache = self.model.new_cache(capacity, "f32")
        self.capacity = capacity

    def prefill(self, tokens, start):
        from sparrow.models.decoder import Segment

        t0 = time.perf_counter()
        for a in range(0, len(tokens), CHUNK):
            self.model.forward([Segment(np.asarray(tokens[a:a + CHUNK]), self.cache, start + a)])
        return time.perf_counter() - t0

    def _copy(self, n, kv_dtype):
        if kv_dtype == "f32":
            return self.cache
        c = self.model.new_cache(self.capacity, kv_dtype)
        for src, dst in zip(self.cache.layers, c.layers):
            dst.append(0, src.k[:, :n].transpose(1, 0, 2), src.v[:, :n].transpose(1, 0, 2))
            dst.importance[:n] = src.importance[:n]
        c.length = n
        return c

    def decode(self, feed, start, mode="exact", sparse_k=32):
        """Per-token seconds and the mean time split (ms) for len(feed) steps after start."""
        from sparrow.params import SparseParams
        from sparrow.models.decoder import Segment, Timer

        kv_dtype, sparse = MODES[mode]
        cache = self._copy(start, kv_dtype)
        sp = SparseParams(k=sparse_k) if sparse else None
        times, parts = [], []
        for i, tok in enumerate(feed):
            timer = Timer()
            t0 = time.perf_counter()
            self.model.forward([Segment(np.array([tok]), cache, start + i, sparse=sp, decode=True)],
                               timer=timer)
            times.append(time.perf_counter() - t0)
            parts.append((timer.matmul, timer.attn, timer.total - timer.matmul - timer.attn))
        self.cache.truncate(start)
        # medians per component, like the per-token time (a one-off stall does not count)
        split = {k: statistics.median(p[j] for p in parts) * 1e3
                 for j, k in enumerate(("matmul_ms", "attention_ms", "other_ms"))}
        kv = {"kv_bytes_per_token": cache.nbytes / cache.capacity,
              "probe_copy_bytes_per_token": cache.probe_nbytes / cache.capacity}
        return times, split, kv


class LlamaRunner:
    name = "llama.cpp"

    def __init__(self, path, threads, capacity, flash_attn):
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_ctx=capacity, n_threads=threads,
                         n_threads_batch=threads, n_batch=CHUNK, logits_all=False,
                         flash_attn=flash_attn, verbose=False)

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


def _pass(runner, prompt, contexts, feed, modes, sparse_k):
    """One prefill of the prompt, decoding at each context; {C: measurements}."""
    out, pos, pre = {}, 0, 0.0
    for c in contexts:
        pre += runner.prefill(prompt[pos:c], pos)
        pos = c
        rec = {"prefill_s": pre, "load_prefill": _load_avg()}
        for mode in modes:
            times, split, kv = runner.decode(feed, c, mode, sparse_k)
            rec[mode] = {"ms": statistics.median(times) * 1e3, "split": split, "kv": kv,
                         "load": _load_avg()}
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
    from sparrow.models.decoder import Segment

    llm = load(path, threads=threads)
    t_load = time.perf_counter() - t0
    rss_load, rss_now = _rss_mb(), _rss_now_mb()
    cache = llm.model.new_cache(64, "f32")
    llm.model.forward([Segment(np.arange(100, 116), cache, 0)])
    t_prefill = time.perf_counter() - t0
    llm.model.forward([Segment(np.array([5]), cache, 16, decode=True)])
    t_first = time.perf_counter() - t0
    # where the resident set goes: the model file's mapped pages, LLVM's code (numba links
    # the cached kernels with it) and everything else
    print(json.dumps({"load_s": t_load, "first_prefill_s": t_prefill, "first_decode_s": t_first,
                      "rss_python_mb": rss0, "rss_loaded_mb": rss_load, "rss_now_mb": rss_now,
                      "rss_peak_mb": _rss_mb(), "rss_after_forward_mb": _rss_now_mb(),
                      "rss_model_file_mb": _mapped_mb(os.path.basename(path)),
                      "rss_llvm_mb": _mapped_mb("libllvmlite.so")}))


def _llama_rss(path, threads):
    from llama_cpp import Llama

    rss0 = _rss_mb()
    Llama(model_path=path, n_ctx=512, n_threads=threads, verbose=False)
    print(json.dumps({"rss_python_mb": rss0, "rss_loaded_mb": _rss_mb()}))


def _child(args, env=None):
    r = subprocess.run([sys.executable, "-m", "sparrow.bench.speed"] + args, capture_output=True,
                       text=True, env=env, timeout=1200)
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
        for m in modes:
            row[f"decode_{m}_tok_s"] = _median([1e3 / r[m]["ms"] for r in s_runs])
            row[f"split_{m}"] = {k: _median([r[m]["split"][k] for r in s_runs])
                                 for k in s_runs[0][m]["split"]}
            row[f"kv_bytes_per_token_{m}"] = s_runs[0][m]["kv"]["kv_bytes_per_token"]
        if "sparse" in modes:
            row["probe_copy_bytes_per_token"] = s_runs[0]["sparse"]["kv"]["probe_copy_bytes_per_token"]
        if "int8" in modes:
            row["int8_vs_f32"] = _median([r["exact"]["ms"] / r["int8"]["ms"] for r in s_runs])
        if compare:
            l_runs = [r["llama"][c] for r in rounds]
            row["llama_prefill_tok_s"] = _median([c / r["prefill_s"] for r in l_runs])
            row["llama_decode_tok_s"] = _median([1e3 / r["exact"]["ms"] for r in l_runs])
            row["ratio_prefill"] = _median([lr["prefill_s"] / sr["prefill_s"] for sr, lr in zip(s_runs, l_runs)])
            for m in modes:
                row[f"ratio_decode_{m}"] = _median([lr["exact"]["ms"] / sr[m]["ms"]
                                                    for sr, lr in zip(s_runs, l_runs)])
        table[c] = row
    return table


def markdown(rec):
    t, cmp = rec["table"], rec["config"]["compare"]
    f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [f"Model `{os.path.basename(rec['config']['model'])}`, {rec['config']['threads']} threads, "
             f"{rec['config']['rounds']} rounds, {rec['config']['decode']} decode tokens per point; "
             f"load average {rec['load_start']} at start, {rec['load_end']} at end "
             f"({os.cpu_count()} CPUs). llama.cpp: flash_attn={rec['config']['flash_attn']}, f16 KV, "
             f"OMP_WAIT_POLICY={rec['config']['omp_wait_policy']}.", "",
             "| context | metric | sparrow | llama.cpp | sparrow / llama.cpp |", "|---|---|---|---|---|"]
    for c, row in t.items():
        lines.append(f"| {c} | prefill tok/s | {f(row['prefill_tok_s'])} | {f(row.get('llama_prefill_tok_s'))} "
                     f"| {f(row.get('ratio_prefill'), 2)} |")
        for m in MODES:
            label = "decode tok/s, " + LABELS[m].format(k=rec["config"]["sparse_k"])
            if f"decode_{m}_tok_s" in row:
                lines.append(f"| {c} | {label} | {f(row[f'decode_{m}_tok_s'])} | "
                             f"{f(row.get('llama_decode_tok_s')) if cmp else '-'} | {f(row.get(f'ratio_decode_{m}'), 2)} |")
        sp = row["split_exact"]
        lines.append(f"| {c} | exact decode ms/token: matmul / attention / other | {f(sp['matmul_ms'])} / "
                     f"{f(sp['attention_ms'])} / {f(sp['other_ms'])} | | |")
        if "int8_vs_f32" in row:
            lines.append(f"| {c} | int8 KV speed vs f32 KV; KV bytes/token int8 / f32 | "
                         f"{f(row['int8_vs_f32'], 2)}x; {row['kv_bytes_per_token_int8']:.0f} / "
                         f"{row['kv_bytes_per_token_exact']:.0f} | | |")
        if row.get("probe_copy_bytes_per_token"):
            lines.append(f"| {c} | sparse probe-key copy, bytes/token (f32 KV) | "
                         f"{row['probe_copy_bytes_per_token']:.0f} | | |")
    st = rec.get("startup") or {}
    for k in ("cold", "warm"):
        s = st.get(k, {})
        if "load_s" in s:
            lines.append(f"| start | {k} numba cache: load / first prefill / first token (s) | "
                         f"{s['load_s']:.1f} / {s['first_prefill_s']:.1f} / {s['first_decode_s']:.1f} | | |")
    w, lw = st.get("warm", {}), st.get("llama", {})
    if "rss_loaded_mb" in w:
        lines.append(f"| memory | peak RSS MiB: python+imports -> loaded (GGUF {rec['gguf_mb']:.0f} MiB) | "
                     f"{w['rss_python_mb']:.0f} -> {w['rss_loaded_mb']:.0f} | "
                     f"{f(lw.get('rss_python_mb'), 0)} -> {f(lw.get('rss_loaded_mb'), 0)} | |")
        if w.get("rss_now_mb"):
            lines.append(f"| memory | RSS MiB after load (not peak) | {w['rss_now_mb']:.0f} | | |")
        if w.get("rss_after_forward_mb"):
            lines.append(f"| memory | RSS MiB after the first forward: total / model file pages / LLVM code | "
                         f"{w['rss_after_forward_mb']:.0f} / {f(w.get('rss_model_file_mb'), 0)} / "
                         f"{f(w.get('rss_llvm_mb'), 0)} | | |")
    return "\n".join(lines)


def _moe_rows(threads):
    try:
        from sparrow.bench import speed_moe
    except ImportError:
        return None
    return speed_moe.run(threads=threads)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="sparrow bench speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF or HF folder (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--contexts", default="512,2048,7000")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", choices=["llama-cpp"], help="also measure llama.cpp (llama-cpp-python)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--decode", type=int, default=16, help="decoded tokens per context and mode")
    ap.add_argument("--sparse-k", type=int, default=32)
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp flash attention")
    ap.add_argument("--no-startup", action="store_true", help="skip cold/warm start and RSS")
    ap.add_argument("--moe", action="store_true", help="add the MoE layer row (sparrow.bench.speed_moe)")
    ap.add_argument("--json", help="write the JSON record here")
    ap.add_argument("--md", help="write the markdown table here")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._child == "startup":
        return _startup(a.model, a.threads)
    if a._child == "llama_rss":
        return _llama_rss(a.model, a.threads)

    from sparrow.loaders import default_model_path

    path = a.model or default_model_path()
    contexts = sorted(int(c) for c in a.contexts.split(","))
    compare = a.compare == "llama-cpp"
    if compare:
        # libgomp reads this when llama.cpp loads: spinning OpenMP threads collapse on a
        # shared machine (0.3 tok/s measured), so passive unless the caller chose otherwise
        os.environ.setdefault("OMP_WAIT_POLICY", "passive")
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama-cpp-python is not importable: measuring sparrow only", file=sys.stderr)
            compare = False
    rec = {"load_start": _load_avg(), "gguf_mb": os.path.getsize(path) / MB if os.path.isfile(path) else None,
           "config": {"model": path, "threads": a.threads, "contexts": contexts, "rounds": a.rounds,
                      "decode": a.decode, "sparse_k": a.sparse_k, "compare": compare,
                      "flash_attn": a.flash_attn, "chunk": CHUNK,
                      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}}
    rec["startup"] = None if a.no_startup else _startup_runs(path, a.threads, compare)
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 40000, contexts[-1]).tolist()
    feed = rng.integers(100, 40000, a.decode).tolist()
    capacity = contexts[-1] + a.decode + 16
    modes = tuple(MODES)
    runners = [SparrowRunner(path, a.threads, capacity)]
    if compare:
        runners.append(LlamaRunner(path, a.threads, capacity, a.flash_attn))
    for r in runners:  # warm-up: JIT load / compile, page in the weights
        r.prefill(prompt[:64], 0)
        for m in (modes if r.name == "sparrow" else ("exact",)):
            r.decode(feed[:2], 64, m, a.sparse_k)
    rounds = []
    for i in range(a.rounds):
        res = {}
        for r in (runners if i % 2 == 0 else runners[::-1]):
            ms = modes if r.name == "sparrow" else ("exact",)
            res["sparrow" if r.name == "sparrow" else "llama"] = _pass(r, prompt, contexts, feed, ms, a.sparse_k)
            print(f"round {i + 1}: {r.name} done (load {_load_avg()})", file=sys.stderr)
        rounds.append(res)
    rec["rounds"] = rounds
    rec["table"] = summarise(rounds, contexts, modes, compare)
    if a.moe:
        rec["moe"] = _moe_rows(a.threads)
    rec["load_end"] = _load_avg()
    md = markdown(rec)
    print(md)
    if rec.get("moe"):
        print("\nMoE layer (sparrow.bench.speed_moe):")
        for row in rec["moe"]:
            print("  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rec, fh, indent=1, default=str)
    if a.md:
        with open(a.md, "w") as fh:
            fh.write(md + "\n")
    return rec


if __name__ == "__main__":
    main()
