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

Roofline: the machine's read bandwidth is measured first (sparrow_lab.bench.bandwidth: a sum over a
buffer far larger than the last-level cache, on the bench's threads), and every decode cell
gives the bytes a token reads (weights from the file's tensor table, KV rows by mode) and the
share of that bandwidth reached, for both engines.

--shape NAME --type q8_0|q4_0|q4_k_m benches a random-weight GGUF with a real model's exact tensor shapes
(sparrow_lab.bench.shapes; written once into the cache directory).

Memory: both engines run in this one process. llama.cpp's CPU repack buffer copies every matrix it
has interleaved kernels for (q4_0, q4_k, ...; the stacked experts too) into memory of its own at
load, while sparrow reads the file mapping: on qwen3-30b-a3b Q4_K_M that is ~15 GB of copies beside
an 18.6 GB file, more than a 24 GB machine holds, and the file's pages sparrow reads would be
evicted and read again from disk. --llama-no-repack makes llama.cpp read its mapping too (the same
page cache); the settings line says which ran. --contention adds a separately
labelled row: decode after the first context while one busy-looping process competes for the CPUs.

This bench holds an f32 cache and its f16 and int8 copies at once; past ~16K on the Qwen3 shapes
use `sparrow bench long-context` (one KV kind per run, each engine in its own process).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from sparrow.engine.runner import PREFILL_CHUNK as CHUNK  # llama.cpp's n_batch matches sparrow's chunk
from sparrow.kernels import cpu as kernel_cpu
from sparrow.params import SELECTORS
from sparrow_lab.bench import bandwidth
from sparrow_lab.bench.engines import MODES, LlamaRunner, SparrowRunner, random_ids, run_pass
from sparrow_lab.bench.host import (
    MB,
    busy_threshold,
    cpu_busy,
    cpu_info,
    llama_cpp_importable,
    load_avg,
    versions,
)
from sparrow_lab.bench.speed_report import markdown, median, roofline, summarise
from sparrow_lab.bench.startup import llama_rss, startup_child, startup_runs

_BUSY_LOOP = "while True: pass"


def contention(runners, context, feed, rounds, sparse_k):
    """Decode after `context` tokens (exact, f32 KV for sparrow) while one busy-looping process runs.

    The caches hold at least `context` prefilled tokens (after the main rounds); engines alternate
    as in the main rounds. Returns per-round medians (ms/token) and the paired ratio.
    """
    busy = subprocess.Popen([sys.executable, "-c", _BUSY_LOOP])
    out = {"context": context, "busy_processes": 1, "load_start": load_avg(), "rounds": []}
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
    out["load_end"] = load_avg()
    out["sparrow_tok_s"] = median([1e3 / r["sparrow"] for r in out["rounds"]])
    if all("llama" in r for r in out["rounds"]):
        out["llama_tok_s"] = median([1e3 / r["llama"] for r in out["rounds"]])
        out["ratio"] = median([r["llama"] / r["sparrow"] for r in out["rounds"]])
    return out


def _moe_rows(threads):
    try:
        from sparrow_lab.bench import speed_moe
    except ImportError:
        return None
    return speed_moe.run(threads=threads)


def main(argv=None):
    from sparrow_lab.bench import shapes

    ap = argparse.ArgumentParser(prog="sparrow bench speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF or HF folder (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument(
        "--shape",
        choices=list(shapes.SHAPES),
        help="bench a random-weight GGUF with this model's exact tensor shapes (written once "
        "into the cache directory, sparrow_lab.bench.shapes)",
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
        "--llama-no-repack",
        action="store_true",
        help="turn llama.cpp's CPU repack buffer off: it reads the weights from its file mapping instead of a "
        "copy it makes at load (needed where file + copy + sparrow's mapping exceed the RAM: qwen3-30b-a3b on 24 GB)",
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
    ap.add_argument("--moe", action="store_true", help="add the MoE layer row (sparrow_lab.bench.speed_moe)")
    ap.add_argument(
        "--images",
        help="square image sides, e.g. 448,1024: bench a --shape with a vision tower on images "
        "(sparrow_lab.bench.speed_vl; qwen3-vl-2b always, at 448 unless given)",
    )
    ap.add_argument("--json", help="write the JSON record here (default runs/speed-<timestamp>/speed.json)")
    ap.add_argument("--md", help="write the markdown table here")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._child == "startup":
        return startup_child(a.model, a.threads)
    if a._child == "llama_rss":
        return llama_rss(a.model, a.threads)
    if a.shape and shapes.image_bench(a.shape, a.images):  # images through the vision tower (speed_vl.py)
        from sparrow_lab.bench import speed_vl

        return speed_vl.main(a)

    from sparrow.errors import SparrowError
    from sparrow.loaders import default_model_path
    from sparrow_lab.eval import report

    load_start = load_avg()  # before anything of ours runs
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
    # llama.cpp as its users run it: OpenMP's default (spin-)wait, no OMP_WAIT_POLICY set here
    compare = a.compare == "llama-cpp" and llama_cpp_importable()
    rec = {
        "load_start": load_start,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "cpu_busy_start": busy_now,
        "busy_warning": busy_warning,
        "busy_threshold": limit,
        "cpu": cpu,
        "paths": kernel_cpu.describe(),
        "versions": versions(compare),
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
            "llama_repack": not a.llama_no_repack,
            "chunk": CHUNK,
            "contention": a.contention,
            "activations": a.activations,
            "stream": not a.no_stream,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        },
    }
    rec["startup"] = None if a.no_startup else startup_runs(path, a.threads, compare)
    capacity = contexts[-1] + a.decode + 16
    modes = tuple(m for m in MODES if a.activations == "q8" or MODES[m][2] == "f32")
    runners = [SparrowRunner(path, a.threads, capacity, a.sparse_select)]
    rng = np.random.default_rng(0)
    mode, why = runners[0].default_activations
    rec["default_activations"] = {"mode": mode, "why": why}
    prompt = random_ids(rng, runners[0].model.config, contexts[-1]).tolist()
    feed = random_ids(rng, runners[0].model.config, a.decode).tolist()
    if compare:
        runners.append(LlamaRunner(path, a.threads, capacity, a.flash_attn, repack=not a.llama_no_repack))
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
            res["sparrow" if mine else "llama"] = run_pass(
                r, prompt, contexts, feed, ms, a.sparse_k, stream_rng if mine else None
            )
            print(f"round {i + 1}: {r.name} done (load {load_avg()})", file=sys.stderr)
        rounds.append(res)
    rec["rounds"] = rounds
    rec["table"] = summarise(rounds, contexts, modes, compare)
    config = runners[0].model.config
    roofline(rec["table"], config, rec["weight_bytes"], rec["bandwidth"]["gb_s"], a.sparse_k, a.sparse_select)
    rec["load_end"] = load_avg()
    report.write_json(out, rec)  # the record first: nothing optional below can lose it
    if a.moe:
        try:
            rec["moe"] = _moe_rows(a.threads)
        except Exception as e:  # noqa: BLE001 - the optional row costs only itself
            print(f"MoE row skipped ({type(e).__name__}: {e})", file=sys.stderr)
            rec["moe"] = None
        rec["load_end"] = load_avg()
        report.write_json(out, rec)
    if a.contention:
        try:
            rec["contention"] = contention(runners, contexts[0], feed, a.rounds, a.sparse_k)
            print(f"contention row done (load {load_avg()})", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - the optional row costs only itself
            print(f"contention row skipped ({type(e).__name__}: {e})", file=sys.stderr)
            rec["contention"] = None
        report.write_json(out, rec)  # load_end stays that of the main rounds; the row has its own
    md = markdown(rec)
    print(md)
    if rec.get("moe"):
        print("\nMoE layer (sparrow_lab.bench.speed_moe):")
        for row in rec["moe"]:
            print("  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    print(f"wrote {out}", file=sys.stderr)
    if a.md:
        with open(a.md, "w") as fh:
            fh.write(md + "\n")
    return rec


if __name__ == "__main__":
    main()
