"""Long-context benchmark: time to first token, decode (exact and sparse with both selectors) and
resident memory at 8K-32K beside llama.cpp with flash attention off and on; decode further out
(64K, 128K) on a synthesised cache; with --sparse-prefill, the time to first token of a sparse
prefill too.

`sparrow bench long-context [--model PATH | --shape qwen3-0.6b --type q8_0] [--kv f16]
[--contexts 8192,16384,32768] [--synth 65536,131072] [--compare llama-cpp] [--sparse-prefill v2]`

One KV kind per run (--kv): the cache is made in that kind and prefilled into directly, so a
run holds one cache, never an f32 original beside its f16 and int8 copies (what `bench speed`
does, which is why it stops fitting in memory near 32K). Each engine runs in a child process
of its own, so its resident memory is its own: sparrow, llama.cpp with flash attention off
(its Python bindings' default) and llama.cpp with flash attention on (the default of its CLI
and server on CPU). They take turns: at each context every engine prefills the random prompt
from the previous context to this one in 512-token chunks (the sum so far is the prefill of a
C-token prompt, i.e. the time to first token), then --rounds rounds of decoding --decode fixed
tokens (no sampling; the cache is rewound after each mode) alternate between the engines,
their order flipped every round. sparrow decodes exact, then sparse top-k with the `seed` and
the `v2` selectors. Ratios are medians of per-round pairs, against llama.cpp's faster setting
in that round.

--sparse-prefill SELECTOR adds one more sparrow child with a cache of its own (same KV kind)
that prefills the same chunks with that selector's block-sparse attention (each prefill query
attends its k selected blocks of its causal prefix, SparseParams.prefill) and then decodes
sparse with the same selector only, as a request with sparse_prefill does. Its time to first
token is reported beside the others, with its ratio to sparrow's exact prefill and to
llama.cpp's faster setting at that context (flash attention off or on, whichever prefilled
faster).

--synth contexts are past what a 2-core prefill allows: sparrow alone (llama.cpp cannot be
handed a comparable state) decodes over a cache of that length filled with random values of
the KV kind and random prefill importance. Decode speed does not depend on the values; the
table labels these rows as synthesised.

Memory: each child reports its peak resident set per context (VmHWM, reset before each phase).
sparrow's is checked against a stated bound: the resident set after loading and warming up
(weights paged in, kernels compiled) plus the KV cache at its capacity (storage and prefill
importance) plus the side copies of the selectors it decodes with (both for the main child,
seed's probe keys and v2's block summaries; the sparse-prefill child's own selector's) plus a
fixed allowance for a prefill chunk's work buffers (WORK_MIB). The table prints each part.
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from sparrow.engine.runner import PREFILL_CHUNK as CHUNK
from sparrow_lab.bench import bandwidth
from sparrow_lab.bench.host import (
    MB,
    busy_threshold,
    cpu_busy,
    cpu_info,
    llama_cpp_importable,
    load_avg,
    reset_peak,
    status_mib,
    versions,
)

WORK_MIB = 256  # prefill chunk work buffers (scores, activations) the bound allows beyond the cache
SELECTORS_DEFAULT = "seed,v2,v3-p0.95"  # sparse decode modes beside exact (SparseParams labels)
LLAMA = {"llama_off": False, "llama_on": True}  # child role -> flash attention
SPARSE_PREFILL = "sparrow_sp"  # child role: sparse prefill, then decode with the same selector


def sparrow_modes(prefill_select: str | None, selectors: str = SELECTORS_DEFAULT) -> tuple:
    """The decode modes of a sparrow child: exact and each selector label after an exact
    prefill, or the sparse prefill's own selector alone (what both the child and the parent's
    handle on it use)."""
    if prefill_select is not None:
        return (prefill_select,)
    return ("exact", *(x.strip() for x in selectors.split(",") if x.strip()))


def memory() -> dict:
    """This process's resident set now and at its peak since the last reset_peak(), MiB."""
    return {"rss_mib": status_mib("VmRSS"), "peak_mib": status_mib("VmHWM")}


# ---------------------------------------------------------------------------------------------
# the engines, each in its own child process


class SparrowEngine:
    """sparrow's runner over one cache of the chosen KV kind."""

    def __init__(self, path, threads, kv, sparse_k, prefill_select=None, activations="f32", selectors=None):
        """prefill_select: None prefills exact and decodes in every mode; a selector prefills
        sparse with it and decodes with it alone. activations: "f32", "q8", or "auto" for the
        mode the file loads in unless told (models/activations.py)."""
        from sparrow.api import load
        from sparrow.params import SparseParams

        self.llm = load(path, threads=threads, activations=None if activations == "auto" else activations)
        self.model = self.llm.model
        self.kv = kv
        self.modes = sparrow_modes(prefill_select, selectors or SELECTORS_DEFAULT)
        if prefill_select is None:
            self.sparse = {m: SparseParams.from_label(m, k=sparse_k) for m in self.modes if m != "exact"}
            self.prefill_sparse = None
        else:
            self.prefill_sparse = SparseParams(k=sparse_k, select=prefill_select, prefill=True)
            self.sparse = {prefill_select: self.prefill_sparse}
        self.cache = None
        self.prompt = self.feed = None

    def start(self, length, n_decode):
        """Makes the random prompt and decode feed, warms up every mode on a small cache (kernels
        compiled, weights paged in), then allocates the cache: capacity length + n_decode."""
        from sparrow_lab.bench.engines import random_ids

        rng = np.random.default_rng(0)
        self.prompt = random_ids(rng, self.model.config, length).astype(np.int64)
        self.feed = random_ids(rng, self.model.config, n_decode).tolist()
        warm = min(length, 2 * CHUNK)
        self.cache = self.model.new_cache(warm + n_decode, self.kv)
        self.prefill(0, warm)
        for m in self.modes:
            self.decode(warm, m, 2)
        self._allocate(length + n_decode)
        return {
            "prompt": self.prompt.tolist(),
            "feed": self.feed,
            "activations": self.model.activations,
            **self.memory(),
        }

    def _allocate(self, capacity):
        self.cache = None
        gc.collect()
        self.base = memory()["rss_mib"]  # weights paged in, kernels compiled, no cache
        self.cache = self.model.new_cache(capacity, self.kv)
        reset_peak()

    def memory(self):
        """Resident memory now and at its peak, beside the bound and its parts."""
        c = self.cache
        side = {m: c.bytes_at(c.capacity, sp.copy_key) - c.bytes_at(c.capacity) for m, sp in self.sparse.items()}
        kv = c.bytes_at(c.capacity) / MB
        bound = self.base + kv + sum(side.values()) / MB + WORK_MIB
        mem = memory()
        return {
            **mem,
            "base_mib": self.base,
            "kv_mib": kv,
            "side_mib": {m: b / MB for m, b in side.items()},
            "work_mib": WORK_MIB,
            "bound_mib": bound,
            "within_bound": mem["peak_mib"] is not None and mem["peak_mib"] <= bound,
            "capacity": c.capacity,
        }

    def prefill(self, start, end):
        """Seconds to prefill prompt[start:end] after `start` cached positions."""
        from sparrow.engine.runner import Slot

        self.cache.truncate(start)
        t0 = time.perf_counter()
        self.llm.runner.prefill(Slot(self.prompt[:end], self.cache, self.prefill_sparse))
        return {"s": time.perf_counter() - t0}

    def decode(self, start, mode, n=None):
        """Per-token seconds of decoding the feed after `start` positions; the cache is rewound."""
        from sparrow.engine.runner import Slot

        slot = Slot(np.zeros(start, np.int64), self.cache, self.sparse.get(mode))
        mark = self.cache.draft_mark()  # a recurrent state returns to start with its copy (K/V: truncate)
        times = []
        for tok in self.feed[: n or len(self.feed)]:
            t0 = time.perf_counter()
            self.llm.runner.decode([slot], [tok])
            times.append(time.perf_counter() - t0)
        self.cache.drop_draft(mark)
        self.cache.truncate(start)
        return {"times": times}

    def synth(self, length, n_decode):
        """A fresh cache of `length` positions filled with random values of the KV kind and random
        prefill importance, as if prefilled; the selectors' side copies are built by one warm-up
        step per mode (they are filled on first use, as after a real prefill)."""
        self._allocate(length + n_decode)
        fill_random(self.cache, length)
        for m in self.modes:
            self.decode(length, m, 1)
        return self.memory()


def fill_random(cache, length: int) -> None:
    """Fills positions 0..length-1 of cache with random values of its KV kind and random prefill
    importance, as if prefilled (decode speed does not depend on the values), and sets its length."""
    rng = np.random.default_rng(length)
    for layer, st in zip(cache.layers, cache.sparse):
        for arr in (layer.k, layer.v):
            for h in range(arr.shape[0]):  # one head at a time: no full-size temporary
                if arr.dtype == np.int8:
                    arr[h, :length] = rng.integers(-127, 128, (length, arr.shape[2]), dtype=np.int8)
                else:
                    x = rng.standard_normal((length, arr.shape[2]), dtype=np.float32)
                    arr[h, :length] = x.astype(np.float16).view(np.uint16) if arr.dtype == np.uint16 else x
        if layer.scaled:
            layer.k_scale[:, :length] = rng.uniform(0.01, 0.05, (layer.k_scale.shape[0], length))
            layer.v_scale[:, :length] = rng.uniform(0.01, 0.05, (layer.v_scale.shape[0], length))
        st.importance[:length] = rng.exponential(1.0, length)
    for part in cache.state_parts:  # a hybrid model's recurrent state (Qwen3.5): small values
        arr = getattr(cache, part)
        arr[:] = rng.uniform(-0.05, 0.05, arr.shape).astype(np.float32)
    cache.length = length


class LlamaEngine:
    """llama.cpp through llama-cpp-python at its defaults but the thread count and, when asked,
    flash attention."""

    def __init__(self, path, threads, flash_attn):
        self.path, self.threads, self.flash_attn = path, threads, flash_attn
        self.llm = None

    def start(self, prompt, feed):
        from llama_cpp import Llama

        from sparrow_lab.bench.engines import LlamaRunner

        self.prompt, self.feed = prompt, feed
        self.llm = Llama(
            model_path=self.path,
            n_ctx=len(prompt) + len(feed),
            n_threads=self.threads,
            n_threads_batch=self.threads,
            n_batch=CHUNK,
            flash_attn=self.flash_attn,
            verbose=False,
        )
        self.llm.eval(prompt[:64])  # warm-up: page in the weights
        self.llm.n_tokens = 0
        reset_peak()
        return {"settings": LlamaRunner.describe(self.llm), **memory()}

    def prefill(self, start, end):
        self.llm.n_tokens = start  # eval drops cache entries from n_tokens on
        t0 = time.perf_counter()
        self.llm.eval(self.prompt[start:end])
        return {"s": time.perf_counter() - t0}

    def decode(self, start, mode="exact", n=None):
        # A recurrent model's memory (qwen35) cannot drop positions: the context is saved
        # before the timed steps and loaded back after them (outside the timing)
        recurrent = self.llm.metadata.get("general.architecture") in ("qwen35", "qwen35moe")
        saved = self.llm.save_state() if recurrent else None
        self.llm.n_tokens = start
        times = []
        for tok in self.feed[: n or len(self.feed)]:
            t0 = time.perf_counter()
            self.llm.eval([tok])
            times.append(time.perf_counter() - t0)
        if saved is not None:
            self.llm.load_state(saved)
        self.llm.n_tokens = start
        return {"times": times}

    def memory(self):
        return memory()


def _child_main(a) -> None:
    """A child's loop: one JSON request a line on stdin, one JSON reply a line on the stdout it
    was started with (everything else the engine prints goes to stderr)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if a._child in ("sparrow", SPARSE_PREFILL):
        select = a.sparse_prefill if a._child == SPARSE_PREFILL else None
        engine = SparrowEngine(a.path, a.threads, a.kv, a.sparse_k, select, a.activations, a.selectors)
    else:
        engine = LlamaEngine(a.path, a.threads, LLAMA[a._child])
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            reply = getattr(engine, msg.pop("op"))(**msg)
        except Exception as e:  # noqa: BLE001 - the parent reports it and stops
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")


class Child:
    """The parent's handle on one engine process."""

    def __init__(self, role, path, a):
        cmd = [sys.executable, "-m", "sparrow_lab.bench.long_context", "--_child", role, "--path", path]
        cmd += ["--threads", str(a.threads), "--kv", a.kv, "--sparse-k", str(a.sparse_k)]
        cmd += ["--activations", a.activations, "--selectors", a.selectors]
        if role == SPARSE_PREFILL:
            cmd += ["--sparse-prefill", a.sparse_prefill]
        self.role = role
        select = a.sparse_prefill if role == SPARSE_PREFILL else None
        self.modes = ("exact",) if role in LLAMA else sparrow_modes(select, a.selectors)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, op, **kw):
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.role} process ended (exit code {self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.role}: {reply['error']}")
        return reply

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


# ---------------------------------------------------------------------------------------------
# the parent: turns, medians, the table


def _decode_rounds(children, context, rounds):
    """{role: {mode: [median ms per round]}}, engines alternating, order flipped each round."""
    out = {c.role: {m: [] for m in c.modes} for c in children}
    for i in range(rounds):
        for c in children if i % 2 == 0 else children[::-1]:
            for m in c.modes:
                times = c.ask("decode", start=context, mode=m)["times"]
                out[c.role][m].append(statistics.median(times) * 1e3)
        print(f"  {context}: decode round {i + 1} done (load {load_avg()})", file=sys.stderr)
    return out


def _summary(ms):
    """tok/s (median over rounds) per role and mode, and each sparrow mode's median per-round
    ratio to llama.cpp's faster setting in that round."""
    tok = {role: {m: 1e3 / statistics.median(v) for m, v in modes.items()} for role, modes in ms.items()}
    return tok, _ratios(ms, "sparrow")


def _ratios(ms, role):
    """{mode: median per-round ratio of `role`'s decode to llama.cpp's faster setting}; empty
    without llama.cpp."""
    llamas = [r for r in ms if r in LLAMA]
    if not llamas:
        return {}
    best = [min(ms[r]["exact"][i] for r in llamas) for i in range(len(ms["sparrow"]["exact"]))]
    return {m: statistics.median(b / s for b, s in zip(best, v)) for m, v in ms[role].items()}


def _ttft_ratios(ttft):
    """The sparse-prefill child's time to first token against sparrow's exact prefill and
    llama.cpp's faster setting (above 1: the sparse prefill is faster)."""
    sp = ttft[SPARSE_PREFILL]
    llamas = [ttft[r] for r in LLAMA if r in ttft]
    return {"vs_exact": ttft["sparrow"] / sp, "vs_llama": min(llamas) / sp if llamas else None}


def _contexts(text: str, what: str) -> list[int]:
    """--contexts / --synth: positive token counts, ascending; empty gives none."""
    from sparrow.errors import SparrowError
    from sparrow_lab.bench.needle import _ints

    vals = sorted(_ints(text, what)) if text.strip() else []
    if vals and vals[0] < 1:
        raise SparrowError(f"--{what} takes positive token counts, got {text!r}")
    return vals


def run(a) -> dict:
    from sparrow.loaders import default_model_path
    from sparrow_lab.bench import shapes
    from sparrow_lab.eval import report

    path = shapes.ensure(a.shape, a.type) if a.shape else (a.model or default_model_path())
    contexts, synth = _contexts(a.contexts, "contexts"), _contexts(a.synth, "synth")
    load_start, busy = load_avg(), cpu_busy()
    cpu = cpu_info()
    compare = a.compare == "llama-cpp" and llama_cpp_importable()
    rec = {
        "load_start": load_start,
        "cpu_busy_start": busy,
        "busy": (busy or 0) > 0.25 or load_start > busy_threshold(cpu["cpus"]),
        "cpu": cpu,
        "versions": versions(compare),
        "file_mib": os.path.getsize(path) / MB if os.path.isfile(path) else None,
        "config": {
            "model": path,
            "shape": a.shape,
            "type": a.type if a.shape else None,
            "kv": a.kv,
            "threads": a.threads,
            "contexts": contexts,
            "synth": synth,
            "rounds": a.rounds,
            "decode": a.decode,
            "sparse_k": a.sparse_k,
            "activations": a.activations,
            "activations_asked": a.activations,
            "compare": compare,
            "sparse_prefill": a.sparse_prefill,
        },
        "contexts": {},
        "synth": {},
    }
    if rec["busy"]:
        print(f"warning: the machine is busy (load {load_start}): figures are unreliable", file=sys.stderr)
    sparrow = Child("sparrow", path, a)
    children = [sparrow]
    try:
        # the prompt, the feed and the warm-up (a synthesised-only run still warms up on a short prompt)
        start = sparrow.ask("start", length=contexts[-1] if contexts else 2 * CHUNK, n_decode=a.decode)
        prompt, feed = start.pop("prompt"), start.pop("feed")
        rec["sparrow_start"] = start
        rec["config"]["activations"] = start.pop("activations")  # what "auto" chose
        if contexts:
            if a.sparse_prefill:
                c = Child(SPARSE_PREFILL, path, a)
                children.append(c)
                sp_start = c.ask("start", length=contexts[-1], n_decode=a.decode)
                if sp_start.pop("prompt") != prompt or sp_start.pop("feed") != feed:
                    raise RuntimeError("the sparse-prefill child made another prompt than the sparrow child")
                rec["sparse_prefill_start"] = sp_start
            if compare:
                for role in LLAMA:
                    c = Child(role, path, a)
                    children.append(c)
                    rec.setdefault("llama_settings", {})[role] = c.ask("start", prompt=prompt, feed=feed)["settings"]
            rec["bandwidth"] = bandwidth.read_bandwidth(a.threads)
            rec["weight_bytes"] = bandwidth.weight_bytes(path)
            prefill = {c.role: 0.0 for c in children}
            pos = 0
            for i, ctx in enumerate(contexts):
                row = {"load_start": load_avg()}
                for c in children if i % 2 == 0 else children[::-1]:
                    prefill[c.role] += c.ask("prefill", start=pos, end=ctx)["s"]
                    print(f"  {ctx}: {c.role} prefilled (load {load_avg()})", file=sys.stderr)
                row["ttft_s"] = dict(prefill)
                ms = _decode_rounds(children, ctx, a.rounds)
                row["decode_ms"] = ms
                row["tok_s"], row["ratio"] = _summary(ms)
                if a.sparse_prefill:
                    row["ratio_sparse_prefill"] = _ratios(ms, SPARSE_PREFILL)
                    row["ttft_ratio_sparse_prefill"] = _ttft_ratios(row["ttft_s"])
                row["memory"] = {c.role: c.ask("memory") for c in children}
                row["load_end"] = load_avg()
                rec["contexts"][ctx] = row
                pos = ctx
                report.write_json(a.out, rec)
        for c in children[1:]:
            c.close()  # their caches are not needed past here
        children = [sparrow]
        for ctx in synth:
            row = {"load_start": load_avg(), "synthesised": True}
            mem = sparrow.ask("synth", length=ctx, n_decode=a.decode)
            ms = _decode_rounds([sparrow], ctx, a.rounds)
            row["decode_ms"] = ms
            row["tok_s"], _ = _summary(ms)
            row["memory"] = {"sparrow": sparrow.ask("memory"), "after_fill": mem}
            row["load_end"] = load_avg()
            rec["synth"][ctx] = row
            report.write_json(a.out, rec)
    finally:
        for c in children:
            c.close()
    rec["load_end"] = load_avg()
    report.write_json(a.out, rec)
    return rec


def markdown(rec) -> str:
    cfg, cpu = rec["config"], rec["cpu"]
    f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    model = os.path.basename(cfg["model"])
    if cfg.get("shape"):
        model += f" (random weights, {cfg['shape']} shapes, {cfg['type']})"
    k = cfg["sparse_k"]

    def name(mode):
        return "exact" if mode == "exact" else f"sparse {mode} k={k}"

    sp_sel = cfg.get("sparse_prefill")
    act = cfg.get("activations", "f32") + (" (the file's default)" if cfg.get("activations_asked") == "auto" else "")
    lines = [
        f"Model `{model}`, {cfg['kv']} KV, sparrow with {act} activations, "
        f"{cfg['threads']} threads each, {cfg['rounds']} decode rounds of "
        f"{cfg['decode']} tokens.",
        "",
        f"CPU: {cpu.get('model', '?')} ({cpu.get('cpus')} CPUs). Load average (1 min): {rec['load_start']} at start, "
        f"{rec.get('load_end', '-')} at end." + (" **Busy at the start: figures unreliable.**" if rec["busy"] else ""),
        "",
    ]
    ls = rec.get("llama_settings")
    if ls:
        lines += [
            "llama.cpp (llama-cpp-python "
            + str(rec["versions"].get("llama_cpp_python", "?"))
            + "): "
            + "; ".join(
                f"{'FA on' if LLAMA[r] else 'FA off'}: flash attention {s['flash_attn']}, "
                f"{s['type_k']}/{s['type_v']} KV"
                for r, s in ls.items()
            )
            + ". Ratios: sparrow over llama.cpp's faster setting in each round (median of rounds).",
            "",
        ]
    lines += [
        "| context | engine, mode | time to first token s (prefill tok/s) | decode tok/s | vs llama.cpp | "
        "peak RSS MiB |",
        "|---|---|---|---|---|---|",
    ]
    for ctx, row in rec["contexts"].items():
        for role, modes in row["tok_s"].items():
            mem = row["memory"][role]
            ttft = row["ttft_s"][role]
            for m, v in modes.items():
                if role == "sparrow":
                    eng, ratio = "sparrow, " + name(m), f(row["ratio"].get(m), 2)
                elif role == SPARSE_PREFILL:
                    eng = f"sparrow, sparse prefill {m} k={k}, then {name(m)}"
                    ratio = f(row["ratio_sparse_prefill"].get(m), 2)
                else:
                    eng, ratio = f"llama.cpp, FA {'on' if LLAMA[role] else 'off'}", ""
                lines.append(
                    f"| {ctx} | {eng} | {ttft:.1f} ({int(ctx) / ttft:.0f}) | {f(v)} | {ratio} | "
                    f"{f(mem['peak_mib'], 0)} |"
                )
    for ctx, row in rec["synth"].items():
        mem = row["memory"]["sparrow"]
        for m, v in row["tok_s"]["sparrow"].items():
            lines.append(
                f"| {ctx} (synthesised cache) | sparrow, {name(m)} | - | {f(v)} | - | {f(mem['peak_mib'], 0)} |"
            )
    if sp_sel and rec["contexts"]:
        lines += [
            "",
            f"Time to first token with sparse prefill ({sp_sel} k={k}) against exact prefill; ratios above 1: "
            "the sparse prefill is faster.",
            "",
            "| context | sparrow exact s | sparrow sparse prefill s | vs sparrow exact | llama.cpp faster s | "
            "vs llama.cpp |",
            "|---|---|---|---|---|---|",
        ]
        for ctx, row in rec["contexts"].items():
            t, r = row["ttft_s"], row["ttft_ratio_sparse_prefill"]
            llamas = [t[x] for x in LLAMA if x in t]
            lines.append(
                f"| {ctx} | {t['sparrow']:.2f} | {t[SPARSE_PREFILL]:.2f} | {f(r['vs_exact'], 2)}x | "
                f"{f(min(llamas) if llamas else None, 2)} | {f(r['vs_llama'], 2)}{'x' if r['vs_llama'] else ''} |"
            )
    lines += [
        "",
        "sparrow's resident memory against its bound (MiB): peak = base + KV + side copies + work allowance",
        "",
    ]
    lines += [
        "| context | peak | bound | base (weights, code) | KV | side copies | within |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, rows in (("", rec["contexts"]), (" (synth)", rec["synth"])):
        for ctx, row in rows.items():
            for role, tag in (("sparrow", ""), (SPARSE_PREFILL, f", sparse prefill {sp_sel}")):
                m = row["memory"].get(role)
                if m is None:
                    continue
                side = m["side_mib"]
                lines.append(
                    f"| {ctx}{label}{tag} | {f(m['peak_mib'], 0)} | {f(m['bound_mib'], 0)} | {f(m['base_mib'], 0)} | "
                    f"{f(m['kv_mib'], 0)} | {', '.join(f'{sel} {f(v, 0)}' for sel, v in side.items())} | "
                    f"{'yes' if m['within_bound'] else 'NO'} |"
                )
    return "\n".join(lines)


def main(argv=None):
    from sparrow.params import KV_DTYPES, SELECTORS
    from sparrow_lab.bench import shapes

    ap = argparse.ArgumentParser(prog="sparrow bench long-context", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF or HF folder (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--shape", choices=[s for s in shapes.SHAPES if not shapes.image_bench(s, None)])
    ap.add_argument("--type", default="q8_0", choices=shapes.TYPES, help="weight type of the --shape file")
    ap.add_argument("--kv", default="f16", choices=KV_DTYPES, help="the KV kind of this run")
    ap.add_argument("--contexts", default="8192,16384,32768", help="prefilled contexts, comma-separated")
    ap.add_argument("--synth", default="", help="decode-only contexts on a synthesised cache (sparrow alone)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", choices=["llama-cpp"], help="also measure llama.cpp, flash attention off and on")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", type=int, default=16, help="decoded tokens per context, mode and round")
    ap.add_argument("--sparse-k", type=int, default=32)
    ap.add_argument(
        "--selectors",
        default=SELECTORS_DEFAULT,
        help="sparse decode modes timed beside exact, comma-separated selector labels (seed, v2, v2-dense0, v3, "
        "v3-p0.95, ...)",
    )
    ap.add_argument(
        "--activations",
        default="f32",
        choices=["f32", "q8", "auto"],
        help="sparrow's activations: f32 (exact, the default here), q8, or auto (the mode the file loads in)",
    )
    ap.add_argument(
        "--sparse-prefill",
        choices=SELECTORS,
        help="also time a sparse prefill with this selector (its own process and cache), then its sparse decode",
    )
    ap.add_argument("--json", help="write the JSON record here (default runs/long-context-<timestamp>/...)")
    ap.add_argument("--md", help="write the markdown table here")
    ap.add_argument("--_child", choices=["sparrow", SPARSE_PREFILL, *LLAMA], help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._child:
        return _child_main(a)
    from sparrow.errors import SparrowError
    from sparrow_lab.eval import report

    if a.shape and a.model:
        raise SparrowError("give --model or --shape, not both")
    a.out = report.record_path("long-context", a.json)
    rec = run(a)
    md = markdown(rec)
    print(md)
    print(f"wrote {a.out}", file=sys.stderr)
    if a.md:
        with open(a.md, "w") as fh:
            fh.write(md + "\n")
    return rec


if __name__ == "__main__":
    main()
