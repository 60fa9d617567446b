"""Speculative decoding against plain decoding, through LLM.stream as users run it.

Rows, each checked to give plain decoding's tokens (an assertion, not a sample):
  rewrite   an input-heavy task: ~1.4K tokens of Python (two functions of the standard library's
            textwrap) to rewrite without comments; plain, then ngram (prompt lookup) at each
            --tokens K, runs interleaved, best of --repeats. (The default model paraphrases prose
            it is asked to quote, so code, which it copies, is the input-heavy case it can do.)
  worst     a drafter that is always wrong (every token it proposes is refused): the cost of
            all-rejected drafts with adaptive K, against plain decoding of the same prompt
  sparse    --context tokens of text and a question; the model drafts for itself with sparse
            attention (--sparse-k, --sparse-select) and exact attention verifies: acceptance and
            speed against plain exact decoding (skipped with --context 0)
Decode tok/s is generated tokens after the first over the time after the first token (the
prefill is the same for both and is left out).

`sparrow bench speculative [--model PATH] [--tokens 2,4,8] [--context 4096] [--max-tokens 128]`

With --synth: the cost side of sparse drafting at long context on a model shape instead
(bench/speculative_cost.py): `sparrow bench speculative --synth 16384,32768 --shape qwen3-1.7b
--type q4_0 --kv-dtype f16`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import textwrap
import time

from sparrow.bench.host import cpu_info, load_avg
from sparrow.eval.prompts import meeting_minutes


def _decode_rate(llm, prompt, kw) -> tuple[float, list[int], dict | None]:
    t_first, toks, last = None, [], None
    for out in llm.stream(prompt, chat=True, **kw):
        if t_first is None:
            t_first = time.perf_counter()
        toks.append(out.token_id)
        last = out
    dt = time.perf_counter() - t_first
    return (len(toks) - 1) / dt if dt > 0 else 0.0, toks, last.speculative


def _compare(llm, name, prompt, variants, a) -> list[dict]:
    """variants: (label, stream keywords); the first is plain decoding. Interleaved runs."""
    best: dict = {}
    ref = None
    for _ in range(a.repeats):
        for label, kw in variants:
            rate, toks, counts = _decode_rate(llm, prompt, dict(kw, max_tokens=a.max_tokens, temperature=0.0))
            if ref is None:
                ref = toks
            assert toks == ref, f"{label} changed the output"
            if label not in best or rate > best[label][0]:
                best[label] = (rate, counts, len(toks))
    plain = best[variants[0][0]][0]
    rows = []
    for label, _ in variants:
        rate, counts, n = best[label]
        acc = counts["accepted_tokens"] / counts["drafted_tokens"] if counts and counts["drafted_tokens"] else None
        rows.append(
            dict(
                task=name,
                variant=label,
                tokens=n,
                tok_s=round(rate, 2),
                speedup=round(rate / plain, 3),
                drafted=counts["drafted_tokens"] if counts else 0,
                accepted=counts["accepted_tokens"] if counts else 0,
                acceptance=None if acc is None else round(acc, 3),
            )
        )
    return rows


def _worst(llm, a) -> list[dict]:
    """An always-wrong drafter, through the same generate_step as LLM.stream."""
    from sparrow.engine.generate import generate_step
    from sparrow.engine.sequence import Sequence
    from sparrow.engine.speculative import Drafter, Speculator
    from sparrow.kernels import set_threads
    from sparrow.params import SamplingParams, SpeculativeParams

    class Wrong(Drafter):
        def propose(self, seq, n):
            return [(seq.last_token + 1 + i) % 1000 + 200 for i in range(n)]

    set_threads(llm.threads)
    prompt = llm.prompt_ids(meeting_minutes(6, 1) + " Continue the minutes.", chat=True)
    sampling = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    best, ref = {}, None
    for _ in range(a.repeats):
        for label in ("plain", "always-wrong K=8"):
            seq = Sequence.create(llm.runner, llm.tokenizer, prompt, sampling, llm.ctx, llm.kv_dtype)
            spec = Speculator(SpeculativeParams("ngram", 8), Wrong()) if label != "plain" else None
            gen = generate_step(llm.runner, seq, spec=spec)
            toks = [next(gen).token_id]
            t0 = time.perf_counter()
            toks += [o.token_id for o in gen]
            rate = (len(toks) - 1) / (time.perf_counter() - t0)
            ref = ref or toks
            assert toks == ref, "the wrong drafter changed the output"
            counts = spec.counts if spec else None
            if label not in best or rate > best[label][0]:
                best[label] = (rate, counts)
    plain = best["plain"][0]
    return [
        dict(
            task="worst",
            variant=k,
            tokens=len(ref),
            tok_s=round(r, 2),
            speedup=round(r / plain, 3),
            drafted=c["drafted_tokens"] if c else 0,
            accepted=c["accepted_tokens"] if c else 0,
            acceptance=0.0 if c else None,
        )
        for k, (r, c) in best.items()
    ]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="sparrow bench speculative", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF or HF folder (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--tokens", default="2,4,8", help="draft lengths K for ngram, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--context", type=int, default=4096, help="sparse row: document tokens (0: skip the row)")
    ap.add_argument("--sparse-k", type=int, default=8)
    ap.add_argument("--sparse-select", default="seed", choices=["seed", "v2"])
    ap.add_argument("--spec-tokens", type=int, default=4, help="K of the sparse row")
    ap.add_argument("--skip", default="", help="rows to leave out: rewrite,worst,sparse")
    ap.add_argument("--kv-dtype", default="f32", choices=["f32", "f16", "int8"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="one JSON object per row instead of a table")
    g = ap.add_argument_group("the cost side at long context (bench/speculative_cost.py)")
    g.add_argument("--synth", default="", help="synthesised cache lengths, e.g. 16384,32768 (runs this instead)")
    g.add_argument("--shape", default="qwen3-1.7b", help='model shape of the cost rows (bench/shapes.py; "": --model)')
    g.add_argument("--type", default="q4_0", help="its weight type")
    g.add_argument("--activations", default="f32", choices=["f32", "q8"], help="the shape's activations mode")
    g.add_argument("--acceptance-contexts", default="4096,8192", help="prompt tokens of the acceptance runs")
    g.add_argument("--selectors", default="seed,v2", help="drafting selectors")
    g.add_argument("--draft-k", default="32,8", help="drafting blocks per head")
    g.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the cost components")
    g.add_argument("--e2e-tokens", type=int, default=16, help="tokens of the end-to-end run on the shape (0: none)")
    a = ap.parse_args(argv)
    if a.synth:
        from sparrow.bench import speculative_cost

        speculative_cost.main(a)
        return
    import sparrow

    llm = sparrow.load(a.model, threads=a.threads, kv_dtype=a.kv_dtype)
    cpu = cpu_info()
    skip = set(a.skip.split(",")) - {""}
    print(
        f"# speculative decoding: {llm.name}, KV {a.kv_dtype}, {a.threads} threads, activations {llm.model.activations}"
    )
    print(f"# CPU: {cpu.get('model', '?')}; load average at start {load_avg()}")
    rows = []
    if "rewrite" not in skip:
        code = inspect.getsource(textwrap.TextWrapper._wrap_chunks) + "\n" + inspect.getsource(textwrap.dedent)
        ask = "Rewrite this Python code with the comments removed; keep everything else exactly as it is:\n\n"
        prompt = [{"role": "user", "content": ask + code}]
        n = len(llm.prompt_ids(prompt, chat=True))
        variants = [("plain", {})] + [
            (f"ngram K={k}", {"speculative": "ngram", "spec_tokens": int(k)}) for k in a.tokens.split(",")
        ]
        rows += _compare(llm, f"rewrite ({n}-token prompt)", prompt, variants, a)
    if "worst" not in skip:
        rows += _worst(llm, a)
    if "sparse" not in skip and a.context > 0:
        text = meeting_minutes(max(1, a.context // 28), 2)
        prompt = [{"role": "user", "content": text + "\n\nWho met Hana last, and where? Then summarise the minutes."}]
        n = len(llm.prompt_ids(prompt, chat=True))
        sp = {
            "speculative": "sparse",
            "spec_tokens": a.spec_tokens,
            "spec_sparse_k": a.sparse_k,
            "spec_sparse_select": a.sparse_select,
        }
        label = f"sparse {a.sparse_select} k={a.sparse_k} K={a.spec_tokens}"
        rows += _compare(llm, f"sparse drafting ({n}-token prompt)", prompt, [("plain", {}), (label, sp)], a)
    print(f"# load average at end {load_avg()}")
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return
    print("| task | variant | tokens | decode tok/s | vs plain | drafted | accepted | acceptance |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        print(
            f"| {r['task']} | {r['variant']} | {r['tokens']} | {r['tok_s']:.1f} | {r['speedup']:.2f}x "
            f"| {r['drafted']} | {r['accepted']} | {acc} |"
        )
