"""`sparrow bench serve --load`: the server under a realistic mix, with every answer checked.

N concurrent streaming clients work through a fixed list of requests: short prompts, long
prompts sharing a system prefix, two-turn chats (the second turn reuses the first's KV), and
clients that disconnect midway. A 503 is retried after its Retry-After, as OpenAI clients do.
Every request is seeded; afterwards each is re-run alone in-process (sparrow.api, the same
sampler) and the streamed text must equal the solo text (a cancelled stream: a prefix of it).
A response that never finished without being cancelled is lost; one that differs is corrupted.

The same run ends with the closing figure: time to first token of a second chat turn whose
first turn is in the prefix cache, against an equally long second turn whose conversation the
server has not seen (no reuse), alternated and repeated, as a ratio.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request

from sparrow.server.metrics import parse_prometheus

from .sse import events

WORDS = "river stone maple lantern orbit velvet harbor meadow copper whisper canyon ember glacier".split()


def _post(url: str, body: dict, timeout: float = 3600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def make_jobs(n_requests: int, seed: int = 0) -> list[dict]:
    """The request mix: ~40% short, ~25% long (shared 700-word prefix), ~20% two-turn chats
    (two requests each), ~15% cancelled after a few tokens. Each job is seeded."""
    rng = random.Random(seed)
    shared = "Background: " + _text(random.Random(seed + 1), 700)
    jobs, i = [], 0
    while len([r for j in jobs for r in range(j.get("turns", 1))]) < n_requests:
        kind = rng.choices(["short", "long", "chat", "cancel"], [40, 25, 20, 15])[0]
        sampling = {"temperature": 0.8, "seed": 1000 + i, "ignore_eos": True}
        if kind == "chat":
            system = "You answer briefly. Notes: " + _text(rng, 500)
            job = {"kind": kind, "turns": 2, "system": system, "user": [_text(rng, 8), _text(rng, 6)]}
            job.update(sampling, max_tokens=12)
        else:
            prompt = (shared + " Question: " if kind == "long" else "") + _text(rng, rng.randint(8, 30))
            job = {"kind": kind, "prompt": prompt, "max_tokens": rng.randint(12, 28), **sampling}
            if kind == "cancel":
                job["cancel_after"] = rng.randint(2, 6)
        jobs.append(job)
        i += 1
    return jobs


def stream(url: str, path: str, body: dict, cancel_after: int | None = None) -> dict:
    """One streaming request, retried on 503. Returns text, timings, usage, errors."""
    out = {"text": "", "ttft": None, "itl": [], "retries": 0, "error": None, "finished": False, "cancelled": False}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    while True:
        t0 = time.perf_counter()
        try:
            r = _post(url + path, body)
            break
        except urllib.error.HTTPError as e:
            if e.code == 503 and out["retries"] < 100:
                out["retries"] += 1
                time.sleep(float(e.headers.get("Retry-After", "1")))
                continue
            out["error"] = f"HTTP {e.code}: {e.read()[:200]!r}"
            return out
        except OSError as e:
            out["error"] = repr(e)
            return out
    pieces, last = [], None
    with r:
        for msg in events(r):
            if "error" in msg:
                out["error"] = msg["error"]["message"]
                break
            if msg.get("usage"):
                out["usage"] = msg["usage"]
            if not msg.get("choices"):
                continue
            ch = msg["choices"][0]
            piece = ch["delta"].get("content") if "delta" in ch else ch.get("text")
            now = time.perf_counter()
            if piece:
                pieces.append(piece)
                if out["ttft"] is None:
                    out["ttft"] = now - t0
                else:
                    out["itl"].append(now - last)
                last = now
            if ch.get("finish_reason"):
                out["finished"] = True
            if cancel_after is not None and len(pieces) >= cancel_after:
                out["cancelled"] = True
                break  # closing the response drops the connection: the server frees the request's KV
    out["text"] = "".join(pieces)
    return out


def run_job(url: str, job: dict) -> list[dict]:
    """The job's request(s) -> one record per request (the request body kept for the check)."""
    sampling = {k: job[k] for k in ("temperature", "seed", "ignore_eos", "max_tokens")}
    if job["kind"] != "chat":
        body = {"prompt": job["prompt"], **sampling}
        rec = stream(url, "/v1/completions", body, job.get("cancel_after"))
        return [{**rec, "kind": job["kind"], "body": body}]
    msgs = [{"role": "system", "content": job["system"]}, {"role": "user", "content": job["user"][0]}]
    first = stream(url, "/v1/chat/completions", {"messages": msgs, **sampling})
    recs = [{**first, "kind": "chat-1", "body": {"messages": msgs, **sampling}}]
    if first["error"] is None:
        msgs2 = msgs + [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": job["user"][1]}]
        second = stream(url, "/v1/chat/completions", {"messages": msgs2, **sampling})
        recs.append({**second, "kind": "chat-2", "body": {"messages": msgs2, **sampling}})
    return recs


def run_load(url: str, jobs: list[dict], clients: int) -> tuple[list[dict], float]:
    todo = list(range(len(jobs)))
    lock = threading.Lock()
    records: list[dict] = []

    def client():
        while True:
            with lock:
                if not todo:
                    return
                j = todo.pop(0)
            recs = run_job(url, jobs[j])
            with lock:
                records.extend(recs)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def check(records: list[dict], llm) -> None:
    """Re-runs every request alone in-process; marks each record ok / lost / corrupted."""
    for rec in records:
        b = rec["body"]
        kw = {k: b[k] for k in ("temperature", "seed", "ignore_eos", "max_tokens")}
        chat = "messages" in b
        solo = "".join(o.text for o in llm.stream(b["messages"] if chat else b["prompt"], chat=chat, **kw))
        rec["lost"] = rec["error"] is None and not rec["finished"] and not rec["cancelled"]
        same = solo.startswith(rec["text"]) if rec["cancelled"] else rec["text"] == solo
        rec["corrupted"] = rec["error"] is None and not rec["lost"] and not same


def second_turn_ttft(url: str, repeats: int = 3, words: int = 1100) -> dict:
    """TTFT of a chat's second turn with its first turn cached vs. an equally long one not seen."""
    cached, fresh = [], []
    for i in range(repeats):
        rng = random.Random(500 + i)
        convs = [
            [{"role": "system", "content": "Notes: " + _text(rng, words)}, {"role": "user", "content": "Summarise."}]
            for _ in range(2)
        ]
        body = {"max_tokens": 8, "temperature": 0}
        reply = stream(url, "/v1/chat/completions", {"messages": convs[0], **body})["text"]
        tail = [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter, please."}]
        warm = stream(url, "/v1/chat/completions", {"messages": convs[0] + tail, **body})
        cold = stream(url, "/v1/chat/completions", {"messages": convs[1] + tail, **body})
        if warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0:
            raise SystemExit("the second turn was not served from the prefix cache")
        cached.append(warm["ttft"])
        fresh.append(cold["ttft"])
    c, f = sorted(cached)[len(cached) // 2], sorted(fresh)[len(fresh) // 2]
    return {
        "prompt_tokens": warm["usage"]["prompt_tokens"],
        "cached_tokens": warm["usage"]["prompt_tokens_details"]["cached_tokens"],
        "ttft_cached_s": c,
        "ttft_uncached_s": f,
        "ratio": f / c,
    }


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(records: list[dict], wall: float, before: dict, after: dict, budget: int | None, peak_rss) -> dict:
    ttft = [r["ttft"] for r in records if r["ttft"] is not None]
    itl = [x for r in records for x in r["itl"]]
    tokens = sum(r.get("usage", {}).get("completion_tokens", 0) or len(r["itl"]) + bool(r["ttft"]) for r in records)

    def d(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    served = [r["usage"] for r in records if r.get("usage")]  # cancelled streams end before their usage
    hits = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) > 0 for u in served)
    return {
        "requests": len(records),
        "by_kind": {k: sum(r["kind"] == k for r in records) for k in sorted({r["kind"] for r in records})},
        "wall_s": wall,
        "tokens": tokens,
        "throughput_tok_s": tokens / wall,
        "ttft_s": {f"p{q}": pct(ttft, q) for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": 1e3 * pct(itl, q) for q in (50, 90, 99)},
        "prefix_hit_rate": hits / len(served) if served else 0.0,  # responses with cached_tokens > 0
        "cached_tokens": d("sparrow_prefix_cache_hit_tokens_total"),
        "preemptions": d("sparrow_preemptions_total"),
        "retries_503": sum(r["retries"] for r in records),
        "cancelled": sum(r["cancelled"] for r in records),
        "errors": sum(r["error"] is not None for r in records),
        "lost": sum(r.get("lost", False) for r in records),
        "corrupted": sum(r.get("corrupted", False) for r in records),
        "kv_budget_bytes": budget,
        "kv_peak_bytes": after.get("sparrow_kv_cache_bytes_peak"),
        "peak_rss_bytes": peak_rss,
    }


def rss(pid: int | None, field: str) -> int | None:
    """The server process's resident set now (VmRSS) or at its peak (VmHWM), where /proc has it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, TypeError):
        pass
    return None


def metrics(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        return parse_prometheus(r.read().decode())
