"""What sparse-drafted, exact-verified decoding costs at long context, and what it gains there.

`sparrow bench speculative --synth 16384,32768 [--shape qwen3-1.7b --type q4_0] [--kv-dtype f16]`

Random weights accept random drafts, so the gain is put together from two measured halves:

1. Acceptance, on a real model (--model, default the default model) at --acceptance-contexts
   (default 4096,8192): a document of that many tokens and a question, answered greedily with
   sparse drafting at a fixed K (no adaptive K) for every selector in --selectors and every k in
   --draft-k, each run checked to give plain decoding's tokens. E = tokens per verification
   (kept drafts + 1), measured, not derived from a per-token rate.
2. Cost, on the model shape (--shape / --type, random weights) over a synthesised cache of each
   --synth length (decode speed does not depend on the values, bench/long_context.py): a plain
   exact decode step, a sparse drafting step per selector and k, and the verification of R =
   K + 1 rows (the last token and K drafts) both ways: one pass over the K/V (what runs) and
   the rows attended one by one, each as its own decode step (Decoder.verify_one_pass off:
   what one pass replaced; still how rows of several sequences verified together attend). Runs are
   interleaved, --rounds rounds, medians.

The speed-up at acceptance E with draft length K:
    E * t_plain / (K * t_draft + t_verify(K + 1))
a verification cycle emits E tokens where plain decoding pays one step each. E is at most
K + 1 (every draft kept): the "every draft kept" column is the most a K can give at the measured
costs, whatever the drafter, so where it is below a target the target is out of reach. The worst case
(every draft rejected) plays adaptive K (speculative.Speculator) over --max-tokens tokens with the
measured costs. Then, where --e2e-tokens > 0, one real end-to-end run on the shape over the
synthesised cache: plain decoding against sparse speculation (K = the largest --tokens), same
tokens checked, at whatever acceptance random weights give (stated).
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import numpy as np

from sparrow_lab.bench.host import cpu_info, load_avg

SHORT = 32  # the position of the components that price everything but attention


def _pairs(a) -> list[tuple[str, int]]:
    return [(s, int(k)) for s in a.selectors.split(",") for k in a.draft_k.split(",")]


# ---------------------------------------------------------------------------------- acceptance
def acceptance(a) -> dict:
    """{(context, selector, k, K): tokens per verification} on the real model, greedy."""
    import sparrow
    from sparrow.kernels.runtime import set_threads
    from sparrow.params import SamplingParams, SparseParams, SpeculativeParams

    llm = sparrow.load(a.model, threads=a.threads, kv_dtype=a.kv_dtype)
    set_threads(llm.threads)
    runner = llm.runner
    sampling = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    out = {"model": llm.name}
    for ctx in [int(c) for c in a.acceptance_contexts.split(",") if c.strip()]:
        ids = _document_prompt(llm, min(ctx, llm.ctx - a.max_tokens - 64))
        base = runner.new_slot(ids, len(ids), a.kv_dtype)
        runner.prefill(base, len(ids) - 1)  # once per context: each run copies it and feeds the last token

        ref = _run(llm, ids, base.cache, sampling, a.kv_dtype, None)[0]
        for sel, k in _pairs(a):
            for K in [int(t) for t in a.tokens.split(",")]:
                p = SpeculativeParams("sparse", K, sparse=SparseParams(k=k, select=sel), adaptive=False)
                toks, spec, cycles = _run(llm, ids, base.cache, sampling, a.kv_dtype, p)
                assert toks == ref, f"sparse {sel} k={k} K={K} changed the output"
                e = (len(toks) - 1) / cycles if cycles else None  # the first token comes from the prefill
                out[(len(ids), sel, k, K)] = dict(E=e, drafted=spec.drafted, accepted=spec.accepted)
    return out


def _document_prompt(llm, tokens: int) -> list[int]:
    """A chat prompt of about `tokens` tokens (at most): minutes of meetings and a question."""
    from sparrow_lab.eval.prompts import meeting_minutes

    sentences = max(1, tokens // 40)
    for _ in range(4):  # scale the document to the tokenizer's rate
        msg = "\n\nWho met Hana last, and where? Then summarise the minutes."
        ids = llm.prompt_ids([{"role": "user", "content": meeting_minutes(sentences, 2) + msg}], chat=True)
        if len(ids) <= tokens and len(ids) > 0.95 * tokens:
            break
        sentences = max(1, int(sentences * 0.97 * tokens / len(ids)))
    return ids


def _run(llm, ids, prefilled, sampling, kv, spec_params) -> tuple:
    """Greedy generation after ids with positions 0..P-2 copied from `prefilled` ->
    (tokens, speculator or None, verifications run)."""
    from sparrow.engine.generate import generate_step
    from sparrow.engine.sequence import Sequence
    from sparrow.engine.speculative import make_speculator

    runner = llm.runner
    seq = Sequence.create(runner, llm.tokenizer, ids, sampling, llm.ctx, kv)
    seq.slot.cache.copy_prefix(prefilled, len(ids) - 1, prefilled.importance_snapshot())
    spec = make_speculator(llm.handle, runner, spec_params, seq, kv) if spec_params else None
    verify, cycles = runner.verify, []
    runner.verify = lambda *args: (cycles.append(1), verify(*args))[1]  # counts verifications
    try:
        toks = [o.token_id for o in generate_step(runner, seq, spec=spec)]
    finally:
        del runner.verify
    return toks, spec, len(cycles)


# ----------------------------------------------------------------------------------------- cost
def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def components(llm, ctx: int, a) -> dict:
    """Median seconds over --rounds interleaved rounds: 'plain' (a decode step), ('draft', sel, k),
    ('old' | 'new', R) (verification of R rows), and 'short', ('short', R): a step and the
    one-pass verification at position SHORT, i.e. what they cost besides reading the K/V."""
    from sparrow.engine.runner import Slot
    from sparrow.params import SparseParams
    from sparrow_lab.bench.engines import random_ids
    from sparrow_lab.bench.long_context import fill_random

    model, runner = llm.model, llm.runner
    Ks = [int(t) for t in a.tokens.split(",")]
    rows = sorted({2, 3} | {K + 1 for K in Ks})  # 2 and 3: adaptive K backing off (worst_case)
    cache = model.new_cache(ctx + max(rows) + 1, a.kv_dtype)
    fill_random(cache, ctx)
    feed = random_ids(np.random.default_rng(1), model.config, max(rows)).tolist()
    exact = Slot(np.zeros(ctx, np.int64), cache)
    drafts = {(s, k): Slot(np.zeros(ctx, np.int64), cache, SparseParams(k=k, select=s)) for s, k in _pairs(a)}

    # the same forwards at position SHORT of a small cache: the weights' share, attention ~nothing
    short = Slot(np.zeros(SHORT, np.int64), model.new_cache(SHORT + max(rows) + 1, a.kv_dtype))
    fill_random(short.cache, SHORT)

    def step(slot):
        n = slot.cache.length
        runner.decode([slot], feed[:1])
        slot.cache.truncate(n)

    def verify(slot, n, one_pass):
        model.verify_one_pass = one_pass
        at = slot.cache.length
        try:
            runner.verify([slot], [feed[:n]], [at])
        finally:
            model.verify_one_pass = True
            slot.cache.truncate(at)

    jobs = {"plain": lambda: step(exact), "short": lambda: step(short)}
    jobs.update({("draft", s, k): (lambda sl=sl: step(sl)) for (s, k), sl in drafts.items()})
    for n in rows:
        jobs[("new", n)] = lambda n=n: verify(exact, n, True)
        jobs[("old", n)] = lambda n=n: verify(exact, n, False)
        jobs[("short", n)] = lambda n=n: verify(short, n, True)
    return _medians(jobs, a.rounds)


def _medians(jobs: dict, rounds: int) -> dict:
    """Each job run once (warm-up: kernels compiled, the selectors' copies built on first use),
    then `rounds` interleaved rounds of all of them -> {key: median seconds}."""
    for fn in jobs.values():
        fn()
    times = {key: [] for key in jobs}
    for _ in range(rounds):
        for key, fn in jobs.items():
            times[key].append(_timed(fn))
    return {key: statistics.median(v) for key, v in times.items()}


def worst_case(c: dict, sel: str, k: int, K: int, n: int) -> float:
    """Plain decoding's time over speculation's for n tokens when every draft is rejected: the
    real Speculator's adaptive K and pauses, priced with the measured components."""
    from sparrow.engine.speculative import Drafter, Speculator
    from sparrow.params import SpeculativeParams

    spec = Speculator(SpeculativeParams("sparse", K), Drafter())
    cache = SimpleNamespace(rollback=lambda n: None)
    seq = SimpleNamespace(params=SimpleNamespace(max_tokens=n), output=[], prompt=[], slot=SimpleNamespace(cache=cache))
    cost = 0.0
    while len(seq.output) < n:
        m = spec.budget(seq)
        if m > 0:
            cost += m * c[("draft", sel, k)] + c[("new", m + 1)]
            seq.output.append(0)
            spec.settle(seq, [0] * m, 0)
        else:
            spec.propose(seq, 0)  # counts down the pause
            cost += c["plain"]
            seq.output.append(0)
    return n * c["plain"] / cost


def end_to_end(llm, ctx: int, a) -> dict:
    """Greedy decoding of --e2e-tokens after a synthesised cache of ctx positions: plain against
    sparse speculation (fixed K, first selector and k), same tokens; tok/s after the first."""
    from sparrow.engine.sequence import Sequence
    from sparrow.params import SamplingParams, SparseParams, SpeculativeParams
    from sparrow_lab.bench.engines import random_ids
    from sparrow_lab.bench.long_context import fill_random

    runner, n = llm.runner, a.e2e_tokens
    sel, k = _pairs(a)[0]
    K = max(int(t) for t in a.tokens.split(","))
    ids = random_ids(np.random.default_rng(2), llm.model.config, ctx + 1).tolist()
    sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    res, ref = {}, None
    for label, p in (
        ("plain", None),
        (f"sparse {sel} k={k} K={K}", SpeculativeParams("sparse", K, sparse=SparseParams(k=k, select=sel))),
    ):
        room = max(llm.ctx, ctx + n + 1)
        seq = Sequence.create(runner, llm.tokenizer, ids, sampling, room, a.kv_dtype, allocate=False)
        seq.slot.cache = llm.model.new_cache(ctx + n + K + 1, a.kv_dtype)
        fill_random(seq.slot.cache, ctx)  # the prefill then runs the last prompt token only
        toks, res[label] = _generate(llm, seq, p, a.kv_dtype)
        ref = ref or toks
        assert toks == ref, f"{label} changed the output"
    return res


def _generate(llm, seq, params, kv_dtype) -> tuple[list[int], dict]:
    """Greedy decoding of seq to its end, speculating with params (None: plain) -> (tokens, tok/s
    after the first token, drafted and accepted tokens); frees the sequence's cache."""
    from sparrow.engine.generate import generate_step
    from sparrow.engine.speculative import make_speculator

    spec = make_speculator(llm.handle, llm.runner, params, seq, kv_dtype) if params else None
    gen = generate_step(llm.runner, seq, spec=spec)
    toks = [next(gen).token_id]
    t0 = time.perf_counter()
    toks += [o.token_id for o in gen]
    dt = time.perf_counter() - t0
    seq.slot.cache = None
    return toks, dict(tok_s=(len(toks) - 1) / dt, drafted=spec.drafted if spec else 0,
                      accepted=spec.accepted if spec else 0)  # fmt: skip


def main(a) -> None:
    import gc

    import sparrow
    from sparrow_lab.bench import shapes

    cpu = cpu_info()
    print(f"# speculative decoding, the cost side: CPU {cpu.get('model', '?')}; load average at start {load_avg()}")
    acc = acceptance(a)
    gc.collect()
    path = shapes.ensure(a.shape, a.type) if a.shape else a.model  # --shape "": the acceptance model
    llm = sparrow.load(path, threads=a.threads, kv_dtype=a.kv_dtype, activations=a.activations)
    print(f"# acceptance: {acc.pop('model')}, greedy, {a.max_tokens} tokens, fixed K (tokens per verification E)")
    print("| prompt tokens | drafter | K | E | drafted | accepted |")
    print("|---|---|---|---|---|---|")
    for (n, sel, k, K), r in acc.items():
        e = "-" if r["E"] is None else f"{r['E']:.2f}"
        print(f"| {n} | sparse {sel} k={k} | {K} | {e} | {r['drafted']} | {r['accepted']} |")
    name = f"{a.shape} {a.type}" if a.shape else llm.name
    widest = max(n for n, *_ in acc)  # the acceptance the cost rows use: the longest context measured
    print(
        f"\n# cost: {name}, KV {a.kv_dtype}, activations {llm.model.activations}, {a.threads} threads, "
        f"synthesised cache, median of {a.rounds} interleaved rounds; E from the {widest}-token prompt"
    )
    print(
        "| context | drafter | K | E | plain ms | draft ms | verify K+1 old ms | verify K+1 new ms "
        "| tok/s vs plain, new | old | every draft kept, new | all rejected (adaptive) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for ctx in [int(c) for c in a.synth.split(",")]:
        c = components(llm, ctx, a)
        for sel, k in _pairs(a):
            for K in [int(t) for t in a.tokens.split(",")]:
                e = acc[(widest, sel, k, K)]["E"] or 1.0
                t_d, old, new = c[("draft", sel, k)], c[("old", K + 1)], c[("new", K + 1)]
                r_new, r_old = e * c["plain"] / (K * t_d + new), e * c["plain"] / (K * t_d + old)
                best = (K + 1) * c["plain"] / (K * t_d + new)  # the most this K can give at these costs
                worst = worst_case(c, sel, k, K, a.max_tokens)
                print(
                    f"| {ctx} | sparse {sel} k={k} | {K} | {e:.2f} | {c['plain'] * 1e3:.0f} | {t_d * 1e3:.0f} "
                    f"| {old * 1e3:.0f} | {new * 1e3:.0f} | {r_new:.2f}x | {r_old:.2f}x | {best:.2f}x | {worst:.2f}x |"
                )
        for n in sorted(key[1] for key in c if key[0] == "new"):
            print(
                f"# where the time goes at {ctx}: {n} rows verified {c[('new', n)] * 1e3:.0f} ms in one pass "
                f"({c[('old', n)] * 1e3:.0f} row by row), {c[('short', n)] * 1e3:.0f} ms of it besides attention "
                f"(the same rows at position {SHORT}); a plain step {c['plain'] * 1e3:.0f} ms, "
                f"{c['short'] * 1e3:.0f} ms of it besides attention"
            )
        if a.e2e_tokens > 0:
            for label, r in end_to_end(llm, ctx, a).items():
                acc_txt = f", {r['accepted']}/{r['drafted']} drafts kept" if r["drafted"] else ""
                print(f"# end to end at {ctx}: {label}: {r['tok_s']:.2f} tok/s{acc_txt}")
        gc.collect()
    print(f"# load average at end {load_avg()}")


def draft_model_cost(a) -> None:
    """The cost side of `draft` (issue 37): a smaller shape (--draft-shape / --draft-type, or a
    model at --draft-model) drafting for --shape / --type (or, with --shape "", --model), shapes
    with random weights (the Qwen3 shapes share one synthesised
    vocabulary, so one drafts for the other, as Qwen3-0.6B does for the larger Qwen3 models).
    Random weights accept ~nothing, so, as for sparse drafting, the speed is put together from
    measured costs: after --draft-context positions, the target's plain decode step, the draft
    model's decode step and the target's one-pass verification of K + 1 rows (medians of
    --rounds interleaved rounds) give, at a per-token acceptance rate p, E = (1 - p^(K+1)) / (1 - p)
    tokens a cycle and E * t_plain / (K * t_draft + t_verify(K + 1)) against plain decoding;
    the all-rejected case plays adaptive K with those costs; and one end-to-end run, plain
    against draft speculation (K = the largest --tokens), checks the tokens equal and gives the
    speed at the acceptance random weights give (stated)."""
    import sparrow
    from sparrow.loaders import default_model_path
    from sparrow.params import SpeculativeParams
    from sparrow_lab.bench import shapes
    from sparrow_lab.bench.engines import random_ids

    cpu = cpu_info()
    print(f"# speculative decoding with a draft model, the cost side: CPU {cpu.get('model', '?')}; load {load_avg()}")
    target_path = shapes.ensure(a.shape, a.type) if a.shape else a.model or default_model_path()
    draft_path = shapes.ensure(a.draft_shape, a.draft_type) if a.draft_shape else a.draft_model
    llm = sparrow.load(target_path, threads=a.threads, kv_dtype=a.kv_dtype, activations=a.activations)
    draft = llm.draft_llm(draft_path)
    ctx, Ks = a.draft_context, [int(t) for t in a.tokens.split(",")]
    rows = sorted({2, 3} | {K + 1 for K in Ks})
    ids = random_ids(np.random.default_rng(3), llm.model.config, ctx).tolist()
    feed = random_ids(np.random.default_rng(4), llm.model.config, max(rows)).tolist()
    target_slot = llm.runner.new_slot(np.asarray(ids), ctx + max(rows) + 1, a.kv_dtype)
    llm.runner.prefill(target_slot)
    draft_slot = draft.runner.new_slot(np.asarray(ids), ctx + 2, a.kv_dtype)
    t_prefill = _timed(lambda: draft.runner.prefill(draft_slot))  # a request's draft pays it once

    def step(runner, slot):
        n = slot.cache.length
        runner.decode([slot], feed[:1])
        slot.cache.truncate(n)

    def verify(n):
        at = target_slot.cache.length
        llm.runner.verify([target_slot], [feed[:n]], [at])
        target_slot.cache.truncate(at)

    jobs = {
        "plain": lambda: step(llm.runner, target_slot),
        ("draft", "model", 0): lambda: step(draft.runner, draft_slot),
    }
    jobs.update({("new", n): (lambda n=n: verify(n)) for n in rows})
    c = _medians(jobs, a.rounds)
    t_p, t_d = c["plain"], c[("draft", "model", 0)]
    names = (
        f"{a.shape} {a.type}" if a.shape else llm.name,
        f"{a.draft_shape} {a.draft_type}" if a.draft_shape else draft.name,
    )
    print(
        f"# target {names[0]} (activations {llm.model.activations}), draft {names[1]} "
        f"(activations {draft.model.activations}), KV {a.kv_dtype}, {a.threads} threads, {ctx}-position context, "
        f"median of {a.rounds} interleaved rounds"
    )
    print(
        f"# plain step {t_p * 1e3:.1f} ms, draft step {t_d * 1e3:.1f} ms ({t_d / t_p:.2f} of a plain step); "
        f"the draft model prefills a request's prompt once: {t_prefill:.2f} s for these {ctx} tokens (first run)"
    )
    rates = (0.5, 0.7, 0.8, 0.9)
    print(
        "| K | verify K+1 ms | "
        + " | ".join(f"p = {p}" for p in rates)
        + " | every draft kept | all rejected (adaptive) |"
    )
    print("|---|---|" + "---|" * (len(rates) + 2))
    for K in Ks:
        t_v = c[("new", K + 1)]
        cells = [f"{(1 - p ** (K + 1)) / (1 - p) * t_p / (K * t_d + t_v):.2f}x" for p in rates]
        kept = (K + 1) * t_p / (K * t_d + t_v)
        worst = worst_case(c, "model", 0, K, a.max_tokens)
        print(f"| {K} | {t_v * 1e3:.0f} | " + " | ".join(cells) + f" | {kept:.2f}x | {worst:.2f}x |")
    if a.e2e_tokens > 0:
        K = max(Ks)
        _end_to_end(llm, ids, ctx, a, K, SpeculativeParams("draft", K, draft_model=draft_path))
        print("# (tokens after the first over the time after it: the draft model's prefill of the prompt included)")
    print(f"# load average at end {load_avg()}")


def _end_to_end(llm, ids, ctx, a, K, spec) -> None:
    """Plain decoding and decoding with `spec` (K drafts) of a.e2e_tokens tokens after the prompt
    ids: tok/s of each, the tokens checked equal."""
    from sparrow.engine.sequence import Sequence
    from sparrow.params import SamplingParams

    n = a.e2e_tokens
    sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    res, ref = {}, None
    for label, p in (("plain", None), (f"{spec.method} K={K}", spec)):
        seq = Sequence.create(llm.runner, llm.tokenizer, ids, sampling, ctx + n + K + 1, a.kv_dtype)
        toks, res[label] = _generate(llm, seq, p, a.kv_dtype)
        ref = ref or toks
        assert toks == ref, f"{label} changed the output"
    base = res["plain"]["tok_s"]
    for label, r in res.items():
        kept = f", {r['accepted']}/{r['drafted']} drafts kept" if r["drafted"] else ""
        print(f"# end to end: {label}: {r['tok_s']:.2f} tok/s ({r['tok_s'] / base:.2f}x plain){kept}, same tokens")


def synthetic_mtp(llm, path: str, qtype: str):
    """An MTP layer at the shape's sizes (the shape files carry none): the decoder layer is the
    file's last full-attention layer (its tensors, in the file's formats), fc random values in
    `qtype`, the norms ones. Its cost does not depend on the values."""
    from sparrow.loaders import open_checkpoint
    from sparrow.loaders.tensor import StoredTensor
    from sparrow.models.decoder import WeightSource
    from sparrow.models.qwen3_5_mtp import MTPHead

    cfg = llm.model.config
    tensors = open_checkpoint(path).tensors
    j, E = cfg.full_attention_layers[-1], cfg.hidden_size
    pre = f"model.layers.{j}."
    mtp = {"mtp.layers.0." + k[len(pre) :]: t for k, t in tensors.items() if k.startswith(pre)}
    fc = np.random.default_rng(5).normal(0.0, 0.02, (E, 2 * E)).astype(np.float32)
    mtp["mtp.fc.weight"] = StoredTensor("mtp.fc.weight", fc, "f32", fc.shape)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = StoredTensor(name, np.ones(E, np.float32), "f32", (E,))
    return MTPHead(cfg, WeightSource(mtp, qtype if qtype in ("q8_0", "q4_0") else None, llm.model.activations))


def mtp_cost(a) -> None:
    """The cost side of `mtp` (Qwen3.5's own draft layer) on a Qwen3.5 shape (--shape / --type,
    random weights, a synthetic MTP layer: synthetic_mtp). After --draft-context positions: the
    target's plain decode step, the head's one-row draft step, its catch-up forward over n rows
    (what each verification that kept n - 1 drafts feeds it) and the target's one-pass
    verification of K + 1 rows (medians of --rounds interleaved rounds). A cycle drafting K
    tokens at a per-token acceptance rate p emits E = (1 - p^(K+1)) / (1 - p) tokens and costs
    catch-up(E rows) + (K - 1) draft steps + verify(K + 1): E * t_plain / that against plain
    decoding. Then one end-to-end run, plain against mtp speculation (K = the largest --tokens),
    the tokens checked equal, at the acceptance random weights give (about none: stated)."""
    import sparrow
    from sparrow.errors import SparrowError
    from sparrow.params import SpeculativeParams
    from sparrow_lab.bench import shapes
    from sparrow_lab.bench.engines import random_ids

    if not a.shape or not shapes.is_hybrid(a.shape):
        raise SparrowError(f"--mtp needs a Qwen3.5 shape (--shape qwen3.5-...), got {a.shape!r}")
    cpu = cpu_info()
    print(f"# speculative decoding with the MTP layer, the cost side: CPU {cpu.get('model', '?')}; load {load_avg()}")
    path = shapes.ensure(a.shape, a.type)
    llm = sparrow.load(path, threads=a.threads, kv_dtype=a.kv_dtype, activations=a.activations)
    model = llm.model
    model.mtp = synthetic_mtp(llm, path, a.type)
    ctx, Ks = a.draft_context, [int(t) for t in a.tokens.split(",")]
    rows = sorted({2, 3} | {K + 1 for K in Ks})
    ids = random_ids(np.random.default_rng(3), model.config, ctx).tolist()
    feed = random_ids(np.random.default_rng(4), model.config, max(rows)).tolist()
    slot = llm.runner.new_slot(np.asarray(ids), ctx + max(rows) + 1, a.kv_dtype)
    slot.cache.hidden = {}
    llm.runner.prefill(slot)
    hidden = np.stack([slot.cache.hidden[p] for p in range(ctx)])  # [ctx, E]
    slot.cache.hidden = None
    head = model.mtp.new_cache(ctx + max(rows) + 1, a.kv_dtype)
    t_catch_prompt = _timed(lambda: model.mtp.forward(model, ids[1:ctx], hidden[: ctx - 1], head, 0, range(ctx - 1)))

    def step():
        n = slot.cache.length
        llm.runner.decode([slot], feed[:1])
        slot.cache.truncate(n)

    def verify(n):
        at = slot.cache.length
        slot.cache.hidden = {}  # as with the drafter: the rows keep their hidden states
        llm.runner.verify([slot], [feed[:n]], [at])
        slot.cache.truncate(at)
        slot.cache.hidden = None

    def head_rows(n):
        at = head.length
        model.mtp.forward(model, feed[:n], hidden[-n:], head, at, range(at, at + n))
        head.truncate(at)

    jobs = {"plain": step, ("draft", "mtp", 0): lambda: head_rows(1)}
    catch = range(2, max(Ks) + 2)
    jobs.update({("catch", n): (lambda n=n: head_rows(n)) for n in catch})
    jobs.update({("new", n): (lambda n=n: verify(n)) for n in rows})
    c = _medians(jobs, a.rounds)
    t_p, t_d = c["plain"], c[("draft", "mtp", 0)]
    print(
        f"# target {a.shape} {a.type} (activations {model.activations}) with a synthetic MTP layer, KV {a.kv_dtype}, "
        f"{a.threads} threads, {ctx}-position context, median of {a.rounds} interleaved rounds"
    )
    print(
        f"# plain step {t_p * 1e3:.1f} ms, MTP draft step {t_d * 1e3:.1f} ms ({t_d / t_p:.2f} of a plain step); "
        f"the head's catch-up over the {ctx - 1}-token prompt: {t_catch_prompt:.2f} s (first run)"
    )
    print("| rows n | MTP catch-up ms | target verify ms |")
    print("|---|---|---|")
    for n in catch:
        v = f"{c[('new', n)] * 1e3:.1f}" if ("new", n) in c else ""
        print(f"| {n} | {c[('catch', n)] * 1e3:.1f} | {v} |")
    rates = (0.5, 0.7, 0.8, 0.9)
    print("| K | " + " | ".join(f"p = {p}" for p in rates) + " | every draft kept | all rejected (adaptive) |")
    print("|---|" + "---|" * (len(rates) + 2))
    for K in Ks:
        t_v = c[("new", K + 1)]

        def cycle(E):
            n = min(max(catch), max(1, round(E)))
            return c[("catch", n)] if n > 1 else t_d

        cells = []
        for p in rates:
            E = (1 - p ** (K + 1)) / (1 - p)
            cells.append(f"{E * t_p / (cycle(E) + (K - 1) * t_d + t_v):.2f}x")
        kept = (K + 1) * t_p / (cycle(K + 1) + (K - 1) * t_d + t_v)
        worst = worst_case(c, "mtp", 0, K, a.max_tokens)
        print(f"| {K} | " + " | ".join(cells) + f" | {kept:.2f}x | {worst:.2f}x |")
    if a.e2e_tokens > 0:
        K = max(Ks)
        _end_to_end(llm, ids, ctx, a, K, SpeculativeParams("mtp", K))
    print(f"# load average at end {load_avg()}")
