"""The fused decode step (models/fused.py, kernels/fused/decode_step.py) gives the staged path's bits:
every architecture, KV storage kind and attention mode, on 1 and 2 threads, and a sequence
decoded alone (fused) equals the same sequence decoded in a batch, fused or staged."""

import copy

import numba
import numpy as np
import pytest

import sparrow
from conftest import prompt
from sparrow.kernels.runtime import set_threads
from sparrow.models import fused as fused_mod
from sparrow.models.decoder import Segment
from sparrow.params import SparseParams

SPARSE = {
    "exact": None,
    "k1": SparseParams(k=1, block=8, probe=4),
    "k2": SparseParams(k=2, block=8, probe=2),
    "k3b16": SparseParams(k=3, block=16, probe=8),
    "v2k2": SparseParams(k=2, block=8, select="v2", dense_layers=0),
    "v2k3d1": SparseParams(k=3, block=16, select="v2", dense_layers=1),
    "v2norecent": SparseParams(k=2, block=8, select="v2", recent=False),  # scores the block a token completes
}


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    """A busy test machine must not send the fused steps these tests compare to the staged path."""
    monkeypatch.setattr(fused_mod, "BACKOFF_STEPS", 0)


def _decode(llm, ids, n_prefill, sparse, fused, kv="f32"):
    """Logits [len(ids) - n_prefill, V] of single-token decode steps after a prefill."""
    llm.model.use_fused = fused
    plan = llm.model.fused_step()
    before = plan.steps if plan else 0
    if plan:
        plan.backoff = 0  # left over from an earlier test's contended step
    try:
        cache = llm.model.new_cache(len(ids), kv)
        llm.model.forward([Segment(ids[:n_prefill], cache, 0)])
        rows = [
            llm.model.forward([Segment(ids[i : i + 1], cache, i, sparse, decode=True)])[0]
            for i in range(n_prefill, len(ids))
        ]
        ran = (plan.steps if plan else 0) - before
        assert ran == (len(ids) - n_prefill if fused and plan else 0)  # every step took the path meant
        return np.stack(rows)
    finally:
        llm.model.use_fused = True


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch):
    """The tests here assert which path ran: a contended step on a busy machine must not send
    the next ones to the staged path (the back-off test sets its own BACKOFF_STEPS)."""
    monkeypatch.setattr(fused_mod, "BACKOFF_STEPS", 0)


@pytest.fixture(scope="module")
def q8_models(tiny_models):
    return {arch: sparrow.load(t.folder, quantize="q8_0", threads=2) for arch, t in tiny_models.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kv", ["f32", "f16", "int8"])
def test_fused_equals_staged_on_tiny_models(q8_models, arch, kv):
    llm = q8_models[arch]
    assert llm.model.fused_step() is not None  # q8_0 projections: the fused step applies
    ids = prompt(60, seed=3)
    for name, sp in SPARSE.items():
        staged = _decode(llm, ids, 20, sp, fused=False, kv=kv)
        fused = _decode(llm, ids, 20, sp, fused=True, kv=kv)
        assert fused.tobytes() == staged.tobytes(), f"{arch} {kv} {name}"


def test_fused_equals_staged_on_the_default_model_both_thread_counts(default_llm):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.fail("this machine gives numba one thread; the 2-thread fused step is not exercised")
    ids = np.asarray(default_llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 30)[:300])
    try:
        for sp in (None, SparseParams(k=2), SparseParams(k=4, block=16, probe=4), SparseParams(k=3, select="v2")):
            staged = _decode(default_llm, ids, 260, sp, fused=False, kv="f16")
            for threads in (1, 2):
                set_threads(threads)
                assert numba.get_num_threads() == threads
                fused = _decode(default_llm, ids, 260, sp, fused=True, kv="f16")
                assert fused.tobytes() == staged.tobytes(), (sp, threads)
    finally:
        set_threads(default_llm.threads)


@pytest.mark.parametrize("sp", [None, SparseParams(k=2, block=4, select="v2")], ids=["exact", "v2"])
def test_alone_fused_equals_in_a_batch_staged(default_llm, sp):
    """The server decodes a request alone or beside others (a fused step per attention setting
    of the batch; staged with fused=False): same bits."""
    a = np.asarray(default_llm.tokenizer.encode("Alpha beta gamma delta epsilon zeta eta theta " * 3))
    b = np.asarray(default_llm.tokenizer.encode("One two three four five six seven eight nine ten"))
    caches = [default_llm.model.new_cache(60, "int8") for _ in range(2)]
    for ids, c in zip((a, b), caches):
        default_llm.model.forward([Segment(ids[:-1], c, 0)])
    both = default_llm.model.forward(
        [Segment(a[-1:], caches[0], len(a) - 1, sp, decode=True), Segment(b[-1:], caches[1], len(b) - 1, decode=True)]
    )  # staged
    c = default_llm.model.new_cache(60, "int8")
    default_llm.model.forward([Segment(a[:-1], c, 0)])
    alone = default_llm.model.forward([Segment(a[-1:], c, len(a) - 1, sp, decode=True)])  # fused
    assert default_llm.model.fused_step() is not None
    assert alone[0].tobytes() == both[0].tobytes()


def _batch_step(llm, seqs, kv, fused, sparse=None, every=False):
    """One decode row of each sequence after its prefill, in one forward -> logits [B, V];
    sparse: the first row's settings, or with every all rows'."""
    llm.model.use_fused = fused
    try:
        caches = [llm.model.new_cache(len(ids), kv) for ids in seqs]
        for ids, c in zip(seqs, caches):
            llm.model.forward([Segment(ids[:-1], c, 0)])
        segs = [Segment(ids[-1:], c, len(ids) - 1, sparse if i == 0 or every else None, decode=True)
                for i, (ids, c) in enumerate(zip(seqs, caches))]  # fmt: skip
        out = llm.model.forward(segs)
        assert all(c.length == len(ids) for ids, c in zip(seqs, caches))
        return out
    finally:
        llm.model.use_fused = True


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kv", ["f32", "f16", "int8"])
def test_a_batch_of_sequences_runs_fused_with_each_sequence_s_own_bits(q8_models, arch, kv):
    """Decode rows of several sequences (different lengths, so different positions, caches and
    selections) go through one fused step: each row's logits are those of its sequence's step
    alone and of the staged batch, on 1 and 2 threads, exact or with every row's sparse settings
    the same; a batch whose rows' settings differ runs one fused step per setting."""
    llm = q8_models[arch]
    plan = llm.model.fused_step()
    seqs = [prompt(n, seed=n) for n in (9, 23, 40)]
    staged = _batch_step(llm, seqs, kv, fused=False)
    alone = np.concatenate([_batch_step(llm, [ids], kv, fused=True) for ids in seqs])
    assert alone.tobytes() == staged.tobytes()
    try:
        for threads in (1, 2):
            set_threads(threads)
            before = plan.batched
            fused = _batch_step(llm, seqs, kv, fused=True)
            assert plan.batched == before + 1  # the batch took the fused step
            assert fused.tobytes() == staged.tobytes(), (arch, kv, threads)
            assert _batch_step(llm, seqs[:2], kv, fused=True).tobytes() == staged[:2].tobytes()
        for name, sp in SPARSE.items():
            if sp is None:
                continue
            staged = _batch_step(llm, seqs, kv, fused=False, sparse=sp, every=True)
            alone = np.concatenate([_batch_step(llm, [ids], kv, fused=True, sparse=sp) for ids in seqs])
            assert alone.tobytes() == staged.tobytes(), name
            before = plan.batched
            fused = _batch_step(llm, seqs, kv, fused=True, sparse=sp, every=True)
            assert plan.batched == before + 1, name
            assert fused.tobytes() == staged.tobytes(), (arch, kv, name)
        before, steps = plan.batched, plan.steps
        sp = SparseParams(k=1, block=8, probe=4)
        mixed = _batch_step(llm, seqs, kv, fused=True, sparse=sp)
        # one sparse row among exact ones: the exact rows' batch step, then the sparse row's own
        assert (plan.batched, plan.steps) == (before + 1, steps + 2)
        assert mixed.tobytes() == _batch_step(llm, seqs, kv, fused=False, sparse=sp).tobytes()
    finally:
        set_threads(llm.threads)


def test_unsupported_models_take_the_staged_path(tiny_models):
    llm = sparrow.load(tiny_models["qwen3"].folder)  # f32 projections: no fused step
    assert llm.model.fused_step() is None
    ids = prompt(12)
    assert _decode(llm, ids, 8, None, fused=True).tobytes() == _decode(llm, ids, 8, None, fused=False).tobytes()


@pytest.mark.parametrize("seqs", [1, 2, "verify"])
def test_contention_backs_off_to_the_staged_path(default_llm, monkeypatch, seqs):
    """After a step whose barriers waited long (another process took a core), the next
    BACKOFF_STEPS steps the fused path would take run staged, then the fused step is tried
    again; a contended fused step backs off again only while the staged steps measured
    faster. The same for a sequence's steps, a batch's (2 sequences) and verification's."""
    monkeypatch.setattr(fused_mod, "BACKOFF_STEPS", 3)
    plan = default_llm.model.fused_step()
    ids = np.asarray(default_llm.tokenizer.encode("one two three four five six seven eight nine"))
    caches = [default_llm.model.new_cache(len(ids) + 40, "f32") for _ in range(2)]
    for cache in caches:
        default_llm.model.forward([Segment(ids, cache, 0)])
    pos = len(ids)
    plan.backoff = 0
    orig_run = plan._run

    def run_contended(cache, args):  # as if every barrier had had to yield
        orig_run(cache, args)
        plan.sync[2] = 10**6

    monkeypatch.setattr(plan, "_run", run_contended)
    orig_staged = plan.staged_step
    staged_took = {"s": 0.0}

    def staged_step(*args):  # the staged steps' measured time, as the test needs it
        out = orig_staged(*args)
        plan.staged_s = staged_took["s"]
        return out

    monkeypatch.setattr(plan, "staged_step", staged_step)

    def run(n, first):
        ran = []
        for i in range(first, first + n):
            before = plan.steps
            tok = ids[i % len(ids) : i % len(ids) + 1]
            if seqs == "verify":  # two rows of one sequence, each step
                segs = [Segment(tok, caches[0], pos + 2 * i + j, decode=True) for j in range(2)]
            else:
                segs = [Segment(tok, c, pos + i, decode=True) for c in caches[:seqs]]
            default_llm.model.forward(segs)
            ran.append(plan.steps - before)
        return ran

    plan.staged_s = None
    assert run(6, 0) == [1, 0, 0, 0, 1, 0]  # staged steps measured faster: back off again
    staged_took["s"] = 1e9
    assert run(4, 6) == [0, 0, 1, 1]  # the rest of that back-off, then slower staged steps: stay fused


def test_barrier_counts_only_waits_past_the_spin():
    """Workers' own imbalance (one arrives ~0.3 ms late) is not contention; a partner gone
    for longer than the spin (as when another process holds its core) is counted once."""
    from numba import njit, prange

    from sparrow.kernels.fused import sync as _sync

    @njit(parallel=True)
    def meet(sync, late_rounds):
        for tid in prange(2):
            if tid == 1:
                _sync._pause_rounds(sync, late_rounds)  # reads sync[1]: harmless to the barrier
            _sync.barrier(sync, 2)

    set_threads(2)
    assert numba.get_num_threads() == 2
    per_ms = _sync.spin_rounds(1e-3)
    assert _sync.spin_rounds() == pytest.approx(per_ms * _sync.SPIN_SECONDS / 1e-3, rel=0.01)

    def waits(late):
        sync = np.zeros(4, np.int64)
        sync[3] = _sync.spin_rounds()
        meet(sync, late)
        return int(sync[2])

    # best of 20: on a busy machine a worker can also lose its core for a time slice (best of 3
    # failed once at load average 2.5 on 2 CPUs); one clean meeting shows the spin absorbs it
    assert min(waits(per_ms // 3) for _ in range(20)) == 0
    assert waits(per_ms * 20) == 1


def test_fused_runs_k_quant_files_with_mixed_groups(tmp_path):
    """A Q4_K_M-style file (q4_k with q6_k v/down in some layers, so q/k/v cannot be one
    weight there): the fused step runs q/k/v as pieces and gives the staged path's bits,
    on 1 and 2 threads, in both activation modes."""
    from sparrow_lab.bench import shapes

    tiny_k = dict(
        hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=512, tied=True,
        rope_theta=1e6, rms_eps=1e-6, context=256,
    )  # fmt: skip
    path = shapes.write_gguf(str(tmp_path / "tiny-k.gguf"), tiny_k, "q4_k_m", name="tiny")
    llm = sparrow.load(path)
    assert any(lay.attn.qkv_proj.fused is None for lay in llm.model.layers)  # mixed q/k/v somewhere
    assert {lay.mlp.down.qtype for lay in llm.model.layers} == {"q4_k", "q6_k"}
    assert llm.model.fused_step() is not None
    ids = np.random.default_rng(3).integers(0, 486, 24)
    for mode in ("f32", "q8"):
        llm_m = llm.with_activations(mode)
        for threads in (1, 2):
            set_threads(threads)
            assert numba.get_num_threads() == threads
            fused = _decode(llm_m, ids, 16, None, fused=True)
            assert fused.tobytes() == _decode(llm_m, ids, 16, None, fused=False).tobytes(), (mode, threads)


TINY_MOE = dict(
    hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=768, vocab=512, tied=False, rope_theta=1e6,
    rms_eps=1e-6, context=256, arch="qwen3moe", experts=8, experts_used=3, expert_ffn=256,
)  # fmt: skip


def test_fused_runs_moe_files(tmp_path):
    """A qwen3moe file (the qwen3-30b-a3b shape's layout, small): the fused step runs its MoE
    layers (kernels/fused/moe_phase.py) with the staged path's bits, on 1 and 2 threads, in
    both activation modes, Q4_K_M (q4_k experts, q6_k down in one layer) and Q8_0: a
    sequence's decode steps, a batch of three sequences' rows (each row its sequence's own
    step's bits; rows share routed experts) and verification's rows of one sequence."""
    from sparrow.kernels.moe import ExpertTable
    from sparrow.models.qwen3_moe import MoEBlock
    from sparrow_lab.bench import shapes

    ids = np.random.default_rng(4).integers(0, 486, 24)
    seqs = [np.random.default_rng(n).integers(0, 486, n) for n in (9, 17, 24)]
    for qtype in ("q4_k_m", "q8_0"):
        path = shapes.write_gguf(str(tmp_path / f"tiny-moe-{qtype}.gguf"), TINY_MOE, qtype, name="tiny")
        llm = sparrow.load(path)
        mlps = [lay.mlp for lay in llm.model.layers]
        assert all(isinstance(m, MoEBlock) and isinstance(m.stacked, ExpertTable) for m in mlps)
        if qtype == "q4_k_m":
            assert [m.experts[0].down.qtype for m in mlps] == ["q4_k", "q6_k"]
        assert llm.model.fused_step() is not None and llm.model.fused_step().moe is not None
        for mode in ("f32", "q8"):
            llm_m = llm.with_activations(mode)
            for threads in (1, 2):
                set_threads(threads)
                fused = _decode(llm_m, ids, 16, None, fused=True)
                staged = _decode(llm_m, ids, 16, None, fused=False)
                assert fused.tobytes() == staged.tobytes(), (qtype, mode, threads)
                plan = llm_m.model.fused_step()
                before = plan.batched
                batch = _batch_step(llm_m, seqs, "f16", fused=True)
                assert plan.batched == before + 1
                assert batch.tobytes() == _batch_step(llm_m, seqs, "f16", fused=False).tobytes(), (qtype, mode)
                alone = np.concatenate([_batch_step(llm_m, [s], "f16", fused=True) for s in seqs])
                assert batch.tobytes() == alone.tobytes(), (qtype, mode, threads)
                cache = llm_m.model.new_cache(len(ids), "f32")
                llm_m.model.forward([Segment(ids[:16], cache, 0)])
                before = plan.verified
                rows = llm_m.model.forward([Segment(ids[i : i + 1], cache, i, decode=True) for i in range(16, 24)])
                assert plan.verified == before + 1
                assert rows.tobytes() == fused.tobytes(), (qtype, mode, threads)


@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_verification_rows_of_several_sequences_run_as_one_fused_batch(q8_models, kv):
    """Speculating sequences verified together (Runner.verify with several slots): each
    sequence's rows at consecutive positions, beside a sequence's lone decode row, go through
    one fused batch step, every row with the bits of a decode step at its position; a group
    holding one sequence's rows alone takes its verification step."""
    llm = q8_models["qwen3"]
    plan = llm.model.fused_step()
    seqs = [prompt(n, seed=n) for n in (12, 20, 31)]
    feed = [prompt(4, seed=40 + i) for i in range(3)]
    counts = (3, 1, 4)  # rows each sequence verifies
    plain, caches = [], []
    for ids, toks, n in zip(seqs, feed, counts):
        cache = llm.model.new_cache(len(ids) + n, kv)
        llm.model.forward([Segment(ids, cache, 0)])
        caches.append(copy.deepcopy(cache))
        plain.append([llm.model.forward([Segment(toks[j : j + 1], cache, len(ids) + j, decode=True)])[0]
                      for j in range(n)])  # fmt: skip
    segs = [Segment(toks[j : j + 1], cache, len(ids) + j, decode=True)
            for ids, toks, n, cache in zip(seqs, feed, counts, caches) for j in range(n)]  # fmt: skip
    assert plan.batches(segs)
    before = plan.batched, plan.verified
    rows = llm.model.forward(segs)  # [8, V]
    assert (plan.batched, plan.verified) == (before[0] + 1, before[1])
    want = np.stack([row for p in plain for row in p])
    assert rows.tobytes() == want.tobytes()
    assert [c.length for c in caches] == [len(ids) + n for ids, n in zip(seqs, counts)]
    # rows out of order, or several rows of a sequence with sparse attention, are not a batch
    assert not plan.batches([segs[1], segs[0]])
    sp = SparseParams(k=1, block=8, probe=4)
    assert not plan.batches([Segment(s.tokens, s.cache, s.start, sp, decode=True) for s in segs[:2]])
    # a settings group holding one sequence's rows alone: its verification step
    mixed = [Segment(s.tokens, s.cache, s.start, sp if i == 3 else None, decode=True) for i, s in enumerate(segs)]
    for c, ids in zip(caches, seqs):
        c.rollback(len(ids))
    before = plan.verified
    out = llm.model.forward([s for i, s in enumerate(mixed) if i < 4])  # sequence 0's 3 rows, sequence 1's sparse row
    assert plan.verified == before + 1
    assert out[:3].tobytes() == want[:3].tobytes()
