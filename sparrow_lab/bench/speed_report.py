"""`sparrow bench speed`'s results: medians over rounds, the roofline (bytes a token reads
against the measured bandwidth), and the markdown report with its header."""

import os
import statistics

from sparrow.kernels import cpu as kernel_cpu
from sparrow_lab.bench import bandwidth
from sparrow_lab.bench.engines import MODES

LABELS = {
    "exact": "exact, f32 KV",
    "sparse": "sparse k={k}, f32 KV",
    "f16": "exact, f16 KV",
    "sparse_f16": "sparse k={k}, f16 KV",
    "int8": "exact, int8 KV",
    "sparse_int8": "sparse k={k}, int8 KV",
    "q8_f16": "exact, f16 KV, q8 activations",
    "sparse_q8_f16": "sparse k={k}, f16 KV, q8 activations",
}


def median(xs):
    return statistics.median(xs) if xs else None


def summarise(rounds, contexts, modes, compare):
    """Medians over rounds: prefill tok/s, decode tok/s per mode, paired ratios."""
    table = {}
    for c in contexts:
        s_runs = [r["sparrow"][c] for r in rounds]
        row = {"prefill_tok_s": median([c / r["prefill_s"] for r in s_runs])}
        if "prefill_q8_s" in s_runs[0]:
            row["prefill_q8_tok_s"] = median([c / r["prefill_q8_s"] for r in s_runs])
        for m in modes:
            row[f"decode_{m}_tok_s"] = median([1e3 / r[m]["ms"] for r in s_runs])
            row[f"split_{m}"] = {k: median([r[m]["split"][k] for r in s_runs]) for k in s_runs[0][m]["split"]}
            row[f"kv_bytes_per_token_{m}"] = s_runs[0][m]["kv"]["kv_bytes_per_token"]
            row[f"copy_bytes_per_position_{m}"] = s_runs[0][m]["kv"]["probe_copy_bytes_per_token"]
        if "sparse" in modes:
            row["probe_copy_bytes_per_token"] = s_runs[0]["sparse"]["kv"]["probe_copy_bytes_per_token"]
        for name in STREAM_ROWS:
            if name in s_runs[0]:
                row[f"{name}_tok_s"] = median([1e3 / r[name]["ms"] for r in s_runs])
                row[f"{name}_cached_tokens"] = min(r[name]["cached_tokens"] for r in s_runs)
                row[f"{name}_loop_tok_s"] = median([r[name]["loop_tok_s"] for r in s_runs])
                row[f"{name}_end_ms"] = median([r[name]["end_ms"] for r in s_runs])
        for name in ("exact", "sparse"):
            if f"stream_{name}_fresh" in s_runs[0]:
                row[f"stream_{name}_fresh_vs_cached"] = median(
                    [r[f"stream_{name}_cached"]["ms"] / r[f"stream_{name}_fresh"]["ms"] for r in s_runs]
                )
        if "int8" in modes:
            row["int8_vs_f32"] = median([r["exact"]["ms"] / r["int8"]["ms"] for r in s_runs])
        if compare:
            l_runs = [r["llama"][c] for r in rounds]
            row["llama_prefill_tok_s"] = median([c / r["prefill_s"] for r in l_runs])
            row["llama_decode_tok_s"] = median([1e3 / r["exact"]["ms"] for r in l_runs])
            row["ratio_prefill"] = median([lr["prefill_s"] / sr["prefill_s"] for sr, lr in zip(s_runs, l_runs)])
            if "prefill_q8_tok_s" in row:
                pairs = zip(s_runs, l_runs)
                row["ratio_prefill_q8"] = median([lr["prefill_s"] / sr["prefill_q8_s"] for sr, lr in pairs])
            for m in modes:
                row[f"ratio_decode_{m}"] = median([lr["exact"]["ms"] / sr[m]["ms"] for sr, lr in zip(s_runs, l_runs)])
        table[c] = row
    return table


STREAM_ROWS = ("stream_exact_fresh", "stream_exact_cached", "stream_sparse_fresh", "stream_sparse_cached")


def roofline(table, config, weights, gb_s, sparse_k, select, llama_kv="f16"):
    """Adds to each row the bytes a decode token reads (weights + KV, MB) and the fraction of the
    measured read bandwidth reached, per sparrow decode mode and for llama.cpp (f16 KV, all
    positions). Rows stay as they were when the weights' bytes are unknown."""
    from sparrow.params import SparseParams

    if not weights:
        return
    sp = SparseParams(k=sparse_k, select=select)
    for c, row in table.items():
        for m in MODES:
            tok_s = row.get(f"decode_{m}_tok_s")
            if tok_s is None:
                continue
            kv_dtype, sparse, _ = MODES[m]
            copy = row.get(f"copy_bytes_per_position_{m}", 0.0) if sparse else 0.0
            total = weights + bandwidth.kv_read_bytes(config, c, kv_dtype, sp if sparse else None, copy)
            row[f"read_mb_{m}"] = total / 1e6
            row[f"bandwidth_{m}"] = bandwidth.fraction(total, tok_s, gb_s)
        if row.get("llama_decode_tok_s"):
            total = weights + bandwidth.kv_read_bytes(config, c, llama_kv)
            row["llama_read_mb"] = total / 1e6
            row["llama_bandwidth"] = bandwidth.fraction(total, row["llama_decode_tok_s"], gb_s)


def header(rec) -> list[str]:
    """Markdown lines above the table: model, CPU, versions, settings, load averages, warning."""
    cfg, cpu, ver = rec["config"], rec.get("cpu") or {}, rec.get("versions") or {}
    model = os.path.basename(cfg["model"])
    if cfg.get("shape"):
        model += f" (random weights, {cfg['shape']} shapes, {cfg['type']})"
    ext = ", ".join(cpu.get("extensions") or []) or "none detected"
    l2 = f", L2 {cpu['l2_per_core']} per core" if cpu.get("l2_per_core") else ""
    lines = [
        f"Model `{model}`, {cfg['threads']} threads each, {cfg['rounds']} rounds, "
        f"{cfg['decode']} decode tokens per point.",
        "",
        f"CPU: {cpu.get('model', '?')} ({cpu.get('cpus', os.cpu_count())} CPUs{l2}); vector extensions: {ext}.",
        "",
        *([kernel_cpu.paths_line(rec["paths"]), ""] if rec.get("paths") else []),
        *(
            [f"sparrow's default activations for this file on this CPU: {da['mode']} ({da['why']}).", ""]
            if (da := rec.get("default_activations"))
            else []
        ),
        f"Load average (1 min): {rec['load_start']} at start, {rec.get('load_end', '-')} at end"
        + (" (1/5/15 min at start: {}/{}/{})".format(*rec["loadavg_start"]) if rec.get("loadavg_start") else "")
        + (
            f"; CPUs {rec['cpu_busy_start']:.0%} busy in the second before the start."
            if rec.get("cpu_busy_start") is not None
            else "."
        ),
    ]
    if rec.get("busy_warning"):
        lines += ["", f"**Warning: {rec['busy_warning']}**"]
    engines = f"sparrow {ver.get('sparrow', '?')} (numba {ver.get('numba', '?')})"
    ls = rec.get("llama_settings")
    if cfg["compare"] and ls:
        engines += (
            f"; llama.cpp via llama-cpp-python {ver.get('llama_cpp_python', '?')} at its defaults: "
            f"flash attention {ls['flash_attn']}, {ls['type_k']}/{ls['type_v']} KV, n_batch "
            f"{ls['n_batch']}, OMP_WAIT_POLICY {ls['omp_wait_policy']}"
        )
        if not ls.get("repack", True):
            engines += ", but its CPU repack buffer off (--llama-no-repack: weights read from the file mapping)"
        if ver.get("llama_cpp_system_info"):
            engines += f" (build: `{ver['llama_cpp_system_info']}`)"
    lines += ["", f"Engines: {engines}.", ""]
    bw = rec.get("bandwidth")
    if bw:
        weights = rec.get("weight_bytes")
        lines += [
            f"Read bandwidth: {bw['gb_s']:.1f} GB/s (a sum over {bw['buffer_mib']:.0f} MiB on {bw['threads']} "
            f"threads, best of {bw['passes']}). A decode token reads "
            + (f"{weights / 1e6:.0f} MB of weights" if weights else "weights of unknown size")
            + " plus its KV rows; each decode cell gives those bytes and the share of the bandwidth they reach.",
            "",
        ]
    return lines


def _roof(mb, frac) -> str:
    """' (X MB read a token, Y% of the read bandwidth)' for a decode cell, '' when unknown."""
    return "" if mb is None or frac is None else f" ({mb:.4g} MB/token, {frac:.0%} of bandwidth)"


def markdown(rec):
    t, cmp = rec["table"], rec["config"]["compare"]
    f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = header(rec) + [
        "| context | metric | sparrow | llama.cpp (exact) | sparrow / llama.cpp |",
        "|---|---|---|---|---|",
    ]
    for c, row in t.items():
        lines.append(
            f"| {c} | prefill tok/s | {f(row['prefill_tok_s'])} | {f(row.get('llama_prefill_tok_s'))} "
            f"| {f(row.get('ratio_prefill'), 2)} |"
        )
        if "prefill_q8_tok_s" in row:
            lines.append(
                f"| {c} | prefill tok/s, q8 activations | {f(row['prefill_q8_tok_s'])} | "
                f"{f(row.get('llama_prefill_tok_s'))} | {f(row.get('ratio_prefill_q8'), 2)} |"
            )
        for m in MODES:
            label = "decode tok/s, " + LABELS[m].format(k=rec["config"]["sparse_k"])
            if rec["config"].get("sparse_select", "seed") != "seed":
                label = label.replace("sparse k=", f"sparse {rec['config']['sparse_select']} k=")
            if f"decode_{m}_tok_s" in row:
                llama = f(row.get("llama_decode_tok_s")) + _roof(row.get("llama_read_mb"), row.get("llama_bandwidth"))
                mine = f(row[f"decode_{m}_tok_s"]) + _roof(row.get(f"read_mb_{m}"), row.get(f"bandwidth_{m}"))
                lines.append(
                    f"| {c} | {label} | {mine} | {llama if cmp else '-'} | {f(row.get(f'ratio_decode_{m}'), 2)} |"
                )
        for name in ("exact", "sparse"):
            if f"stream_{name}_fresh_tok_s" in row:
                cfg = rec["config"]
                what = "exact" if name == "exact" else f"sparse {cfg.get('sparse_select', 'seed')} k={cfg['sparse_k']}"
                lines.append(
                    f"| {c} | decode tok/s through LLM.stream, {what}, f32 KV: fresh prompt / same prompt again "
                    f"({row[f'stream_{name}_cached_cached_tokens']} tokens from the prefix cache) | "
                    f"{f(row[f'stream_{name}_fresh_tok_s'])} / {f(row[f'stream_{name}_cached_tok_s'])} "
                    f"(fresh = {f(row[f'stream_{name}_fresh_vs_cached'], 2)}x cached) | | |"
                )
                lines.append(
                    f"| {c} | the same, as a loop over the stream sees it (to the stream's end): tok/s, and ms "
                    f"from the last token to the end, fresh / again | {f(row[f'stream_{name}_fresh_loop_tok_s'])} / "
                    f"{f(row[f'stream_{name}_cached_loop_tok_s'])}; {f(row[f'stream_{name}_fresh_end_ms'], 0)} / "
                    f"{f(row[f'stream_{name}_cached_end_ms'], 0)} ms | | |"
                )
        sp = row["split_exact"]
        lines.append(
            f"| {c} | exact decode ms/token, staged path (timed by stage): matmul / attention / other | "
            f"{f(sp['matmul_ms'])} / {f(sp['attention_ms'])} / {f(sp['other_ms'])} | | |"
        )
        if "int8_vs_f32" in row:
            lines.append(
                f"| {c} | int8 KV speed vs f32 KV; KV bytes/token int8 / f32 | "
                f"{f(row['int8_vs_f32'], 2)}x; {row['kv_bytes_per_token_int8']:.0f} / "
                f"{row['kv_bytes_per_token_exact']:.0f} | | |"
            )
        if row.get("probe_copy_bytes_per_token"):
            lines.append(
                f"| {c} | sparse probe-key copy, bytes/token (f32 KV) | {row['probe_copy_bytes_per_token']:.0f} | | |"
            )
    st = rec.get("startup") or {}
    for k in ("cold", "warm"):
        s = st.get(k, {})
        if "load_s" in s:
            lines.append(
                f"| start | {k} numba cache: load / first prefill / first token (s) | "
                f"{s['load_s']:.1f} / {s['first_prefill_s']:.1f} / {s['first_decode_s']:.1f} | | |"
            )
    w, lw = st.get("warm", {}), st.get("llama", {})
    if "rss_loaded_mb" in w:
        lines.append(
            f"| memory | peak RSS MiB: python+imports -> loaded (GGUF {rec['gguf_mb']:.0f} MiB) | "
            f"{w['rss_python_mb']:.0f} -> {w['rss_loaded_mb']:.0f} | "
            f"{f(lw.get('rss_python_mb'), 0)} -> {f(lw.get('rss_loaded_mb'), 0)} | |"
        )
        if w.get("rss_now_mb"):
            lines.append(f"| memory | RSS MiB after load (not peak) | {w['rss_now_mb']:.0f} | | |")
        if w.get("rss_after_forward_mb"):
            lines.append(
                f"| memory | RSS MiB after the first forward: total / model file pages / LLVM code | "
                f"{w['rss_after_forward_mb']:.0f} / {f(w.get('rss_model_file_mb'), 0)} / "
                f"{f(w.get('rss_llvm_mb'), 0)} | | |"
            )
    ct = rec.get("contention")
    if ct:
        lines.append(
            f"| {ct['context']} | CONTENTION (one busy-looping process running; load "
            f"{ct['load_start']} -> {ct['load_end']}): decode tok/s, exact, f32 KV | "
            f"{f(ct.get('sparrow_tok_s'))} | {f(ct.get('llama_tok_s'))} | {f(ct.get('ratio'), 2)} |"
        )
    return "\n".join(lines)
