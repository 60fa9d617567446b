"""`sparrow bench serve`: aggregate decode throughput of the server at 1, 4, 8 concurrent streams.

Starts `sparrow serve` as a subprocess (or uses --url), then for each concurrency level runs
that many identical streaming completions (same prompt token ids, greedy, ignore_eos, so every
stream decodes exactly --max-tokens tokens) and reports:
  decode tok/s   the server's own decode counters over that level: tokens produced by batched
                 decode steps / time spent in them (prefill excluded)
  e2e tok/s      client side: all completion tokens / wall time of the level (prefill included)
  TTFT           mean time to the first streamed token
Ratios are against the 1-stream row of the same run, so they hold under the same machine load.
The JSON record (--json, default runs/serve-<timestamp>/serve.json) is written before the table.
Only the standard library talks HTTP here, so the base install runs it.

With --load it runs the load test instead (serve_load.py): --clients concurrent streaming
clients, --requests requests of a mixed workload under --kv-budget / --max-queue, every answer
checked against a seeded solo run, and the second-chat-turn TTFT ratio with the prefix cache.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from sparrow.server.metrics import parse_prometheus
from sparrow_lab.eval import report

from .sse import events


def _get(url: str, timeout: float = 60) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict, timeout: float = 3600):
    """An open response (a context manager; iterating it yields lines as bytes)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(a) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "sparrow.cli", "serve", "--port", str(port), "--max-batch", str(a.max_batch)]
    flags = [("--model", a.model), ("--threads", a.threads), ("--kv-dtype", a.kv_dtype)]
    if a.load:
        flags += [("--kv-budget", a.kv_budget), ("--max-queue", a.max_queue)]
    for flag, v in flags:
        if v is not None:
            cmd += [flag, str(v)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with status {proc.returncode}")
        try:
            _get(url + "/health", timeout=5)  # 503 (an HTTPError) while the model loads
            return proc, url
        except OSError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("server did not become ready")


def _stream(url: str, body: dict, out: dict) -> None:
    t0 = time.perf_counter()
    first, tokens = None, 0
    with _post(url + "/v1/completions", body) as r:
        for msg in events(r):
            if msg.get("choices") and msg["choices"][0].get("text") and first is None:
                first = time.perf_counter() - t0
            if msg.get("usage"):
                tokens = msg["usage"]["completion_tokens"]
    out.update(ttft=first or 0.0, tokens=tokens, seconds=time.perf_counter() - t0)


def _level(url: str, body: dict, n: int) -> dict:
    before = parse_prometheus(_get(url + "/metrics"))
    results = [dict() for _ in range(n)]
    threads = [threading.Thread(target=_stream, args=(url, body, results[i])) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = parse_prometheus(_get(url + "/metrics"))
    d = {
        k: after[k] - before[k]
        for k in ("sparrow_decode_tokens_total", "sparrow_decode_seconds_total", "sparrow_decode_forwards_total")
    }
    tokens = sum(r["tokens"] for r in results)
    return {
        "streams": n,
        "tokens": tokens,
        "wall_s": wall,
        "decode_tok_s": d["sparrow_decode_tokens_total"] / max(d["sparrow_decode_seconds_total"], 1e-9),
        "rows_per_forward": d["sparrow_decode_tokens_total"] / max(d["sparrow_decode_forwards_total"], 1),
        "e2e_tok_s": tokens / wall,
        "ttft_s": sum(r["ttft"] for r in results) / n,
    }


def _stop(proc) -> None:
    if proc is not None:
        proc.terminate()  # SIGTERM: the server drains (nothing is in flight by now) and exits
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _load(a, url, proc, out, argv) -> None:
    from sparrow import api
    from sparrow.state.budget import parse_size

    from . import serve_load as sl

    jobs = sl.make_jobs(a.requests)
    try:
        before = sl.metrics(url)
        rss_idle = sl.rss(proc.pid if proc is not None else None, "VmRSS")
        records, wall = sl.run_load(url, jobs, a.clients)
        after = sl.metrics(url)
        turn = sl.second_turn_ttft(url)
        rss = sl.rss(proc.pid if proc is not None else None, "VmHWM")
    finally:
        _stop(proc)
    budget = parse_size(a.kv_budget) if a.url is None else None

    def write(checked: bool) -> dict:
        summary = sl.summarize(records, wall, before, after, budget, rss)
        summary["idle_rss_bytes"] = rss_idle
        summary["checked_against_solo_runs"] = checked
        record = {
            "bench": "serve-load",
            "argv": list(sys.argv[1:] if argv is None else argv),
            "url": a.url,
            "model": a.model,
            "clients": a.clients,
            "max_batch": a.max_batch,
            "max_queue": a.max_queue,
            "environment": report.environment(),
            "summary": summary,
            "second_turn": turn,
            "records": [{k: v for k, v in r.items() if k != "body"} for r in records],
        }
        report.write_json(out, record)
        return summary

    write(False)  # the load's figures first: the solo re-runs take as long again
    print(f"load done in {wall:.0f} s; re-running every request alone to check it", file=sys.stderr, flush=True)
    llm = api.load(a.model, threads=a.threads, kv_dtype=a.kv_dtype or "f32")
    sl.check(records, llm)
    summary = write(True)
    load = os.getloadavg()
    s, mb = summary, lambda n: f"{n / 2**20:.0f} MiB" if n else "-"
    print(
        f"sparrow bench serve --load: {s['requests']} requests {s['by_kind']} from {a.clients} clients; "
        f"load average {load[0]:.1f} on {os.cpu_count()} cores"
    )
    print(
        "| requests | wall s | tok/s | TTFT p50/p90/p99 s | ITL p50/p90/p99 ms | prefix hits | preempted "
        "| 503 retried | cancelled | errors | lost | corrupted | KV peak / budget | RSS idle -> peak |"
    )
    print("|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    t, i = s["ttft_s"], s["itl_ms"]
    print(
        f"| {s['requests']} | {s['wall_s']:.1f} | {s['throughput_tok_s']:.1f} "
        f"| {t['p50']:.2f} / {t['p90']:.2f} / {t['p99']:.2f} | {i['p50']:.0f} / {i['p90']:.0f} / {i['p99']:.0f} "
        f"| {s['prefix_hit_rate']:.0%} | {s['preemptions']:.0f} | {s['retries_503']} | {s['cancelled']} "
        f"| {s['errors']} | {s['lost']} | {s['corrupted']} | {mb(s['kv_peak_bytes'])} / {mb(budget)} "
        f"| {mb(rss_idle)} -> {mb(s['peak_rss_bytes'])} |"
    )
    print(
        f"second chat turn ({turn['prompt_tokens']} prompt tokens, {turn['cached_tokens']} cached): TTFT "
        f"{turn['ttft_cached_s']:.2f} s with the prefix cache vs {turn['ttft_uncached_s']:.2f} s without: "
        f"{turn['ratio']:.1f}x"
    )
    print(f"wrote {out}", file=sys.stderr)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="sparrow bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="use a running server instead of starting one")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-dtype", default=None)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--streams", default="1,4,8", help="concurrency levels, comma separated")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--load", action="store_true", help="run the load test (see serve_load.py)")
    p.add_argument("--clients", type=int, default=8, help="--load: concurrent streaming clients")
    p.add_argument("--requests", type=int, default=40, help="--load: requests in all")
    p.add_argument("--kv-budget", default="96M", help="--load: the server's --kv-budget")
    p.add_argument("--max-queue", type=int, default=4, help="--load: the server's --max-queue")
    p.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="write the JSON record here (default runs/serve-<timestamp>/serve.json)",
    )
    a = p.parse_args(argv)
    out = report.record_path("serve", a.json)

    proc = None
    url = a.url
    if url is None:
        proc, url = _start(a)
    if a.load:
        return _load(a, url, proc, out, argv)
    try:
        words = "The quick brown fox jumps over the lazy dog while the sun sets behind the hills. " * 64
        with _post(url + "/tokenize", {"prompt": words}, timeout=60) as r:
            ids = json.loads(r.read())["tokens"][: a.prompt_tokens]
        body = {
            "prompt": ids,
            "max_tokens": a.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        _level(url, {**body, "max_tokens": 2}, 1)  # warm-up
        rows = [_level(url, body, int(n)) for n in a.streams.split(",")]
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    load = os.getloadavg()
    report.write_json(
        out,
        {
            "bench": "serve",
            "argv": list(sys.argv[1:] if argv is None else argv),
            "url": a.url,
            "model": a.model,
            "threads": a.threads,
            "kv_dtype": a.kv_dtype,
            "max_batch": a.max_batch,
            "prompt_tokens": len(ids),
            "max_tokens": a.max_tokens,
            "environment": report.environment(),
            "rows": rows,
        },
    )
    print(
        f"sparrow bench serve: prompt {len(ids)} tokens, {a.max_tokens} new tokens per stream, greedy; "
        f"load average {load[0]:.1f} on {os.cpu_count()} cores"
    )
    base = rows[0]
    print("| streams | decode tok/s | vs 1 | rows/forward | e2e tok/s | vs 1 | mean TTFT s | wall s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    vs = lambda x, b: f"{x / b:.2f}x" if b else "-"  # noqa: E731 - no decode steps: no ratio
    for r in rows:
        print(
            f"| {r['streams']} | {r['decode_tok_s']:.1f} | {vs(r['decode_tok_s'], base['decode_tok_s'])} "
            f"| {r['rows_per_forward']:.2f} | {r['e2e_tok_s']:.1f} | {vs(r['e2e_tok_s'], base['e2e_tok_s'])} "
            f"| {r['ttft_s']:.2f} | {r['wall_s']:.1f} |"
        )
    print(f"wrote {out}", file=sys.stderr)
