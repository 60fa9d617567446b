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

--compare llama-cpp adds llama.cpp (llama-cpp-python) to the rewrite row: the same GGUF at the
bindings' defaults but the thread count (as `sparrow bench speed` runs it: f16 KV), the same
chat-formatted prompt token ids, greedy through Llama.generate, stopping at sparrow's stop tokens
or --max-tokens; plain, and prompt lookup (LlamaPromptLookupDecoding, num_pred_tokens K) at each
--tokens K and the bindings' default K. Its runs are interleaved with sparrow's in the same
rounds (the engines' order flipped every other round), best of --repeats, decode tok/s computed
by the same function. The table adds each engine's ratio to its own plain decoding, each sparrow
row's ratio to llama.cpp's of the same K, sparrow / llama.cpp for plain and for each engine's
fastest speculative setting, and whether llama.cpp's lookup output equals its plain output
(reported, not asserted: the bindings do not promise it). Drafted and accepted tokens of a lookup
run are counted from its proposals against its output (a greedy draft token is kept when the
output repeats it).

`sparrow bench speculative [--model PATH] [--tokens 2,4,8] [--context 4096] [--max-tokens 128]
[--compare llama-cpp] [--json]`

With --synth: the cost side of sparse drafting at long context on a model shape instead
(bench/speculative_cost.py): `sparrow bench speculative --synth 16384,32768 --shape qwen3-1.7b
--type q4_0 --kv-dtype f16`. With --draft-shape: the cost side of a draft model, one shape
drafting for another: `sparrow bench speculative --draft-shape qwen3-0.6b --shape qwen3-4b --type q4_0`.
With --mtp: the cost side of Qwen3.5's own MTP layer on a Qwen3.5 shape (a synthetic layer at its
sizes): `sparrow bench speculative --mtp --shape qwen3.5-0.8b --type q8_0`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import textwrap
import time

from sparrow.errors import SparrowError
from sparrow_lab.bench.host import cpu_info, load_avg, versions
from sparrow_lab.eval.prompts import meeting_minutes


def _timed(outputs) -> tuple[float, list]:
    """Decode tok/s of a stream of outputs, the same for both engines: the outputs after the first
    over the time after the first (the prefill before it is left out); and the outputs."""
    t_first, out = None, []
    for x in outputs:
        if t_first is None:
            t_first = time.perf_counter()
        out.append(x)
    dt = time.perf_counter() - t_first
    return ((len(out) - 1) / dt if dt > 0 else 0.0), out


def _sparrow(llm, prompt, kw, max_tokens):
    """A variant's run through LLM.stream, greedy: () -> (decode tok/s, tokens, speculative counts)."""

    def run():
        rate, outs = _timed(llm.stream(prompt, chat=True, **dict(kw, max_tokens=max_tokens, temperature=0.0)))
        return rate, [o.token_id for o in outs], outs[-1].speculative

    return run


def _row(task, engine, variant, tokens, rate, plain, counts, same=True) -> dict:
    acc = counts["accepted_tokens"] / counts["drafted_tokens"] if counts and counts["drafted_tokens"] else None
    return dict(
        task=task,
        engine=engine,
        variant=variant,
        tokens=tokens,
        tok_s=round(rate, 2),
        speedup=round(rate / plain, 3),
        drafted=counts["drafted_tokens"] if counts else 0,
        accepted=counts["accepted_tokens"] if counts else 0,
        acceptance=None if acc is None else round(acc, 3),
        same_as_plain=same,  # sparrow's rows are asserted to be
        vs_llama_cpp=None,  # sparrow's rate over llama.cpp's of the same K (cross_engine)
    )


def _compare(name, engines, a) -> tuple[list[dict], dict]:
    """engines: {engine: [(label, run)]}, each engine's first variant its plain decoding; run() ->
    (decode tok/s, tokens, counts). Every variant runs once a round, the engines' order flipped
    every other round (load drift hits both); the best of --repeats is kept. sparrow's variants
    must give its plain tokens (an assertion); another engine's are compared with its plain ones
    and the answer reported (same_as_plain). Returns the rows and each engine's plain tokens."""
    best, ref, same = {}, {}, {}
    order = list(engines)
    for i in range(a.repeats):
        for engine in order if i % 2 == 0 else order[::-1]:
            for label, run in engines[engine]:
                rate, toks, counts = run()
                ref.setdefault(engine, toks)  # the plain variant runs first
                key = (engine, label)
                if engine == "sparrow":
                    assert toks == ref[engine], f"{label} changed the output"
                same[key] = same.get(key, True) and toks == ref[engine]
                if key not in best or rate > best[key][0]:
                    best[key] = (rate, counts, len(toks))
    rows = []
    for engine, variants in engines.items():
        plain = best[(engine, variants[0][0])][0]
        for label, _ in variants:
            rate, counts, n = best[(engine, label)]
            rows.append(_row(name, engine, label, n, rate, plain, counts, same[(engine, label)]))
    return rows, ref


class CountingDrafter:
    """A llama-cpp-python draft model (called with the token ids so far, returning the ids it
    proposes next) that records its proposals, so that a greedy run's drafted and accepted tokens
    can be counted afterwards: a proposal's accepted tokens are those the output repeats from its
    position on (the bindings keep a drafted token when the greedy sample there equals it)."""

    def __init__(self, inner):
        self.inner = inner
        self.proposals: list[tuple[int, list[int]]] = []  # (position of the first drafted token, ids)

    def __call__(self, input_ids, /, **kwargs):
        draft = self.inner(input_ids, **kwargs)
        self.proposals.append((len(input_ids), [int(t) for t in draft]))
        return draft

    def counts(self, n_prompt, out) -> dict:
        """out: the generated tokens, the first at position n_prompt."""
        drafted = accepted = 0
        for pos, draft in self.proposals:
            drafted += len(draft)
            for j, t in enumerate(draft):
                i = pos - n_prompt + j
                if i >= len(out) or out[i] != t:
                    break
                accepted += 1
        return {"drafted_tokens": drafted, "accepted_tokens": accepted}


def _lookup_drafter():
    """llama-cpp-python's prompt lookup drafter class, or a one-line error without the package."""
    try:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except (ImportError, OSError):
        raise SparrowError(
            "--compare llama-cpp needs llama-cpp-python, which is not importable here (pip install llama-cpp-python)"
        ) from None
    return LlamaPromptLookupDecoding


def lookup_lengths(ks, default) -> list[int]:
    """llama.cpp's num_pred_tokens: each --tokens K and the bindings' default."""
    return sorted(set(ks) | {default})


class LlamaRewrite:
    """llama.cpp's side of the rewrite row (--compare llama-cpp): the prompt's token ids, greedy,
    through the bindings' Llama.generate, plain and with prompt lookup (LlamaPromptLookupDecoding
    at its default max_ngram_size, num_pred_tokens K). Two of LlamaRunner's Llamas (the bindings'
    defaults but the thread count; f16 KV): a plain one, as plain decoding runs without a drafter,
    and one with the drafter, with which the bindings compute every row's logits."""

    def __init__(self, path, threads, ids, max_tokens, ks, eos_ids):
        from sparrow_lab.bench.engines import LlamaRunner

        lookup = _lookup_drafter()
        self.default_k = inspect.signature(lookup).parameters["num_pred_tokens"].default
        self.ks = lookup_lengths(ks, self.default_k)
        capacity = len(ids) + max_tokens + max(self.ks) + 16  # room for the last drafts, never cut
        self.drafters = {k: CountingDrafter(lookup(num_pred_tokens=k)) for k in self.ks}
        self.plain = LlamaRunner(path, threads, capacity)
        self.spec = LlamaRunner(path, threads, capacity, draft_model=self.drafters[self.ks[0]])
        self.settings = self.plain.settings
        self.eos_ids = set(eos_ids)  # sparrow's stop tokens: both engines stop where the other would

    def variant(self, ids, k, max_tokens):
        """() -> (decode tok/s, tokens, counts) of plain decoding (k None) or lookup K=k."""

        def run():
            drafter = None if k is None else self.drafters[k]
            llm = (self.plain if k is None else self.spec).llm
            if drafter is not None:
                llm.draft_model = drafter
                drafter.proposals.clear()
            llm.reset()  # a full prefill every run, none reused: the same bits every run
            rate, toks = _timed(self._tokens(llm, ids, max_tokens))
            return rate, toks, None if drafter is None else drafter.counts(len(ids), toks)

        return run

    def _tokens(self, llm, ids, max_tokens):
        gen = llm.generate(ids, temp=0.0)  # greedy; generate's repeat_penalty is 1.0 (off)
        try:
            for n, tok in enumerate(gen, 1):
                yield int(tok)
                if tok in self.eos_ids or n >= max_tokens:
                    return
        finally:
            gen.close()


def cross_engine(rows) -> dict | None:
    """sparrow / llama.cpp on the rows of a task both ran: each sparrow row's rate over llama.cpp's
    of the same K (plain over plain, ngram K over lookup K; set as the row's vs_llama_cpp) and the
    summary: plain over plain, sparrow's fastest speculative row over llama.cpp's fastest, and
    whether each llama.cpp lookup gave its plain output. None without llama.cpp's rows."""
    llama = {r["variant"]: r for r in rows if r["engine"] == "llama.cpp"}
    if not llama:
        return None
    mine = [r for r in rows if r["engine"] == "sparrow" and r["task"] == next(iter(llama.values()))["task"]]
    for r in mine:
        other = llama.get(r["variant"].replace("ngram", "lookup"))
        if other and other["tok_s"] > 0:
            r["vs_llama_cpp"] = round(r["tok_s"] / other["tok_s"], 3)

    def fastest(rs):
        return max((r for r in rs if r["variant"] != "plain"), key=lambda r: r["tok_s"], default=None)

    best_s, best_l = fastest(mine), fastest(llama.values())
    plain_s = next(r for r in mine if r["variant"] == "plain")
    return dict(
        task=plain_s["task"],
        compare="llama-cpp",
        plain=plain_s["vs_llama_cpp"],
        sparrow_plain_tok_s=plain_s["tok_s"],
        llama_cpp_plain_tok_s=llama["plain"]["tok_s"],
        best_speculative=round(best_s["tok_s"] / best_l["tok_s"], 3) if best_s and best_l and best_l["tok_s"] else None,
        sparrow_best=best_s and best_s["variant"],
        sparrow_best_tok_s=best_s and best_s["tok_s"],
        llama_cpp_best=best_l and best_l["variant"],
        llama_cpp_best_tok_s=best_l and best_l["tok_s"],
        llama_cpp_same_as_plain={v: r["same_as_plain"] for v, r in llama.items() if v != "plain"},
    )


def common_start(a, b) -> int:
    """How many leading tokens two outputs share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _worst(llm, a) -> list[dict]:
    """An always-wrong drafter, through the same generate_step as LLM.stream."""
    from sparrow.engine.generate import generate_step
    from sparrow.engine.sequence import Sequence
    from sparrow.engine.speculative import Drafter, Speculator
    from sparrow.kernels.runtime import set_threads
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
    return [_row("worst", "sparrow", k, len(ref), r, plain, c) for k, (r, c) in best.items()]


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
    ap.add_argument(
        "--compare",
        choices=["llama-cpp"],
        help="rewrite row: also llama.cpp (llama-cpp-python), plain and prompt lookup at each K and its default K",
    )
    ap.add_argument(
        "--json", action="store_true", help="one JSON object per row (then --compare's summary) instead of a table"
    )
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
    g = ap.add_argument_group("the cost side of a draft model (bench/speculative_cost.py)")
    g.add_argument("--draft-shape", default="", help="a smaller shape drafting for --shape (runs this instead)")
    g.add_argument("--draft-type", default="q8_0", help="its weight type")
    g.add_argument("--draft-model", default="", help="a model drafting for --shape instead of --draft-shape")
    g.add_argument("--draft-context", type=int, default=512, help="positions before the measured steps")
    g.add_argument("--mtp", action="store_true", help="the cost side of Qwen3.5's MTP layer on --shape instead")
    a = ap.parse_args(argv)
    skip = set(a.skip.split(",")) - {""}
    if a.compare:
        if a.synth:
            raise SparrowError("--compare llama-cpp measures the rewrite row, not the --synth rows")
        if "rewrite" in skip:
            raise SparrowError("--compare llama-cpp measures the rewrite row: do not --skip it")
        _lookup_drafter()  # the missing package is an error before anything loads
    if a.draft_shape and a.draft_model:
        raise SparrowError("give --draft-shape or --draft-model, not both")
    if a.synth and (a.draft_shape or a.draft_model):
        raise SparrowError("give --synth or --draft-shape / --draft-model, not both")
    if a.mtp:
        from sparrow_lab.bench import speculative_cost

        speculative_cost.mtp_cost(a)
        return
    if a.draft_shape or a.draft_model:
        from sparrow_lab.bench import speculative_cost

        speculative_cost.draft_model_cost(a)
        return
    if a.synth:
        from sparrow_lab.bench import speculative_cost

        speculative_cost.main(a)
        return
    import sparrow

    ks = draft_lengths(a.tokens)
    path = a.model
    if a.compare:
        from sparrow.loaders import default_model_path

        path = path or default_model_path()
        if not (os.path.isfile(path) and path.lower().endswith(".gguf")):
            raise SparrowError(f"--compare llama-cpp needs a GGUF file for both engines, not {path}")
    llm = sparrow.load(path, threads=a.threads, kv_dtype=a.kv_dtype)
    cpu = cpu_info()
    print(
        f"# speculative decoding: {llm.name}, KV {a.kv_dtype}, {a.threads} threads, activations {llm.model.activations}"
    )
    print(f"# CPU: {cpu.get('model', '?')}; load average at start {load_avg()}")
    rows, summary = [], None
    if "rewrite" not in skip:
        code = inspect.getsource(textwrap.TextWrapper._wrap_chunks) + "\n" + inspect.getsource(textwrap.dedent)
        ask = "Rewrite this Python code with the comments removed; keep everything else exactly as it is:\n\n"
        prompt = [{"role": "user", "content": ask + code}]
        ids = llm.prompt_ids(prompt, chat=True)
        engines = {
            "sparrow": [("plain", _sparrow(llm, prompt, {}, a.max_tokens))]
            + [
                (f"ngram K={k}", _sparrow(llm, prompt, {"speculative": "ngram", "spec_tokens": k}, a.max_tokens))
                for k in ks
            ]
        }
        if a.compare:
            lr = LlamaRewrite(path, a.threads, ids, a.max_tokens, ks, llm.tokenizer.eos_token_ids)
            ver = versions(True).get("llama_cpp_python")
            st = lr.settings
            print(
                f"# llama.cpp: llama-cpp-python {ver or '?'} at its defaults but the thread count (KV {st['type_k']}, "
                f"flash attention {st['flash_attn']}, n_batch {st['n_batch']}, {st['n_threads']} threads); "
                f"the same prompt token ids, greedy, Llama.generate; lookup K: LlamaPromptLookupDecoding("
                f"num_pred_tokens=K), K={lr.default_k} its default"
            )
            engines["llama.cpp"] = [("plain", lr.variant(ids, None, a.max_tokens))] + [
                (f"lookup K={k}", lr.variant(ids, k, a.max_tokens)) for k in lr.ks
            ]
        task = f"rewrite ({len(ids)}-token prompt)"
        got, plain_out = _compare(task, engines, a)
        rows += got
        summary = cross_engine(got)
        if summary is not None:
            summary["llama_cpp_python"] = ver
            summary["llama_cpp_settings"] = lr.settings
            summary["plain_common_start"] = common_start(plain_out["sparrow"], plain_out["llama.cpp"])
            summary["plain_tokens"] = [len(plain_out["sparrow"]), len(plain_out["llama.cpp"])]
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
        variants = [
            ("plain", _sparrow(llm, prompt, {}, a.max_tokens)),
            (label, _sparrow(llm, prompt, sp, a.max_tokens)),
        ]
        rows += _compare(f"sparse drafting ({n}-token prompt)", {"sparrow": variants}, a)[0]
    print(f"# load average at end {load_avg()}")
    if a.json:
        for r in rows:
            print(json.dumps(r))
        if summary is not None:
            print(json.dumps(summary))
        return
    print("\n".join(table(rows, summary)))


def draft_lengths(text) -> list[int]:
    """--tokens: comma-separated draft lengths K >= 1."""
    try:
        ks = [int(k) for k in text.split(",")]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise SparrowError(f"--tokens takes comma-separated draft lengths of at least 1, not {text!r}")
    return ks


def table(rows, summary=None) -> list[str]:
    """The rows as a markdown table; with llama.cpp's rows (--compare llama-cpp) an engine column,
    each sparrow row's ratio to llama.cpp's of the same K and whether each output was the engine's
    plain one, then the summary's lines."""
    both = any(r["engine"] != "sparrow" for r in rows)
    if both:
        out = [
            "| task | engine | variant | tokens | decode tok/s | vs plain | vs llama.cpp | drafted | accepted "
            "| acceptance | output = plain |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    else:
        out = [
            "| task | variant | tokens | decode tok/s | vs plain | drafted | accepted | acceptance |",
            "|---|---|---|---|---|---|---|---|",
        ]
    for r in rows:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        rate = f"| {r['tokens']} | {r['tok_s']:.1f} | {r['speedup']:.2f}x "
        counts = f"| {r['drafted']} | {r['accepted']} | {acc} |"
        if both:
            vs = "" if r["vs_llama_cpp"] is None else f"{r['vs_llama_cpp']:.2f}x"
            same = "yes" if r["same_as_plain"] else "no"
            out.append(f"| {r['task']} | {r['engine']} | {r['variant']} {rate}| {vs} {counts} {same} |")
        else:
            out.append(f"| {r['task']} | {r['variant']} {rate}{counts}")
    if summary is None:
        return out

    def x(v):
        return "?" if v is None else f"{v:.2f}x"

    out.append(
        f"# sparrow / llama.cpp on {summary['task']}: plain {x(summary['plain'])} "
        f"({summary['sparrow_plain_tok_s']:.1f} / {summary['llama_cpp_plain_tok_s']:.1f} tok/s); best speculative "
        f"{x(summary['best_speculative'])} (sparrow {summary['sparrow_best']} {summary['sparrow_best_tok_s']:.1f}, "
        f"llama.cpp {summary['llama_cpp_best']} {summary['llama_cpp_best_tok_s']:.1f} tok/s)"
    )
    same = ", ".join(f"{v} {'yes' if ok else 'no'}" for v, ok in summary["llama_cpp_same_as_plain"].items())
    out.append(f"# llama.cpp's lookup output equals its plain output (it does not promise to): {same}")
    if "plain_common_start" in summary:
        n_s, n_l = summary["plain_tokens"]
        n = summary["plain_common_start"]
        out.append(f"# plain outputs: sparrow {n_s} tokens, llama.cpp {n_l}, the same for the first {n}")
    return out
