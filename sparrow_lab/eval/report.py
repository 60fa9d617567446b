"""Run outputs: one JSON record, a markdown table like the article's, PNG plots (matplotlib Agg).

The record and the table are written first; plots are optional (matplotlib is not in the base
install): `plots_or_notice` turns a missing matplotlib or any plotting error into one line.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections import defaultdict

from sparrow.errors import SparrowError
from sparrow_lab.eval.oracle import is_oracle


def run_dir(bench: str, out: str | None) -> str:
    """The output folder: `out`, or runs/<bench>-<UTC timestamp>/."""
    path = out or os.path.join("runs", f"{bench}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise SparrowError(f"cannot create output directory {path}: {e.strerror}") from None
    return path


def record_path(bench: str, path: str | None) -> str:
    """Where a bench writes its JSON record: `path`, or runs/<bench>-<UTC timestamp>/<bench>.json;
    creates the folder."""
    if not path:
        return os.path.join(run_dir(bench, None), f"{bench}.json")
    if os.path.dirname(path):
        run_dir(bench, os.path.dirname(path))
    return path


def environment() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg": load,
    }


def write_json(path: str, record) -> str:
    try:
        with open(path, "w") as f:
            json.dump(record, f, indent=1, default=_jsonable)
    except OSError as e:
        raise SparrowError(f"cannot write {path}: {e.strerror}") from None
    return path


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "__dict__"):
        return vars(x)
    return str(x)


def _fmt(x, nd=1):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _cell(text: str, width: int = 60) -> str:
    t = " ".join(text.split()).replace("|", "\\|")
    return t if len(t) <= width else t[: width - 1] + "…"


def _config_order(name: str):
    """exact first, then by falling k, the seed selector ("sparse k=...") before others at one k."""
    if name == "exact":
        return (0, 0, "")
    try:
        return (1, -int(name.split("k=")[1].split()[0]), "" if name.startswith("sparse ") else name)
    except (IndexError, ValueError):
        return (2, 0, name)


def _selector(r: dict) -> str:
    return r.get("selector") or "seed"  # records from before selectors existed: the seed's


def group_rows(rows: list[dict]) -> dict[str, list[dict]]:
    g = defaultdict(list)
    for r in rows:
        g[r["config"]].append(r)
    return dict(sorted(g.items(), key=lambda kv: _config_order(kv[0])))


def _mean(vals):
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None


def _median(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def summary_rows(rows: list[dict]) -> list[dict]:
    """One line per configuration: recall over prompts, medians of ms, means of KL/top-1 and of
    the blocks a head read, and each selector's KL over the oracle's at as many blocks
    (oracle_ratio, oracle_gap)."""
    out = []
    for name, rs in group_rows(rows).items():
        mass = [r["mass"]["median"] for r in rs if r.get("mass")]
        p5 = [r["mass"]["p5"] for r in rs if r.get("mass")]
        out.append(
            {
                "config": name,
                "k": rs[0].get("k"),
                "selector": rs[0].get("selector"),
                "n": len(rs),
                "recall": _mean([r.get("score") for r in rs]),
                "attn_ms": _median([r.get("attn_ms") for r in rs]),
                "total_ms": _median([r.get("total_ms") for r in rs]),
                "kl": _mean([r.get("kl_mean") for r in rs]),
                "top1": _mean([r.get("top1") for r in rs]),
                "kl_prompt": _mean([r.get("kl_prompt") for r in rs]),
                "mass_median": _median(mass),
                "mass_p5": _median(p5),
                "blocks": _mean([r["mass"].get("blocks") for r in rs if r.get("mass")]),
                "example": rs[len(rs) // 2].get("text", ""),
            }
        )
    for s in out:
        s["oracle_ratio"] = oracle_gap(s, out)
    return out


def oracle_gap(s: dict, summaries: list[dict]) -> float | None:
    """s's KL over the oracle's at s's mean blocks read: the oracle's KL interpolated linearly in
    log(blocks) and log(KL) between the two oracle rows around it (an oracle row at exactly as
    many blocks is read as is); None for the oracle, exact, or outside the oracle rows run. The
    oracle is the one with s's exact first layers (`v3-dense0` against `oracle-dense0`) where
    the run has it, else `oracle`, else any."""
    if s.get("selector") is None or is_oracle(s["selector"]) or s.get("blocks") is None or s.get("kl") is None:
        return None
    dense = [m for m in s["selector"].split("-") if m.startswith("dense")]
    oracles = [o for o in summaries if is_oracle(o.get("selector")) and o.get("blocks")]
    for want in ["-".join(["oracle", *dense]), "oracle"]:
        if any(o["selector"] == want for o in oracles):
            oracles = [o for o in oracles if o["selector"] == want]
            break
    pts = sorted((o["blocks"], o["kl"]) for o in oracles)
    for (b0, k0), (b1, k1) in zip(pts, pts[1:] + pts[-1:]):
        if b0 <= s["blocks"] <= b1 and k0 > 0 and k1 > 0:
            t = 0.0 if b1 == b0 else math.log(s["blocks"] / b0) / math.log(b1 / b0)
            return s["kl"] / math.exp(math.log(k0) + t * math.log(k1 / k0))
    return None


def markdown_table(rows: list[dict], title: str = "") -> str:
    """The article's table: configuration, recall, generated text, attention and total ms/token,
    KL(exact || sparse), top-1 agreement; summary first, then every prompt."""
    lines = [f"### {title}", ""] if title else []
    lines += [
        "| configuration | recall | generated text (middle prompt) | attn ms/tok | total ms/tok | KL | top-1 "
        "| mass median / p5 | blocks read | KL / oracle's |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary_rows(rows):
        rec = "-" if s["recall"] is None else f"{s['recall']:.0%} ({s['n']})"
        mass = "-" if s["mass_median"] is None else f"{s['mass_median']:.3f} / {s['mass_p5']:.3f}"
        lines.append(
            f"| {s['config']} | {rec} | {_cell(s['example'])} | {_fmt(s['attn_ms'])} | {_fmt(s['total_ms'])} "
            f"| {_fmt(s['kl'], 3)} | {_fmt(s['top1'], 2)} | {mass} | {_fmt(s['blocks'])} "
            f"| {_fmt(s['oracle_ratio'], 2)} |"
        )
    lines += [
        "",
        "| task | length | depth | configuration | score | first diff | generated text |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        depth = "-" if r.get("depth") is None else f"{r['depth']:.0%}"
        lines.append(
            f"| {r.get('task', '-')} | {r.get('n_prompt', '-')} | {depth} | {r['config']} | {_fmt(r.get('score'), 2)} "
            f"| {_fmt(r.get('first_diff'))} | {_cell(r.get('text', ''))} |"
        )
    return "\n".join(lines) + "\n"


def _length(r: dict) -> int:
    """The requested prompt length (actual lengths differ by a few tokens between prompts)."""
    return r.get("target_tokens") or r["n_prompt"]


def timing_table(rows: list[dict]) -> str:
    """Decode ms/token (attention / total, medians over prompts) per configuration and context."""
    lengths = sorted({_length(r) for r in rows if r.get("attn_ms") is not None})
    if not lengths:
        return ""
    lines = [
        "### Decode ms/token by context (attention / total)",
        "",
        "| configuration | " + " | ".join(f"{L} tok" for L in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for name, rs in group_rows(rows).items():
        cells = []
        for L in lengths:
            sel = [r for r in rs if _length(r) == L]
            a, t = _median([r.get("attn_ms") for r in sel]), _median([r.get("total_ms") for r in sel])
            cells.append(f"{_fmt(a)} / {_fmt(t)}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_markdown(path: str, rows: list[dict], title: str = "", header: str = "") -> str:
    with open(path, "w") as f:
        f.write((header + "\n\n" if header else "") + markdown_table(rows, title) + "\n" + timing_table(rows))
    return path


PLOT_INSTALL = "pip install matplotlib, or pip install -e '.[lab]'"


def plots_or_notice(path_prefix: str, rows: list[dict]) -> list[str]:
    """plot(), but a missing matplotlib or any error while plotting costs only the plots: it
    prints one line on stderr and returns the PNGs written so far (none)."""
    try:
        return plot(path_prefix, rows)
    except ImportError as e:
        if (getattr(e, "name", None) or "").split(".")[0] != "matplotlib":
            why = f"{type(e).__name__}: {e}"
        else:
            why = "matplotlib is not installed"
        print(f"plots skipped ({why}; to get them: {PLOT_INSTALL})", file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - a plot is never worth the run
        print(f"plots skipped (plotting failed: {type(e).__name__}: {e})", file=sys.stderr, flush=True)
    return []


def plot(path_prefix: str, rows: list[dict]) -> list[str]:
    """recall vs k, KL vs k, mass coverage vs k, attention ms vs context; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    sparse = [r for r in rows if r.get("k") is not None]
    exact = [r for r in rows if r.get("k") is None]
    ks = sorted({r["k"] for r in sparse})
    selectors = list(dict.fromkeys(_selector(r) for r in sparse))
    multi = len(selectors) > 1
    written = []

    def by_k(key, agg, rs):
        return [agg([r.get(key) for r in rs if r["k"] == k]) for k in ks]

    def of(sel, rs):
        return [r for r in rs if _selector(r) == sel]

    def tag(sel, text=""):
        return f"{sel} {text}".strip() if multi else text

    def save(fig, name):
        p = f"{path_prefix}{name}.png"
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    if ks and any(r.get("score") is not None for r in sparse):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for sel in selectors:
            for L in sorted({_length(r) for r in sparse}):
                rs = [r for r in of(sel, sparse) if _length(r) == L]
                style = "o-" if sel == selectors[0] else "s--"
                ax.plot(ks, by_k("score", _mean, rs), style, label=tag(sel, f"{L} tok"))
        ex = _mean([r.get("score") for r in exact])
        if ex is not None:
            ax.axhline(ex, color="gray", ls="--", label="exact")
        ax.set(xscale="log", xlabel="k (blocks)", ylabel="recall", ylim=(-0.05, 1.05), title="Recall vs k")
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.legend(fontsize=7)
        save(fig, "recall_vs_k")
    if ks and any(r.get("kl_mean") is not None for r in sparse):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax2 = ax.twinx()
        for sel in selectors:
            (line,) = ax.plot(ks, by_k("kl_mean", _mean, of(sel, sparse)), "o-", label=tag(sel, "KL (mean)"))
            ax2.plot(ks, by_k("top1", _mean, of(sel, sparse)), "s--", color=line.get_color(), label=tag(sel, "top-1"))
        title = "Fidelity vs k"
        if multi:  # one colour per selector: KL solid, top-1 dashed
            ax.legend([sel for sel in selectors], fontsize=7, loc="center right")
            title = "KL (solid) and top-1 (dashed) vs k"
        ax.set(xscale="log", xlabel="k (blocks)", ylabel="KL(exact || sparse), nats", title=title)
        ax2.set(ylabel="top-1 agreement", ylim=(-0.05, 1.05))
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        save(fig, "kl_vs_k")
    if ks and any(r.get("mass") for r in sparse):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for sel in selectors:
            rs = of(sel, sparse)
            med = [_median([r["mass"]["median"] for r in rs if r["k"] == k and r.get("mass")]) for k in ks]
            p5 = [_median([r["mass"]["p5"] for r in rs if r["k"] == k and r.get("mass")]) for k in ks]
            (line,) = ax.plot(ks, med, "o-", label=tag(sel, "median") if not multi else sel)
            ax.plot(ks, p5, "s--", color=line.get_color(), label=None if multi else "5th percentile")
        ax.set(
            xscale="log",
            xlabel="k (blocks)",
            ylabel="softmax mass in selected blocks",
            ylim=(-0.05, 1.05),
            title="Mass coverage vs k" + (": median solid, p5 dashed" if multi else ""),
        )
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.legend(fontsize=7)
        save(fig, "mass_vs_k")
    lengths = sorted({_length(r) for r in rows if r.get("attn_ms") is not None})
    if lengths:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for name, rs in group_rows(rows).items():
            xs = [L for L in lengths if any(_length(r) == L for r in rs)]
            ax.plot(xs, [_median([r.get("attn_ms") for r in rs if _length(r) == L]) for L in xs], "o-", label=name)
        ax.set(
            xlabel="context (tokens)",
            ylabel="decode attention ms/token (all layers)",
            title="Attention time vs context",
        )
        ax.legend(fontsize=7)
        save(fig, "attn_ms_vs_context")
    return written


def mass_table(rows: list[dict]) -> str:
    """Per layer: median / 5th percentile (over heads, steps, prompts' medians) of the softmax
    mass the selected blocks cover, one column per k."""
    sparse = [r for r in rows if r.get("mass")]
    if not sparse:
        return ""
    cols = list(dict.fromkeys((_selector(r), r["k"]) for r in sorted(sparse, key=lambda r: _config_order(r["config"]))))
    multi = len({sel for sel, _ in cols}) > 1
    layers = sorted({int(li) for r in sparse for li in r["mass"]["per_layer"]})
    lines = [
        "### Softmax mass covered by the selected blocks (median / p5 per layer; layers a selector "
        "keeps exact have no entry)",
        "",
        "| layer | " + " | ".join(f"{sel} k={k}" if multi else f"k={k}" for sel, k in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for li in layers:
        cells = []
        for sel, k in cols:
            st = [
                r["mass"]["per_layer"].get(li) or r["mass"]["per_layer"].get(str(li))
                for r in sparse
                if r["k"] == k and _selector(r) == sel
            ]
            st = [s for s in st if s]
            cells.append(
                f"{_median([s['median'] for s in st]):.3f} / {_median([s['p5'] for s in st]):.3f}" if st else "-"
            )
        lines.append(f"| {li} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def sparse_prefill_table(rows: list[dict]) -> str:
    """With sparse prefill: per configuration and prompt length, the median prefill ms and its
    ratio to exact prefill's, and the mean KL and top-1 agreement at the prompt's last position
    (the logits that choose the first generated token) against the exact prefill."""
    lengths = sorted({_length(r) for r in rows})
    lines = [
        "### Sparse prefill: prefill time and the first token (prompt's last position) against exact prefill",
        "",
        "| configuration | length | prefill ms (median) | exact / this | KL at the last prompt position "
        "| top-1 there |",
        "|---|---|---|---|---|---|",
    ]
    for name, rs in group_rows(rows).items():
        for L in lengths:
            sel = [r for r in rs if _length(r) == L]
            if not sel:
                continue
            ms = _median([r.get("prefill_ms") for r in sel])
            exact = _median([r.get("prefill_ms") for r in rows if r["config"] == "exact" and _length(r) == L])
            speed = f"{exact / ms:.2f}x" if ms and exact else "-"
            kl, top1 = _mean([r.get("kl_prompt") for r in sel]), _mean([r.get("top1_prompt") for r in sel])
            lines.append(f"| {name} | {L} | {_fmt(ms, 0)} | {speed} | {_fmt(kl, 4)} | {_fmt(top1, 2)} |")
    return "\n".join(lines) + "\n"
