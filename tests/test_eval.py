"""Long-context evaluation: prompt generators, scorers, fidelity metrics, report, and a short
end-to-end needle sweep on the default model."""

import json
import math
import os
import re

import numpy as np
import pytest

from sparrow.errors import SparrowError
from sparrow.state.cache import KVCache
from sparrow_lab.eval import fidelity as fid
from sparrow_lab.eval import prompts, report, scoring


@pytest.fixture(scope="module")
def tok():
    from sparrow.loaders import open_checkpoint

    return open_checkpoint(None).tokenizer


# ---------------------------------------------------------------- generators
def test_same_seed_same_prompt(tok):
    a = prompts.make_prompt(tok, "needle", 1024, 0.5, seed=3)
    b = prompts.make_prompt(tok, "needle", 1024, 0.5, seed=3)
    assert a.ids == b.ids and a.messages == b.messages and a.answers == b.answers


def test_default_seed_is_the_article_needle(tok):
    p = prompts.make_prompt(tok, "needle", 512, 0.5, seed=0)
    user = p.messages[0]["content"]
    assert "Zara's favorite food is ramen." in user
    assert user.endswith("\n\nWhat is Zara's favorite food?")
    assert p.answers == ["ramen"] and p.assistant_prefix == "Zara's favorite food is"
    assert tok.decode(p.ids).endswith("<|im_start|>assistant\nZara's favorite food is")


def test_different_seed_changes_names_and_filler(tok):
    a = prompts.make_prompt(tok, "needle", 1024, 0.5, seed=0)
    b = prompts.make_prompt(tok, "needle", 1024, 0.5, seed=5)
    assert (a.meta["name"], a.meta["food"]) != (b.meta["name"], b.meta["food"])
    fa = a.messages[0]["content"].split(". ")[:20]
    fb = b.messages[0]["content"].split(". ")[:20]
    assert fa != fb
    ka = prompts.make_prompt(tok, "passkey", 1024, 0.5, seed=1)
    kb = prompts.make_prompt(tok, "passkey", 1024, 0.5, seed=2)
    assert ka.answers != kb.answers


@pytest.mark.parametrize("depth", [0.1, 0.25, 0.5, 0.75, 0.9])
def test_needle_at_depth_on_sentence_boundary(tok, depth):
    p = prompts.make_prompt(tok, "needle", 2048, depth, seed=0)
    user = p.messages[0]["content"]
    off = p.needle_offsets[0]
    fact = p.meta["facts"][0]
    assert user[off : off + len(fact)] == fact
    assert off == 0 or user[off - 2 : off] == ". "  # follows a whole sentence
    assert user[off + len(fact)] == " " and user[off + len(fact) + 1].isupper()  # a sentence follows
    assert abs(prompts.fact_token_depth(tok, p) - depth) < 0.02  # a filler sentence is ~12 of ~2000 tokens


@pytest.mark.parametrize("task", prompts.TASKS)
@pytest.mark.parametrize("length", ["1K", "2K", "4K", "7K"])
def test_token_count_within_5_percent(tok, task, length):
    L = prompts.parse_length(length)
    p = prompts.make_prompt(tok, task, L, 0.5, seed=1)
    assert p.ids == prompts.chat_ids(tok, p.messages, p.assistant_prefix)
    assert abs(len(p.ids) - L) <= 0.05 * L
    user = p.messages[0]["content"]
    for fact in p.meta["facts"]:
        assert fact in user
    for a in p.answers:
        assert a in user


def test_multi_fact_tasks(tok):
    vt = prompts.make_prompt(tok, "vt", 1024, None, seed=4)
    user = vt.messages[0]["content"]
    pos = [user.index(f) for f in vt.meta["facts"]]
    assert pos == sorted(pos)  # the chain reads in order
    assert len(vt.answers) == 5 and vt.meta["value"] in vt.assistant_prefix
    mk = prompts.make_prompt(tok, "niah_multikey", 1024, None, seed=4)
    assert len(mk.meta["facts"]) == 4 and len(mk.answers) == 1
    for i, d in enumerate(mk.depths):
        assert abs(prompts.fact_token_depth(tok, mk, i) - d) < 0.03


def test_cwe_counts(tok):
    """RULER's common-words extraction: the answers are exactly the words listed most often."""
    import collections

    p = prompts.make_prompt(tok, "cwe", 2048, None, seed=3)
    lines = [ln for ln in p.messages[0]["content"].split("\n") if ln[:1].isdigit()]
    assert [int(ln.split(". ")[0]) for ln in lines] == list(range(1, len(lines) + 1))
    counts = collections.Counter(ln.split(". ", 1)[1] for ln in lines)
    assert {w: counts[w] for w in p.answers} == dict.fromkeys(p.answers, p.meta["freq_common"])
    rare = set(counts) - set(p.answers)
    assert len(rare) == p.meta["rare_words"] > 0 and p.meta["seed"] == 3  # the needle bench records it
    assert {counts[w] for w in rare} == {prompts.CWE_FREQ_RARE} and p.meta["freq_common"] > prompts.CWE_FREQ_RARE
    assert scoring.score("cwe", ", ".join(p.answers[:5]), p.answers) == 0.5


def test_parse_length_and_errors(tok):
    assert prompts.parse_length("1K") == 1024 and prompts.parse_length("7k") == 7168
    assert prompts.parse_length("1500") == 1500
    with pytest.raises(SparrowError):
        prompts.parse_length("lots")
    with pytest.raises(SparrowError):
        prompts.make_prompt(tok, "haystack", 1024)
    with pytest.raises(SparrowError):
        prompts.make_prompt(tok, "needle", 1024, depth=1.5)


# ---------------------------------------------------------------- scorers
def test_scorers():
    assert scoring.contains(" a type of Japanese-style Ramen. She", "ramen")
    assert not scoring.contains(" not specified.", "ramen")
    assert not scoring.contains("ramenX", "ramen")
    assert not scoring.contains("123456", "12345")
    assert scoring.contains("key is 12345.", "12345")
    assert scoring.match_all("1111 and 3333", ["1111", "2222", "3333", "4444"]) == 0.5
    assert scoring.match_any("nothing", ["1111"]) == 0.0
    assert scoring.score("needle", "ramen", ["ramen"]) == 1.0
    assert scoring.score("niah_multikey", "9999", ["1111", "9999"]) == 0.0  # only the asked key counts
    assert scoring.score("vt", "AAAAA, BBBBB", ["AAAAA", "BBBBB", "CCCCC", "DDDDD"]) == 0.5
    assert scoring.repetition_ratio("a b c d e") == 0.0
    assert scoring.repetition_ratio("x y x y x y x y") == pytest.approx(1 - 2 / 6)


# ---------------------------------------------------------------- fidelity metrics
def test_kl_top1_first_divergence():
    p = np.array([[0.0, math.log(3.0)], [1.0, 2.0]], np.float32)  # softmax row 0 = [1/4, 3/4]
    q = np.array([[0.0, 0.0], [1.0, 2.0]], np.float32)  # row 0 = [1/2, 1/2]
    kl = fid.kl_per_token(p, q)
    assert kl[0] == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), rel=1e-6)
    assert kl[1] == pytest.approx(0.0, abs=1e-12)
    assert fid.kl_per_token(q, p)[0] == pytest.approx(0.5 * math.log(2.0) + 0.5 * math.log(2.0 / 3.0), rel=1e-6)
    a = np.array([[0, 1, 0], [2, 0, 0], [0, 0, 1], [0, 5, 0]], np.float32)
    b = np.array([[0, 1, 0], [2, 0, 0], [1, 0, 0], [0, 5, 0]], np.float32)
    assert fid.top1_agreement(a, b) == 0.75
    assert fid.first_divergence([5, 6, 7, 8], [5, 6, 9, 8]) == 2
    assert fid.first_divergence([5, 6], [5, 6, 7]) is None


def test_compare_counts_generated_tokens():
    V = 4
    e = fid.Decoded([1, 2, 3, 0], logits=[np.eye(V)[2] * 5, np.eye(V)[3] * 5, np.eye(V)[0] * 5])
    s = fid.Decoded([1, 2, 3, 0], logits=[np.eye(V)[2] * 5, np.eye(V)[1] * 5, np.eye(V)[0] * 5])
    c = fid.compare(e, s)
    # step 1 predicts generated token 2 and is the first to differ
    assert c["first_diff"] == 2 and c["top1"] == pytest.approx(2 / 3) and c["steps"] == 3
    assert c["kl_mean"] > 0


def test_selected_mass_matches_hand_softmax():
    cache = KVCache(1, 1, 2, 8, "f32")
    k = np.array([[1, 0], [0, 1], [2, 0], [0, 0], [1, 1], [0, 2]], np.float32)[:, None, :]  # [6, 1, 2]
    cache.append(0, 0, k, np.zeros_like(k))
    lc = cache.layers[0]
    q = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)  # two query heads share the KV head
    m = fid.selected_mass(q, lc, 6, 1.0, 2, {0: [1], 1: [0, 2]})
    s0 = np.exp([1, 0, 2, 0, 1, 0])  # head 0 scores
    s1 = np.exp([0, 1, 0, 0, 1, 2])
    assert m[0] == pytest.approx((s0[2] + s0[3]) / s0.sum(), rel=1e-9)
    assert m[1] == pytest.approx((s1[0] + s1[1] + s1[4] + s1[5]) / s1.sum(), rel=1e-9)


def test_kernel_trace_mass_matches_helper():
    from sparrow.models.attention import decode_attention
    from sparrow.params import SparseParams

    rng = np.random.default_rng(0)
    cache = KVCache(1, 2, 16, 200, "f32")
    kv = rng.standard_normal((200, 2, 16), dtype=np.float32)  # [S, KVH, D]
    cache.append(0, 0, kv * 2, kv)
    cache.sparse[0].importance[:200] = rng.random(200, dtype=np.float32)
    lc = cache.layers[0]
    q = rng.standard_normal((4, 16), dtype=np.float32) * 2  # [H, D]
    tr = []
    decode_attention(q, lc, cache.sparse[0], 200, 0.25, SparseParams(k=2, block=16), tr)
    want = fid.selected_mass(q, lc, 200, 0.25, 16, {r[0]: r[1] for r in tr})
    assert [r[0] for r in tr] == [0, 1, 2, 3]  # one record per query head
    for head, blocks, stages, mass in tr:  # the kernel reports the covered mass itself
        assert len(blocks) == len(stages) == 2
        assert mass == pytest.approx(want[head], rel=1e-4, abs=1e-6)
        assert 0.0 < want[head] < 1.0


def test_mass_summary():
    traces = [
        [(0, [(0, [0], [], 0.5), (1, [0], [], 1.0)]), (1, [(0, [0], [], 0.2)])],
        [(0, [(0, [0], [], 0.7), (1, [0], [], 0.9)]), (1, [(0, [0], [], 0.4)])],
    ]
    s = fid.mass_summary(traces)
    assert s["per_layer"][0]["median"] == pytest.approx(0.8)
    assert s["per_layer"][1]["median"] == pytest.approx(0.3)
    assert s["per_layer"][1]["p5"] == pytest.approx(0.21)
    assert s["median"] == pytest.approx(0.6)


# ---------------------------------------------------------------- report
def _rows():
    rows = []
    for L in (1024, 2048):
        rows.append(
            {
                "config": "exact",
                "k": None,
                "n_prompt": L,
                "task": "needle",
                "depth": 0.5,
                "score": 1.0,
                "text": " ramen.",
                "attn_ms": 10.0 * L / 1024,
                "total_ms": 40.0,
                "kl_mean": 0.0,
                "top1": 1.0,
            }
        )
        for k, sc in ((8, 1.0), (1, 0.0)):
            rows.append(
                {
                    "config": f"sparse k={k}",
                    "k": k,
                    "n_prompt": L,
                    "task": "needle",
                    "depth": 0.5,
                    "score": sc,
                    "text": "ramen | ramen",
                    "attn_ms": 3.0,
                    "total_ms": 30.0,
                    "kl_mean": 1.0 / k,
                    "top1": 0.9,
                    "first_diff": 3,
                    "mass": {"median": 0.9, "p5": 0.5, "per_layer": {0: {"median": 0.9, "p5": 0.5}}},
                }
            )
    return rows


def test_markdown_table_and_plots(tmp_path):
    md = report.markdown_table(_rows(), "Needle")
    lines = md.splitlines()
    summary = [l for l in lines if l.startswith("| exact") or l.startswith("| sparse")][:3]
    assert summary[0].startswith("| exact | 100% (2) |")
    assert summary[1].startswith("| sparse k=8 | 100% (2) | ramen \\| ramen |")
    assert summary[2].startswith("| sparse k=1 | 0% (2) |") and "| 1.000 | 0.90 | 0.900 / 0.500 |" in summary[2]
    assert "| 0 | 0.900 / 0.500 | 0.900 / 0.500 |" in report.mass_table(_rows())
    timing = report.timing_table(_rows())
    assert "| exact | 10.0 / 40.0 | 20.0 / 40.0 |" in timing and "| sparse k=1 | 3.0 / 30.0 | 3.0 / 30.0 |" in timing
    pngs = report.plot(str(tmp_path) + "/", _rows())
    assert sorted(os.path.basename(p) for p in pngs) == [
        "attn_ms_vs_context.png",
        "kl_vs_k.png",
        "mass_vs_k.png",
        "recall_vs_k.png",
    ]
    for p in pngs:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_bad_grid_options():
    from sparrow_lab.bench import needle

    with pytest.raises(SparrowError):
        needle.main(["--tasks", "haystack", "--out", "/nonexistent/never"])
    with pytest.raises(SparrowError):
        needle.main(["--ks", "8,x"])
    with pytest.raises(SparrowError, match="oracle"):
        needle.main(["--selectors", "seed,oracle", "--sparse-prefill", "--out", "/nonexistent/never"])


# ---------------------------------------------------------------- end to end on the default model
def test_needle_sweep_end_to_end(tmp_path):
    """~1K tokens with the answer prefix: exact attention recalls; k=64 covers all 32 blocks and
    must equal exact attention bit for bit; outputs are written."""
    from sparrow_lab.bench import needle

    rec = needle.main(
        ["--lengths", "1K", "--depths", "50", "--ks", "64,1", "--max-tokens", "8", "--out", str(tmp_path), "--no-plots"]
    )
    rows = {r["config"]: r for r in rec["rows"]}
    assert set(rows) == {"exact", "sparse k=64", "sparse k=1"}
    ex, full = rows["exact"], rows["sparse k=64"]
    assert abs(ex["n_prompt"] - 1024) <= 0.05 * 1024
    assert ex["score"] == 1.0, ex["text"]
    assert full["text"] == ex["text"] and full["first_diff"] is None
    assert full["kl_mean"] == 0.0 and full["top1"] == 1.0
    assert full["mass"]["p5"] == pytest.approx(1.0, abs=1e-6)
    assert rows["sparse k=1"]["mass"]["median"] < 1.0
    saved = json.load(open(tmp_path / "needle.json"))
    assert saved["rows"] == json.loads(json.dumps(rec["rows"]))
    md = (tmp_path / "needle.md").read_text()
    assert re.search(r"^\| exact \| 100% \(1\) \|", md, re.M)


def test_shared_prefill_decoding_matches_llm_stream():
    """The benches decode every configuration from one exact prefill, or with sparse prefill
    from its own; the text must be what llm.stream gives for the same prompt and sparse settings."""
    import sparrow
    from sparrow.params import SparseParams

    llm = sparrow.load()
    p = prompts.make_prompt(llm.tokenizer, "needle", 300, 0.5, seed=2)
    configs = [None, SparseParams(k=2, block=16, probe=4), SparseParams(k=2, select="v2", prefill=True)]
    rows = fid.run_prompt(llm, p.ids, configs, n_tokens=6, fidelity=False)
    for sp, row in zip(configs, rows):
        kw = (
            {}
            if sp is None
            else {
                "sparse_attn": True,
                "sparse_k": sp.k,
                "sparse_block": sp.block,
                "sparse_probe": sp.probe,
                "sparse_prefill": sp.prefill,
                "sparse_select": sp.select,
            }
        )
        ids = [
            o.token_id
            for o in llm.stream(p.messages, max_tokens=6, chat=True, assistant_prefix=p.assistant_prefix, **kw)
        ]
        assert row["tokens"] == ids, row["config"]
        # the prompt's last position is compared even without the teacher-forced pass
        assert ("kl_prompt" in row) == (sp is not None and sp.prefill) and row.get("kl_prompt", 1.0) > 0


def test_fidelity_with_sparse_prefill(tmp_path):
    """`bench fidelity --sparse-prefill`: k=2 blocks over a ~300-token prompt, so the sparse
    prefill changes the prompt's KV: the KL differs from the run without the flag, the prompt's
    last-position KL is the one computed directly from the model's logits, the rows and the
    record say sparse prefill was on, and exact stays exact prefill and decode."""
    import sparrow
    from sparrow.params import SparseParams
    from sparrow_lab.bench import fidelity

    args = ["--lengths", "300", "--depths", "50", "--ks", "2", "--selectors", "seed,v2", "--max-tokens", "6"]
    runs = {}
    for flag in (False, True):
        out = tmp_path / str(flag)
        rec = fidelity.main([*args, "--out", str(out), "--no-plots"] + (["--sparse-prefill"] if flag else []))
        runs[flag] = {r["config"]: r for r in rec["rows"]}
        assert rec["sparse_prefill"] is flag
    on, off = runs[True], runs[False]
    assert set(on) == {"exact", "sparse k=2 sparse-prefill", "v2 k=2 sparse-prefill"}
    assert on["exact"]["text"] == off["exact"]["text"] and "kl_prompt" not in on["exact"]
    md = (tmp_path / "True" / "fidelity.md").read_text()
    assert "sparse prefill on" in md and "### Sparse prefill: prefill time" in md
    llm = sparrow.load()
    p = prompts.make_prompt(llm.tokenizer, "needle", 300, 0.5, seed=0)
    exact_last = llm.logits(p.ids)[-1]  # [V]
    for sel, name in (("seed", "sparse k=2"), ("v2", "v2 k=2")):
        row = on[name + " sparse-prefill"]
        assert row["sparse_prefill"] and row["steps"] == on["exact"]["steps"] > 0
        assert row["kl_mean"] != off[name]["kl_mean"]
        sparse_last = llm.logits(p.ids, sparse=SparseParams(k=2, select=sel, prefill=True))[-1]
        kl = float(fid.kl_per_token(exact_last[None], sparse_last[None])[0])
        # llm.logits runs the head over every position (another summation order than the
        # prefill's last-row head), so the two agree to float32 rounding, not bit for bit
        assert kl > 0 and row["kl_prompt"] == pytest.approx(kl, rel=1e-5)
        assert "kl_prompt" not in off[name]
