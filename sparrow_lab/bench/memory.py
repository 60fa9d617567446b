"""Resident memory through one request, against the q8 mode's bound (issue 34 item 4):
`sparrow bench memory [--model PATH | --shape NAME --type T] [--activations auto|f32|q8]
[--kv f16] [--prompt 512] [--decode 16] [--compare llama-cpp]`.

Resident memory is a process's, so each run is a fresh child process: it loads the model, runs
the short warm-up request `sparrow serve` runs before its first (engine/warmup.py, the exact
path), resets the peak (Linux's clear_refs), then prefills a random prompt and decodes through
the runner into a cache of prompt + decode positions. Reported, in MiB (/proc/self/status): the
load's peak and end, the request's peak and the end, what the end holds beside the file and the
KV cache, and the bound file x 1.1 + KV + 150 MiB (the file's pages leave the resident set as
the q8 mode's copies replace them; sparrow.memory.release_memory gives back the heap's free pages and
LLVM's code pages). With --compare llama-cpp, llama.cpp's peak for the same file and context.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from sparrow_lab.bench.host import load_avg, reset_peak, status_mib

MIB = 1 << 20
BOUND_SLACK_MIB = 150  # issue 34 item 4: file + 10% + KV + 150 MB


def child(path, activations, kv, prompt, decode, threads) -> dict:
    """In the measured process: load, warm up, one request; the figures as a dict."""
    from sparrow.api import load
    from sparrow.engine.warmup import warm
    from sparrow_lab.bench.engines import random_ids
    from sparrow_lab.bench.startup import _mapped_mb

    llm = load(path, threads=threads, activations=None if activations == "auto" else activations)
    out = {"load_peak": status_mib("VmHWM"), "load_end": status_mib("VmRSS"), "mode": llm.model.activations}
    r = llm.runner
    warm(r, llm.tokenizer, kv, paths=("exact",))
    out["warm_end"] = status_mib("VmRSS")
    out["peak_reset"] = reset_peak()
    slot = r.new_slot(random_ids(np.random.default_rng(0), llm.model.config, prompt), prompt + decode, kv)
    logits = r.prefill(slot)
    out["prefill_end"] = status_mib("VmRSS")
    for _ in range(decode):
        logits = r.decode([slot], [int(np.argmax(logits))])[0]
    out.update(
        end=status_mib("VmRSS"),
        peak=status_mib("VmHWM"),
        kv=slot.cache.nbytes / MIB,
        file=os.path.getsize(path) / MIB if os.path.isfile(path) else None,
        llvm=_mapped_mb("libllvmlite.so"),
    )
    return out


def _llama_child(path, prompt, decode, threads) -> dict:
    """llama.cpp at its defaults (llama-cpp-python): load, prefill a random prompt, decode."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=prompt + decode, n_threads=threads, verbose=False)
    vocab = llm.n_vocab()
    llm.eval(np.random.default_rng(0).integers(min(100, vocab // 2), min(40000, vocab), prompt).tolist())
    for i in range(decode):  # the tokens fed do not change what is resident
        llm.eval([min(1000 + i, vocab - 1)])
    return {"peak": status_mib("VmHWM"), "end": status_mib("VmRSS")}


def _run_child(kind: str, args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "sparrow_lab.bench.memory", "--_child", kind, *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def table(rec: dict) -> str:
    s, lines = rec["sparrow"], []
    f = lambda v: "-" if v is None else f"{v:,.0f}"  # noqa: E731
    lines.append(
        "| MiB | file | KV | bound (file x 1.1 + KV + 150) | load: peak / end | request: peak / end | end - file - KV |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    bound = s["file"] * 1.1 + s["kv"] + BOUND_SLACK_MIB if s.get("file") else None
    beside = s["end"] - s["file"] - s["kv"] if s.get("file") else None
    lines.append(
        f"| sparrow ({s['mode']}) | {f(s.get('file'))} | {s['kv']:.0f} | {f(bound)} | {f(s['load_peak'])} / "
        f"{f(s['load_end'])} | {f(s['peak'])} / {f(s['end'])} | {f(beside)} |"
    )
    if "llama" in rec:
        lc = rec["llama"]
        if "error" in lc:
            lines.append(f"| llama.cpp | {lc['error']} | | | | | |")
        else:
            lines.append(f"| llama.cpp | | | | | {f(lc['peak'])} / {f(lc['end'])} | |")
    notes = [f"LLVM's code pages resident at the end: {s['llvm']:.1f} MiB" if s.get("llvm") is not None else ""]
    if not s.get("peak_reset"):
        notes.append("the peak could not be reset after the warm-up (no /proc/self/clear_refs): it is the process's")
    if bound is not None:
        worst = max(s["load_peak"], s["peak"], s["end"])
        side = "within" if worst <= bound else "over"
        notes.append(f"highest point {worst:,.0f} MiB: {side} the bound by {abs(bound - worst):,.0f}")
    return "\n".join(lines) + "\n\n" + "; ".join(n for n in notes if n) + "."


def main(argv=None) -> dict:
    from sparrow.errors import SparrowError
    from sparrow_lab.bench import shapes

    ap = argparse.ArgumentParser(prog="sparrow bench memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF or HF folder (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--shape", choices=list(shapes.SHAPES), help="a random-weight GGUF with this model's shapes")
    ap.add_argument("--type", default="q8_0", choices=shapes.TYPES, help="weight type of the --shape file")
    ap.add_argument("--activations", default="q8", choices=["auto", "f32", "q8"], help="auto: the file's default")
    ap.add_argument("--kv", default="f16", choices=["f32", "f16", "int8"])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", choices=["llama-cpp"])
    ap.add_argument("--json", help="also write the record here")
    ap.add_argument("--_child", choices=["sparrow", "llama"], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.shape and a.model:
        raise SparrowError("give --model or --shape, not both")
    if a.prompt < 1 or a.decode < 0:
        raise SparrowError("--prompt must be at least 1 and --decode at least 0")
    if a.shape:
        path = shapes.ensure(a.shape, a.type)
    else:
        from sparrow.loaders import default_model_path

        path = a.model or default_model_path()
    if a._child == "sparrow":
        print(json.dumps(child(path, a.activations, a.kv, a.prompt, a.decode, a.threads)))
        return {}
    if a._child == "llama":
        print(json.dumps(_llama_child(path, a.prompt, a.decode, a.threads)))
        return {}
    common = ["--threads", str(a.threads), "--prompt", str(a.prompt), "--decode", str(a.decode)]
    common += ["--model", path]
    rec = {"model": path, "load_start": load_avg()}
    rec["sparrow"] = _run_child("sparrow", common + ["--activations", a.activations, "--kv", a.kv])
    if "error" in rec["sparrow"]:
        raise SparrowError(f"the measured process failed: {rec['sparrow']['error']}")
    if a.compare == "llama-cpp":
        rec["llama"] = _run_child("llama", common)
    rec["load_end"] = load_avg()
    print(
        f"Model {os.path.basename(path)}, {a.prompt}-token prompt, {a.decode} decoded, {a.kv} KV, "
        f"{a.threads} threads; load {rec['load_start']} -> {rec['load_end']}\n"
    )
    print(table(rec))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rec, fh, indent=1)
    return rec


if __name__ == "__main__":
    main()
