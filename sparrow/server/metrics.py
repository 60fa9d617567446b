"""Server counters and gauges, rendered in the Prometheus text exposition format.

The engine thread and the asyncio side both update these, so every update takes one lock;
nothing here is on a per-element hot path (a few updates per engine step).
"""

from __future__ import annotations

import threading
from collections import Counter


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, status) -> count
        self.prompt_tokens = 0  # prompts of admitted requests, counted when their prefill ends
        self.generation_tokens = 0
        self.prefill_tokens = 0  # tokens run through prefill forwards, and the time they took
        self.prefill_seconds = 0.0
        self.decode_tokens = 0  # tokens produced by batched decode forwards, and their time
        self.decode_seconds = 0.0
        self.decode_forwards = 0
        self.spec_drafted_tokens = 0  # speculative decoding: tokens drafted, and those the samples kept
        self.spec_accepted_tokens = 0
        self.cancelled = 0  # requests dropped because their client went away
        self.finished: Counter = Counter()  # finish_reason -> count
        self.running = 0
        self.waiting = 0
        self.timeouts = 0  # requests failed by their deadline
        self.kv: dict = {}  # the engine's KV budget and prefix-cache figures (set_kv)
        self.ready = False

    # ------------------------------------------------------------------ updates
    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, int(status))] += 1

    def prefill(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.prefill_tokens += tokens
            self.prefill_seconds += seconds

    def decode(self, tokens: int, seconds: float, forwards: int) -> None:
        with self._lock:
            self.decode_tokens += tokens
            self.decode_seconds += seconds
            self.decode_forwards += forwards

    def add(self, **counts) -> None:
        """Adds to plain integer counters: prompt_tokens, generation_tokens, cancelled."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def finish(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] += 1

    def set_queue(self, running: int, waiting: int) -> None:
        with self._lock:
            self.running, self.waiting = running, waiting

    def set_kv(self, **values) -> None:
        """used, budget, peak, prefix_bytes, prefix_entries, prefix_lookups, prefix_hits,
        cached_tokens, prefix_evictions, preemptions (the engine's running totals)."""
        with self._lock:
            self.kv = values

    # ------------------------------------------------------------------ reading
    def snapshot(self) -> dict:
        with self._lock:
            return {
                "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens,
                "prefill_tokens": self.prefill_tokens,
                "prefill_seconds": self.prefill_seconds,
                "decode_tokens": self.decode_tokens,
                "decode_seconds": self.decode_seconds,
                "cancelled": self.cancelled,
                "running": self.running,
                "waiting": self.waiting,
                "timeouts": self.timeouts,
                "spec_drafted_tokens": self.spec_drafted_tokens,
                "spec_accepted_tokens": self.spec_accepted_tokens,
                **{f"kv_{k}": v for k, v in self.kv.items()},
            }

    def render(self) -> str:
        with self._lock:
            lines: list[str] = []

            def metric(name, kind, help_, samples):
                lines.append(f"# HELP sparrow_{name} {help_}")
                lines.append(f"# TYPE sparrow_{name} {kind}")
                for labels, value in samples:
                    lab = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
                    lines.append(f"sparrow_{name}{'{' + lab + '}' if lab else ''} {value}")

            metric("model_ready", "gauge", "1 once the model is loaded and warmed up", [({}, int(self.ready))])
            metric(
                "requests_total",
                "counter",
                "HTTP requests by endpoint and status code",
                [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())],
            )
            metric("prompt_tokens_total", "counter", "prompt tokens of admitted requests", [({}, self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "generated tokens", [({}, self.generation_tokens)])
            metric(
                "request_finished_total",
                "counter",
                "finished generations by finish reason",
                [({"finish_reason": r}, n) for r, n in sorted(self.finished.items())],
            )
            metric(
                "requests_cancelled_total",
                "counter",
                "generations dropped because the client disconnected",
                [({}, self.cancelled)],
            )
            metric("num_requests_running", "gauge", "sequences in the decode batch", [({}, self.running)])
            metric("num_requests_waiting", "gauge", "sequences queued or in prefill", [({}, self.waiting)])
            metric(
                "prefill_tokens_total", "counter", "tokens run through prefill forwards", [({}, self.prefill_tokens)]
            )
            metric(
                "prefill_seconds_total",
                "counter",
                "time spent in prefill forwards",
                [({}, f"{self.prefill_seconds:.6f}")],
            )
            metric("decode_tokens_total", "counter", "tokens produced by decode forwards", [({}, self.decode_tokens)])
            metric(
                "decode_seconds_total", "counter", "time spent in decode steps", [({}, f"{self.decode_seconds:.6f}")]
            )
            metric(
                "decode_forwards_total",
                "counter",
                "decode forwards (a step runs one per SMALL_T rows)",
                [({}, self.decode_forwards)],
            )
            metric(
                "spec_draft_tokens_total",
                "counter",
                "speculative decoding: tokens drafted and checked",
                [({}, self.spec_drafted_tokens)],
            )
            metric(
                "spec_accepted_tokens_total",
                "counter",
                "speculative decoding: drafted tokens the target sampled too",
                [({}, self.spec_accepted_tokens)],
            )
            pf = self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0
            dc = self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0
            metric(
                "prefill_tokens_per_second", "gauge", "prefill throughput over all prefill time", [({}, f"{pf:.3f}")]
            )
            metric(
                "decode_tokens_per_second",
                "gauge",
                "aggregate decode throughput over all decode time",
                [({}, f"{dc:.3f}")],
            )
            metric("requests_timed_out_total", "counter", "requests failed by their timeout", [({}, self.timeouts)])
            kv = self.kv
            for name, kind, key, help_ in _KV_METRICS:
                if key in kv:
                    metric(name, kind, help_, [({}, kv[key])])
            return "\n".join(lines) + "\n"


_KV_METRICS = (  # (metric name, kind, set_kv key, help)
    ("kv_cache_bytes_used", "gauge", "used", "KV cache bytes charged to the budget (running and prefix cache)"),
    ("kv_cache_bytes_budget", "gauge", "budget", "the KV cache budget in bytes (--kv-budget)"),
    ("kv_cache_bytes_peak", "gauge", "peak", "most KV cache bytes charged at once"),
    ("prefix_cache_bytes", "gauge", "prefix_bytes", "KV bytes held by the prefix cache"),
    ("prefix_cache_entries", "gauge", "prefix_entries", "prompts whose KV the prefix cache holds"),
    ("prefix_cache_queries_total", "counter", "prefix_lookups", "requests admitted with a prefix-cache lookup"),
    ("prefix_cache_hits_total", "counter", "prefix_hits", "requests that reused KV from the prefix cache"),
    ("prefix_cache_hit_tokens_total", "counter", "cached_tokens", "prompt tokens whose KV came from the prefix cache"),
    ("prefix_cache_evictions_total", "counter", "prefix_evictions", "prefix cache entries evicted for room"),
    ("preemptions_total", "counter", "preemptions", "sequences preempted because the KV budget was full"),
    ("prompt_cache_disk_hits_total", "counter", "disk_hits", "prefixes loaded from the --prompt-cache folder"),
    (
        "prompt_cache_disk_hit_tokens_total",
        "counter",
        "disk_hit_tokens",
        "positions loaded from the --prompt-cache folder",
    ),
    ("prompt_cache_disk_writes_total", "counter", "disk_writes", "entries written to the --prompt-cache folder"),
    (
        "prompt_cache_disk_write_bytes_total",
        "counter",
        "disk_write_bytes",
        "bytes written to the --prompt-cache folder",
    ),
    ("prompt_cache_disk_rejected_total", "counter", "disk_rejected", "damaged entry files ignored (logged)"),
    ("prompt_cache_disk_evictions_total", "counter", "disk_evictions", "entry files deleted to keep the folder's size"),
)


def parse_prometheus(text: str) -> dict[str, float]:
    """'name{labels}' -> value, for tests and the benchmark."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
