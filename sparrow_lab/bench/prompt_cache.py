"""Time to first token with the prompt cache on disk (state/disk.py), as users meet it:
through LLM.stream, a long document plus a short question, in fresh processes.

Per context C, in a new temporary --prompt-cache folder:
  fresh   process 1: the prompt prefilled from nothing (its KV written to the folder)
  memory  process 1 again: the same prompt, reused from the in-memory prefix cache
  disk    process 2 (a restart): loaded from the folder, its file evicted from the page cache
          first (posix_fadvise), so it is read from the disk
  disk, cached  process 3: the same, with the file in the page cache
Each process first runs a short prompt (under one chunk: nothing is saved) so that loading
compiled kernels is not counted. Also printed: the entry file's bytes per token and the time
its background write took.

`sparrow bench prompt-cache [--model PATH | --shape qwen3-1.7b --type q4_0] --contexts 4096,16384`
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from sparrow_lab.bench import shapes
from sparrow_lab.bench.host import cpu_info, load_avg, rss_peak_mb

QUESTION = 24  # tokens after the document: a new question each time


def _child(a) -> None:
    import sparrow

    llm = sparrow.load(a.model, threads=a.threads, kv_dtype=a.kv_dtype, prompt_cache=a.folder, ctx=a.ctx)
    rng = np.random.default_rng(0)
    vocab = llm.config.vocab_size
    ids = rng.integers(100, min(vocab, 40000), a.context + QUESTION).tolist()
    warm = rng.integers(100, min(vocab, 40000), 64).tolist()
    list(llm.stream(warm, max_tokens=2, temperature=0.0))

    def ttft():
        t0 = time.perf_counter()
        out = next(iter(llm.stream(ids, max_tokens=1, temperature=0.0)))
        return time.perf_counter() - t0, out.cached_tokens, out.token_id

    rec = {}
    rec["first_s"], rec["first_cached"], rec["token"] = ttft()
    t0 = time.perf_counter()
    llm.prefix.disk.flush()
    rec["write_wait_s"] = time.perf_counter() - t0
    if a.again:
        rec["again_s"], rec["again_cached"], token = ttft()
        assert token == rec["token"], "the reused prefix gave another token"
    rec["rss_peak_mb"] = rss_peak_mb()
    print(json.dumps(rec), flush=True)


def _run(a, folder: str, again: bool) -> dict:
    cmd = [sys.executable, "-m", "sparrow_lab.bench.prompt_cache", "--_child", "--folder", folder]
    cmd += ["--model", a.model, "--threads", str(a.threads), "--kv-dtype", a.kv_dtype, "--context", str(a.context)]
    cmd += ["--ctx", str(a.ctx)] + (["--again"] if again else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _evict(folder: str) -> None:
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="sparrow bench prompt-cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF or HF folder (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--shape", choices=list(shapes.SHAPES), help="a Qwen3-shaped file of random weights instead")
    ap.add_argument("--type", default="q4_0", choices=shapes.TYPES, help="weight type of the --shape file")
    ap.add_argument("--contexts", default="4096", help="document lengths in tokens, comma-separated")
    ap.add_argument("--kv-dtype", default="f16", choices=["f32", "f16", "int8"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ctx", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--again", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._child:
        a.model = a.model or None
        return _child(a)
    if a.shape:
        a.model = shapes.ensure(a.shape, a.type)
    a.model = a.model or ""
    cpu = cpu_info()
    print(f"# prompt cache on disk: {a.model or 'default model'}, KV {a.kv_dtype}, {a.threads} threads")
    print(f"# CPU: {cpu.get('model', '?')}; load average at start {load_avg()}")
    print(
        "| context | fresh TTFT s | memory hit s | disk hit s (page cache cold) | disk hit s (cached) "
        "| fresh / disk | file MB | bytes/token | write s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c in (int(x) for x in a.contexts.split(",")):
        a.context, a.ctx = c, c + QUESTION + 8
        with tempfile.TemporaryDirectory(prefix="sparrow-pc-") as folder:
            first = _run(a, folder, again=True)
            names = [n for n in os.listdir(folder) if n.endswith(".safetensors")]
            size = sum(os.path.getsize(os.path.join(folder, n)) for n in names)
            _evict(folder)
            cold = _run(a, folder, again=False)
            warm = _run(a, folder, again=False)
        saved = c // 512 * 512
        assert first["first_cached"] == 0 and first["again_cached"] == saved, first
        assert cold["first_cached"] == saved and warm["first_cached"] == saved, (cold, warm)
        assert cold["token"] == warm["token"] == first["token"]
        print(
            f"| {c} | {first['first_s']:.2f} | {first['again_s']:.2f} | {cold['first_s']:.2f} | "
            f"{warm['first_s']:.2f} | {first['first_s'] / cold['first_s']:.1f}x | {size / 2**20:.0f} | "
            f"{size / saved:.0f} | {first['write_wait_s']:.2f} |",
            flush=True,
        )
    print(f"# load average at end {load_avg()}")


if __name__ == "__main__":
    main()
