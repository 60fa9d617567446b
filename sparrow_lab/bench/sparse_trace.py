"""`sparrow bench sparse-trace`: what the `sparse_trace` response field costs decode, side by side.

Starts `sparrow serve` as a subprocess and streams the same completion with and without
`"sparse_trace": true`, interleaved (each round runs both, the order alternating), on the
needle prompt of the long-context evaluation (`--prompt-tokens`, the fact at half depth),
greedy with ignore_eos, so every request decodes exactly --tokens tokens. The prompt's KV
comes from the prefix cache after a warm-up request of each kind, so a request is its last
partial chunk, its decode steps and its streaming.

The measure is the server process's CPU time (utime + stime from /proc) per generated
token: the engine thread's steps and the event loop's encoding of every chunk (with the trace,
each step's selections), which run at the same time on different cores, so wall time hides
part of the encoding. With --threads 1 (the default) no worker spins at a barrier, so CPU time
is steady under other load; wall time per token is printed too. The overhead is the median of
the traced rounds over the median of the plain ones, minus one (best over best beside it), and
split between the busiest thread (the engine's: decoding) and the others (HTTP and streaming,
where a traced step's selections are packed), each thread's CPU time read from /proc too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from types import SimpleNamespace

from sparrow.loaders import open_checkpoint
from sparrow_lab.eval.prompts import make_prompt

from .host import load_avg
from .serve import _post, _start, _stop
from .sse import events

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(stat: str) -> float:
    """utime + stime from a /proc stat file: a process's (all its threads, those that ended
    included) or one thread's."""
    with open(stat) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14 and 15 of proc(5)


def _threads(pid: int) -> dict[str, float]:
    """CPU seconds of each live thread of pid."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[tid] = _cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
        except OSError:  # it ended meanwhile
            pass
    return out


def _request(url: str, pid: int, body: dict) -> dict:
    """One streamed completion: the server's CPU seconds (all of it, and its busiest thread's:
    the engine thread, whose decode steps are most of it), the wall seconds it took, the tokens
    it generated and the characters of the trace steps' JSON."""
    cpu0, threads0, t0 = _cpu_seconds(f"/proc/{pid}/stat"), _threads(pid), time.perf_counter()
    tokens, steps, trace_chars = 0, 0, 0
    with _post(url + "/v1/completions", body) as r:
        for msg in events(r):
            for choice in msg.get("choices") or []:
                step = choice.get("sparse_trace")
                if step is not None and "data" in step:
                    steps += 1
                    trace_chars += len(json.dumps(step))
            if msg.get("usage"):
                tokens = msg["usage"]["completion_tokens"]
    wall = time.perf_counter() - t0
    time.sleep(0.05)  # the server's last chunk is sent before its handler returns
    cpu, threads = _cpu_seconds(f"/proc/{pid}/stat") - cpu0, _threads(pid)
    engine = max(threads[t] - threads0.get(t, 0.0) for t in threads)
    return {"cpu": cpu, "engine": engine, "wall": wall, "tokens": tokens, "steps": steps, "chars": trace_chars}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="sparrow bench sparse-trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    ap.add_argument("--threads", type=int, default=1, help="the server's threads (1: CPU time is steady)")
    ap.add_argument("--kv-dtype", default="f32")
    ap.add_argument("--k", type=int, default=32, help="sparse_k")
    ap.add_argument("--prompt-tokens", type=int, default=2048, help="the needle prompt's length")
    ap.add_argument("--tokens", type=int, default=128, help="tokens each request generates")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of one plain and one traced request")
    a = ap.parse_args(argv)
    if min(a.threads, a.k, a.prompt_tokens, a.tokens, a.rounds) < 1:
        raise SystemExit("--threads, --k, --prompt-tokens, --tokens and --rounds must be positive")
    ids = make_prompt(open_checkpoint(a.model).tokenizer, "needle", a.prompt_tokens, 0.5, 0, answer_prefix=False).ids
    base = {
        "prompt": list(ids),
        "max_tokens": a.tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "sparse_attn": True,
        "sparse_k": a.k,
    }
    bodies = {"plain": base, "traced": {**base, "sparse_trace": True}}
    proc, url = _start(SimpleNamespace(model=a.model, threads=a.threads, kv_dtype=a.kv_dtype, max_batch=1, load=False))
    runs: dict[str, list] = {"plain": [], "traced": []}
    try:
        for body in bodies.values():  # compiles, and leaves the prompt's KV in the prefix cache
            _request(url, proc.pid, body)
        load0 = load_avg()
        for r in range(a.rounds):
            for kind in ("plain", "traced") if r % 2 == 0 else ("traced", "plain"):
                got = _request(url, proc.pid, bodies[kind])
                if got["tokens"] != a.tokens:
                    raise SystemExit(f"a {kind} request generated {got['tokens']} tokens, not {a.tokens}")
                runs[kind].append(got)
        load1 = load_avg()
    finally:
        _stop(proc)
    print(
        f"sparse_trace cost: {len(ids)}-token needle prompt, k={a.k}, {a.kv_dtype} KV, {a.tokens} tokens a request, "
        f"server --threads {a.threads}, {a.rounds} interleaved rounds; load average {load0} -> {load1}"
    )
    print(
        f"{'':8} {'CPU ms/token: median':>21} {'best':>6} {'engine thread':>14} {'other threads':>14} "
        f"{'wall ms/token: median':>22} {'best':>6}"
    )
    per = {}
    for kind, rs in runs.items():
        cpu = [1e3 * x["cpu"] / x["tokens"] for x in rs]
        engine = [1e3 * x["engine"] / x["tokens"] for x in rs]
        other = [1e3 * (x["cpu"] - x["engine"]) / x["tokens"] for x in rs]
        wall = [1e3 * x["wall"] / x["tokens"] for x in rs]
        m = statistics.median
        per[kind] = (m(cpu), min(cpu), m(wall), min(wall), m(engine), m(other))
        print(
            f"{kind:8} {per[kind][0]:21.2f} {per[kind][1]:6.2f} {per[kind][4]:14.2f} {per[kind][5]:14.2f} "
            f"{per[kind][2]:22.2f} {per[kind][3]:6.2f}"
        )
    t = runs["traced"][-1]
    print(f"trace step: {t['chars'] / max(t['steps'], 1):,.0f} characters of JSON a token ({t['steps']} steps)")
    p, q = per["plain"], per["traced"]
    print(
        f"overhead: CPU {100 * (q[0] / p[0] - 1):+.1f}% (median), {100 * (q[1] / p[1] - 1):+.1f}% (best); "
        f"engine thread {100 * (q[4] / p[4] - 1):+.1f}%, other threads {q[5] - p[5]:+.2f} ms/token "
        f"({100 * (q[5] - p[5]) / p[0]:+.1f}% of plain CPU); wall {100 * (q[2] / p[2] - 1):+.1f}% (median)"
    )


if __name__ == "__main__":
    main()
