"""`sparrow bench needle`: needle-in-a-haystack recall, exact vs block-sparse top-k decode attention.

The article's protocol: a chat prompt of seeded filler facts, the needle "Zara's favorite food is
ramen." at a depth (on a sentence boundary), the question at the end, greedy decoding; recall =
the answer word appears in the output. Also passkey and RULER-style tasks (--tasks). Each prompt
is prefilled once (exact) and every configuration decodes from a copy of that cache; with
--sparse-prefill every sparse configuration prefills the prompt itself with its own sparse
attention and decodes from that (exact stays exact prefill and decode).

    sparrow bench needle --lengths 1K,2K,4K --depths 25,50,75 --ks 32,8,1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from sparrow.errors import SparrowError
from sparrow.params import KV_DTYPES

DEFAULT_MODEL_TAG = "SmolLM2-135M"


def add_common_args(p: argparse.ArgumentParser, lengths: str, depths: str, ks: str, tokens: int) -> None:
    p.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument(
        "--tasks",
        default="needle",
        help="comma list of needle, passkey, niah_single, niah_multikey, niah_multivalue, niah_multiquery, vt, "
        "cwe (RULER's common-words extraction)",
    )
    p.add_argument("--lengths", default=lengths, help="prompt lengths in tokens, e.g. 1K,2K,4K,7K (K = 1024)")
    p.add_argument("--depths", default=depths, help="needle depths in percent (multi-fact tasks: one seed each)")
    p.add_argument("--ks", default=ks, help="sparse k values (blocks per head); exact always runs")
    p.add_argument("--block", type=int, default=32, help="sparse block size in tokens")
    p.add_argument("--probe", type=int, default=8, help="probe keys per block (seed selector)")
    p.add_argument(
        "--selectors",
        default="seed",
        help="comma list of block selectors run at every k: seed, v2, v2 ablations "
        "(v2-nosink, v2-norecent, v2-dense<N>), v3 (v3-p<P>: top-p with at most k blocks, v3-p<P>-min<N>), "
        "and oracle (each head's k blocks of largest exact softmax mass, v2's dense layers; a reference that reads "
        "every key, sparrow_lab.eval.oracle)",
    )
    p.add_argument(
        "--sparse-prefill",
        action="store_true",
        help="every sparse configuration also prefills its prompt with its sparse attention (SparseParams.prefill), "
        "so it is measured against exact prefill and decode (not with the oracle)",
    )
    p.add_argument("--seed", type=int, default=0, help="prompt seed (0 = Zara/ramen)")
    p.add_argument("--max-tokens", type=int, default=tokens, help="greedy tokens generated per configuration")
    p.add_argument(
        "--answer-prefix",
        choices=["auto", "on", "off"],
        default="auto",
        help="pre-fill the assistant turn with the answer's opening (auto: on for SmolLM2-135M)",
    )
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="f32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="output directory (default runs/<bench>-<timestamp>/)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--from-json", default=None, help="re-render the table and plots of a finished run's JSON")


def _ints(s: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SparrowError(f"--{what} takes a comma list of integers, got {s!r}") from None
    if not vals:
        raise SparrowError(f"--{what} is empty")
    return vals


def parse_grid(a) -> dict:
    from sparrow.params import SparseParams
    from sparrow_lab.eval.oracle import is_oracle, oracle_from_label
    from sparrow_lab.eval.prompts import TASKS, parse_length

    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    for t in tasks:
        if t not in TASKS:
            raise SparrowError(f"unknown task {t!r} (choose from {', '.join(TASKS)})")
    depths = _ints(a.depths, "depths")
    if any(not 0 <= d <= 100 for d in depths):
        raise SparrowError("--depths are percentages in 0..100")
    ks = sorted(set(_ints(a.ks, "ks")), reverse=True) if a.ks.strip() else []
    if a.max_tokens < 2:
        raise SparrowError("--max-tokens must be at least 2")
    selectors = [x.strip() for x in a.selectors.split(",") if x.strip()]
    if not selectors:
        raise SparrowError("--selectors is empty")
    if a.sparse_prefill and any(is_oracle(s) for s in selectors):
        raise SparrowError(
            "--selectors oracle cannot be combined with --sparse-prefill: the oracle chooses blocks for decode only"
        )

    def params(sel, k):
        if is_oracle(sel):
            return oracle_from_label(sel, k=k, block=a.block, probe=a.probe)
        return SparseParams.from_label(sel, k=k, block=a.block, probe=a.probe, prefill=a.sparse_prefill)

    configs = [None] + [params(sel, k) for sel in selectors for k in ks]
    return {
        "tasks": tasks,
        "lengths": [parse_length(x) for x in a.lengths.split(",") if x.strip()],
        "depths": [d / 100 for d in depths],
        "configs": configs,
    }


def use_prefix(a, llm) -> bool:
    if a.answer_prefix != "auto":
        return a.answer_prefix == "on"
    return a.model is None or DEFAULT_MODEL_TAG.lower() in (llm.name or "").lower()


def warm_up(llm, configs) -> None:
    """Compiles (or loads from numba's cache) every kernel before anything is timed."""
    from sparrow_lab.eval.fidelity import run_prompt

    ids = llm.tokenizer.encode("The library in Oakton opens at 9 am. " * 12)
    run_prompt(llm, ids, configs, n_tokens=3, fidelity=True)


def sweep(
    llm, grid: dict, seed: int, max_tokens: int, prefix: bool, fidelity: bool = True, desc: str = ""
) -> list[dict]:
    """Every task x length x depth prompt, every configuration; one row per (prompt, config)."""
    from tqdm import tqdm

    from sparrow_lab.eval.fidelity import prefill, run_prompt
    from sparrow_lab.eval.prompts import make_prompt
    from sparrow_lab.eval.scoring import repetition_ratio, score

    cases = [(t, L, i, d) for t in grid["tasks"] for L in grid["lengths"] for i, d in enumerate(grid["depths"])]
    for _, L, _, _ in cases:
        if L + max_tokens + 8 > llm.ctx:
            raise SparrowError(f"length {L} + {max_tokens} tokens exceeds the context {llm.ctx}")
    rows = []
    bar = tqdm(cases, desc=desc or "prompts", unit="prompt", file=sys.stderr)
    for task, L, i, d in bar:
        single = task in ("needle", "passkey", "niah_single")
        p = make_prompt(llm.tokenizer, task, L, d if single else None, seed if single else seed + i, prefix)
        if abs(p.n_tokens - L) > 0.05 * L:
            raise SparrowError(f"{task} prompt has {p.n_tokens} tokens, more than 5% off the target {L}")
        bar.set_postfix_str(f"{task} {p.n_tokens} tok depth {d:.0%}")
        pre = prefill(llm, p.ids, max_tokens)
        for r in run_prompt(llm, p.ids, grid["configs"], max_tokens, fidelity, pre=pre):
            r.update(
                {
                    "task": task,
                    "target_tokens": L,
                    "depth": d if single else None,
                    "seed": p.meta["seed"],
                    "answers": p.answers,
                    "assistant_prefix": p.assistant_prefix,
                    "score": score(task, r["text"], p.answers),
                    "repetition": repetition_ratio(r["text"]),
                }
            )
            r.pop("tokens", None)
            rows.append(r)
    return rows


def run(a, bench: str, fidelity: bool, title: str, argv=None) -> dict:
    """Loads the model, sweeps, writes <bench>.json, <bench>.md and the plots (optional: without
    matplotlib they are skipped with a notice); returns the record.
    With --from-json, only re-renders the table and plots of a finished run."""
    from sparrow import api
    from sparrow_lab.eval import report

    if a.from_json:
        try:
            record = json.load(open(a.from_json))
        except (OSError, ValueError) as e:
            raise SparrowError(f"cannot read {a.from_json}: {e}") from None
        return write_outputs(record, a.out or os.path.dirname(a.from_json) or ".", title, not a.no_plots)
    grid = parse_grid(a)
    out = report.run_dir(bench, a.out)
    t0 = time.time()
    llm = api.load(a.model, kv_dtype=a.kv_dtype, threads=a.threads, ctx=None)
    prefix = use_prefix(a, llm)
    warm_up(llm, grid["configs"])
    rows = sweep(llm, grid, a.seed, a.max_tokens, prefix, fidelity, desc=bench)
    record = {
        "bench": bench,
        "argv": list(sys.argv[1:] if argv is None else argv),
        "model": llm.name,
        "kv_dtype": llm.kv_dtype,
        "threads": llm.threads,
        "answer_prefix": prefix,
        "seed": a.seed,
        "max_tokens": a.max_tokens,
        "block": a.block,
        "probe": a.probe,
        "sparse_prefill": a.sparse_prefill,
        "tasks": grid["tasks"],
        "lengths": grid["lengths"],
        "depths": grid["depths"],
        "ks": sorted({c.k for c in grid["configs"] if c is not None}, reverse=True),
        "selectors": list(dict.fromkeys(c.label for c in grid["configs"] if c is not None)),
        "environment": report.environment(),
        "wall_s": round(time.time() - t0, 1),
        "summary": report.summary_rows(rows),
        "rows": rows,
    }
    return write_outputs(record, out, title, not a.no_plots)


def write_outputs(record: dict, out: str, title: str, plots: bool = True) -> dict:
    from sparrow_lab.eval import report

    bench, rows = record["bench"], record["rows"]
    os.makedirs(out, exist_ok=True)
    header = (
        f"{title}: model {record['model']}, kv {record['kv_dtype']}, {record['threads']} threads, answer prefix "
        f"{'on' if record['answer_prefix'] else 'off'}, {record['max_tokens']} greedy tokens, block "
        f"{record['block']}, probe {record['probe']}"
        + (
            "; sparse prefill on (each sparse configuration prefilled its prompt with its own selection; exact: "
            "exact prefill and decode)"
            if record.get("sparse_prefill")
            else ""
        )
        + "; ms/token = median decode step; load average at the end "
        f"{[round(x, 1) for x in record['environment']['loadavg'] or []]}; wall {record['wall_s']} s"
    )
    # the record first, so that nothing in the reporting below can lose it
    record["outputs"] = {"dir": out, "json": f"{bench}.json", "markdown": f"{bench}.md", "plots": []}
    report.write_json(os.path.join(out, f"{bench}.json"), record)
    md = report.write_markdown(os.path.join(out, f"{bench}.md"), rows, title, header)
    if bench == "fidelity":
        with open(md, "a") as f:
            f.write("\n" + report.mass_table(rows))
    if record.get("sparse_prefill"):
        with open(md, "a") as f:
            f.write("\n" + report.sparse_prefill_table(rows))
    print(open(md).read())
    pngs = report.plots_or_notice(os.path.join(out, ""), rows) if plots else []
    if pngs:
        record["outputs"]["plots"] = [os.path.basename(p) for p in pngs]
        report.write_json(os.path.join(out, f"{bench}.json"), record)
    print(f"wrote {out}/")
    return record


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="sparrow bench needle", description=__doc__.split("\n\n")[0])
    add_common_args(p, lengths="1K,2K,4K,7K", depths="10,20,30,40,50,60,70,80,90", ks="32,16,8,4,2,1", tokens=16)
    p.add_argument("--no-fidelity", action="store_true", help="skip the teacher-forced KL/top-1/mass pass")
    a = p.parse_args(argv)
    return run(a, "needle", not a.no_fidelity, "Needle retrieval", argv)


if __name__ == "__main__":
    main()
