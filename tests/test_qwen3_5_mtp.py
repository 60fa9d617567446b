"""Qwen3.5's multi-token-prediction layer (models/qwen3_5_mtp.py) and the `mtp` drafter.

The tiny models of test_qwen3_5.py get an MTP layer of random weights added to their saved
safetensors (as real checkpoints carry it, `mtp.*`; transformers ignores them at load): its
decoder layer is the layer of a one-layer transformers model of the same config, so the
reference runs transformers' own modules (that model with the MTP's final norm and the
target's lm_head, fed fc(concat(norm_e(embed), norm_h(hidden))) as vLLM's
Qwen3_5MultiTokenPredictor defines it, with transformers' Qwen3.5 RMSNorm).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from test_qwen3_5 import PROMPT, SPECS, _as_conditional_generation, _build, _seed, assert_same_run
from test_qwen3_5 import _run as run_sequence

import sparrow
from reference_models import save_default_tokenizer
from sparrow.api import set_threads
from sparrow.engine.generate import generate_step
from sparrow.engine.sequence import Sequence
from sparrow.engine.speculative import MTPDrafter, make_speculator
from sparrow.errors import SparrowError
from sparrow.kernels.linear import linear
from sparrow.models import fused as fused_mod
from sparrow.models.decoder import Segment
from sparrow.params import SamplingParams, SpeculativeParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

E = SPECS["dense"]["hidden_size"]


def _classes(kind: str):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    return {
        "dense": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
        "moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
    }[kind]


def _rms_norm_class(kind: str):
    if kind == "moe":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

        return Qwen3_5MoeRMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    return Qwen3_5RMSNorm


def _mtp_layer_model(kind: str, seed: int, scale: float, tmp: str, spec: dict | None = None):
    """A one-layer transformers model (full attention) whose layer is the MTP's decoder layer,
    seeded as test_qwen3_5 seeds its models, matrices times `scale` -> (model, its layer's
    tensors as the checkpoint names them, mtp.layers.0.*)."""
    from safetensors.numpy import load_file

    cfg_cls, model_cls = _classes(kind)
    spec = spec or SPECS[kind]
    one = model_cls(cfg_cls(**dict(spec, num_hidden_layers=1, layer_types=["full_attention"]))).float().eval()
    _seed(one, seed)
    with torch.no_grad():
        for name, p in one.named_parameters():
            if name.startswith("model.layers.") and p.ndim > 1:
                p.mul_(scale)
    one.save_pretrained(tmp)
    saved = load_file(os.path.join(tmp, "model.safetensors"))
    layer = {
        "mtp.layers.0." + k[len("model.layers.0.") :]: v for k, v in saved.items() if k.startswith("model.layers.0.")
    }
    return one, layer


def _add_mtp(folder: str, tensors: dict) -> None:
    """Writes the MTP tensors beside the model's in its safetensors file, and says so in config.json."""
    from safetensors.numpy import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    saved = load_file(path)
    saved.update(tensors)
    save_file(saved, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["mtp_num_hidden_layers"] = 1
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)


def _random_head(rng) -> dict:
    return {
        "mtp.fc.weight": rng.normal(0.0, 0.2, (E, 2 * E)).astype(np.float32),
        "mtp.pre_fc_norm_embedding.weight": rng.normal(0.0, 0.3, E).astype(np.float32),
        "mtp.pre_fc_norm_hidden.weight": rng.normal(0.0, 0.3, E).astype(np.float32),
        "mtp.norm.weight": rng.normal(0.0, 0.3, E).astype(np.float32),
    }


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    """kind -> (folder with the MTP layer, its ConditionalGeneration copy, the plain folder without
    one, the target transformers model, the one-layer model holding the MTP layer, the head's tensors)."""
    root = tmp_path_factory.mktemp("qwen3_5_mtp")
    tok = str(root / "tok")
    save_default_tokenizer(tok)
    out = {}
    for kind, seed in (("dense", 7), ("moe", 8)):
        plain = str(root / f"{kind}_plain")
        ref = _build(kind, plain, tok)
        folder = str(root / kind)
        shutil.copytree(plain, folder)
        one, layer = _mtp_layer_model(kind, seed + 100, 1.0, str(root / f"{kind}_one"))
        head = _random_head(np.random.default_rng(seed + 200))
        _add_mtp(folder, {**layer, **head})
        cg = str(root / f"{kind}_cg")
        _as_conditional_generation(folder, cg, kind)
        out[kind] = (folder, cg, plain, ref, one, head)
    return out


def _reference_logits(kind, ref, one, head, ids) -> np.ndarray:
    """transformers' modules: the MTP's logits at positions 0..T-2 of ids [T] (those of tokens 2..T)."""
    norm_cls = _rms_norm_class(kind)
    eps = SPECS[kind]["rms_norm_eps"]

    def norm(name):
        n = norm_cls(E, eps=eps)
        with torch.no_grad():
            n.weight.copy_(torch.from_numpy(head[name]))
        return n

    with torch.no_grad():
        t = torch.tensor(ids[None])
        h = ref.model(t).last_hidden_state[0]  # [T, E] after the target's final norm
        emb = ref.model.embed_tokens(t)[0]  # [T, E]
        e, hh = norm("mtp.pre_fc_norm_embedding.weight")(emb[1:]), norm("mtp.pre_fc_norm_hidden.weight")(h[:-1])
        x = torch.cat([e, hh], -1)  # embedding first
        x = torch.nn.functional.linear(x, torch.from_numpy(head["mtp.fc.weight"]))  # [T-1, E]
        one.model.norm.weight.copy_(torch.from_numpy(head["mtp.norm.weight"]))
        one.lm_head.weight.copy_(ref.lm_head.weight)
        return one(inputs_embeds=x[None]).logits[0].numpy()  # positions 0..T-2


def _hidden_rows(model, ids) -> np.ndarray:
    """sparrow's final-normed hidden rows of a prefill over ids (KVCache.hidden) -> [T, E]."""
    cache = model.new_cache(len(ids) + 1)
    cache.hidden = {}
    model.forward([Segment(ids, cache, 0)])
    return np.stack([cache.hidden[p] for p in range(len(ids))])


def _head_logits(model, ids, hidden, split: int) -> np.ndarray:
    """The MTP head's logits at positions 0..T-2: positions < split in one forward, the rest one
    row at a time (as drafting feeds it)."""
    mtp, T = model.mtp, len(ids)
    cache = mtp.new_cache(T)
    rows = [mtp.forward(model, ids[1 : split + 1], hidden[:split], cache, 0, range(split), last_only=False)[0]]
    for p in range(split, T - 1):
        rows.append(mtp.forward(model, ids[p + 1 : p + 2], hidden[p : p + 1], cache, p, [p])[0])
    return np.concatenate(rows)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_mtp_head_matches_transformers_modules(mtp_models, kind):
    folder, cg, _, ref, one, head = mtp_models[kind]
    want = _reference_logits(kind, ref, one, head, PROMPT)  # [T-1, V]
    for path in (folder, cg):
        model = sparrow.load(path, threads=2).model
        assert model.mtp is not None
        hidden = _hidden_rows(model, PROMPT)
        for split in (len(PROMPT) - 1, 90):  # every row in one forward; 90, then row by row
            got = _head_logits(model, PROMPT, hidden, split)
            # f32 noise of the target's hidden state (the delta rule's two orders, see
            # test_qwen3_5) carried through the head: measured 9.5e-6 (dense) and 1.8e-5 (MoE)
            # of the largest logit, 2026-12-07
            err = np.abs(got - want).max()
            assert err <= 1e-4 * np.abs(want).max(), (path, split, err)
            assert np.array_equal(got.argmax(1), want.argmax(1))


def test_hidden_rows_are_the_rows_the_head_reads(mtp_models):
    """KVCache.hidden holds, per position, the final-normed row whose lm_head product is that
    position's logits, and a rollback drops the positions it drops."""
    model = sparrow.load(mtp_models["dense"][0], threads=2).model
    ids = PROMPT[:40]
    cache = model.new_cache(64)
    cache.hidden = {}
    logits = model.forward([Segment(ids[:30], cache, 0)])
    assert np.array_equal(linear(np.ascontiguousarray(cache.hidden[29][None]), model.lm_head), logits)
    with cache.keeping_every_row():  # verification's rows, which a rollback returns into
        rows = model.forward([Segment(ids[p : p + 1], cache, p, decode=True) for p in range(30, 40)])
    assert np.array_equal(linear(np.stack([cache.hidden[p] for p in range(30, 40)]), model.lm_head), rows)
    cache.rollback(33)
    assert sorted(cache.hidden) == list(range(33))


def _predictable(kind: str, root: str, tok: str, spec: dict | None = None) -> str:
    """A tiny Qwen3.5 whose layers barely move the residual stream (matrices times 0.1, a near
    bigram model) with an MTP head that drafts the bigram's next token: fc passes the normed
    embedding of t_{i+1} only, its layer's matrices are small, its final norm is the target's.
    Its drafts are often kept and sometimes refused."""
    spec = spec or SPECS[kind]
    folder = os.path.join(root, kind)
    cfg_cls, model_cls = _classes(kind)
    model = model_cls(cfg_cls(**spec)).float().eval()
    _seed(model, 21)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.layers.") and p.ndim > 1:
                p.mul_(0.1)
    model.save_pretrained(folder)
    for f in os.listdir(tok):
        shutil.copy(os.path.join(tok, f), folder)
    _, layer = _mtp_layer_model(kind, 22, 0.05, os.path.join(root, kind + "_one"), spec)
    E = spec["hidden_size"]
    final = model.model.norm.weight.detach().numpy().copy()
    head = {
        "mtp.fc.weight": np.concatenate([np.eye(E), np.zeros((E, E))], axis=1).astype(np.float32),
        "mtp.pre_fc_norm_embedding.weight": np.zeros(E, np.float32),
        "mtp.pre_fc_norm_hidden.weight": np.zeros(E, np.float32),
        "mtp.norm.weight": final,
    }
    _add_mtp(folder, {**layer, **head})
    return folder


@pytest.fixture(scope="module")
def predictable_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5_mtp_predictable")
    tok = str(root / "tok")
    save_default_tokenizer(tok)
    return {kind: _predictable(kind, str(root), tok) for kind in ("dense", "moe")}


# block-shaped (every projection's input a multiple of 32), so that q8_0 runs the fused step
BLOCKS = dict(
    num_attention_heads=2, head_dim=32, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16
)
BLOCK_SPECS = {
    "dense": dict(SPECS["dense"], **BLOCKS, hidden_size=64, intermediate_size=96),
    "moe": dict(SPECS["moe"], **BLOCKS, hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64),
}


@pytest.fixture(scope="module")
def predictable(predictable_folders):
    return {kind: sparrow.load(folder, threads=2) for kind, folder in predictable_folders.items()}


def _run(llm, ids, sampling, spec=None):
    """(tokens, every sampled position's logits, the sequence cache, the speculator)."""
    return run_sequence(llm, ids, sampling, spec=spec, with_speculator=True)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.3, seed=3, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_mtp_speculative_decoding_equals_plain(predictable, kind, sampling):
    llm = predictable[kind]
    ids = [int(t) for t in PROMPT[:30]]
    plain = _run(llm, ids, sampling)
    # sampled drafts are kept less often (the draw must pick the same token from two
    # distributions): drafting at every step gives several kept and refused ones in 40 tokens
    spec = SpeculativeParams(method="mtp", tokens=3, adaptive=sampling.temperature == 0)
    got = _run(llm, ids, sampling, spec)
    assert_same_run(got, plain)
    counts = got[3].counts
    # several rounds, drafts kept and drafts refused
    assert 0 < counts["accepted_tokens"] < counts["drafted_tokens"], counts
    assert got[2].hidden is None  # released: the prefix cache keeps no hidden rows


def _hidden_after_steps(model, ids, fused: bool) -> dict:
    """A cache's hidden rows after a prefill of ids[:20], four decode steps and a verification
    of four rows, on the fused or the staged path."""
    model.use_fused = fused
    try:
        cache = model.new_cache(64)
        cache.hidden = {}
        model.forward([Segment(ids[:20], cache, 0)])
        for p in range(20, 24):
            model.forward([Segment(ids[p : p + 1], cache, p, decode=True)])
        with cache.keeping_every_row():
            model.forward([Segment(ids[p : p + 1], cache, p, decode=True) for p in range(24, 28)])
        return cache.hidden
    finally:
        model.use_fused = True


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_mtp_speculative_decoding_takes_the_fused_step(tmp_path, kind, monkeypatch):
    """In Q8_0 the target's decode and verification steps run fused while the drafter reads
    their hidden rows: the fused step writes, at the same positions, the bits the staged head
    writes; and speculation with the MTP layer gives plain decoding's tokens, logits and state."""
    monkeypatch.setattr(fused_mod, "BACKOFF_STEPS", 0)  # a busy machine must not send steps staged
    save_default_tokenizer(str(tmp_path / "tok"))
    folder = _predictable(kind, str(tmp_path), str(tmp_path / "tok"), BLOCK_SPECS[kind])
    llm = sparrow.load(folder, quantize="q8_0", threads=2)
    plan = llm.model.fused_step()
    assert plan is not None
    plan.backoff = 0
    ids = np.array([int(t) for t in PROMPT[:30]])
    single, verified = plan.steps - plan.verified, plan.verified
    fused = _hidden_after_steps(llm.model, ids, fused=True)
    assert plan.steps - plan.verified == single + 4 and plan.verified == verified + 1  # both kinds ran fused
    staged = _hidden_after_steps(llm.model, ids, fused=False)
    assert sorted(fused) == sorted(staged) == list(range(28))
    for p in range(28):
        assert fused[p].tobytes() == staged[p].tobytes(), p
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = _run(llm, [int(t) for t in ids], sampling)
    verified = plan.verified
    got = _run(llm, [int(t) for t in ids], sampling, SpeculativeParams(method="mtp", tokens=3))
    assert plan.verified > verified  # the request's verifications ran fused
    assert_same_run(got, plain)
    assert 0 < got[3].counts["accepted_tokens"] < got[3].counts["drafted_tokens"], got[3].counts


def test_mtp_drafter_keeps_only_verified_rows_in_its_cache(predictable):
    """After each step the head's cache holds one row per position the target made final
    before that step's last sample, every one made from the target's own hidden state; its
    rows equal those of one forward over the same positions afterwards."""
    llm = predictable["dense"]
    ids = [int(t) for t in PROMPT[:30]]
    sampling = SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True)
    set_threads(llm.threads)
    seq = Sequence.create(llm.runner, llm.tokenizer, ids, sampling, llm.ctx, "f32", None)
    spec = make_speculator(llm.handle, llm.runner, SpeculativeParams(method="mtp", tokens=4), seq, "f32")
    drafter = spec.drafter
    assert isinstance(drafter, MTPDrafter)
    lengths = []
    for _ in generate_step(llm.runner, seq, spec=spec):
        lengths.append((drafter.base + drafter.cache.length, seq.slot.cache.length))
    assert all(m <= L for m, L in lengths)
    n = drafter.cache.length
    assert drafter.base == 0 and n > len(ids)
    # the same rows from scratch: the target's hidden rows over the final text, one head forward
    model = llm.model
    text = np.concatenate([seq.prompt, np.asarray(seq.output, np.int64)])
    hidden = _hidden_rows(model, text[: n + 1])
    cache = model.mtp.new_cache(n + 1)
    model.mtp.forward(model, text[1 : n + 1], hidden[:n], cache, 0, range(n))
    k = drafter.cache.layers[0].k[:, :n]
    want = cache.layers[0].k[:, :n]
    # rows computed in other splits (prefill and decode kernels): the same values up to f32 order
    assert np.abs(k - want).max() <= 1e-4 * np.abs(want).max()
    spec.release()


def test_mtp_bad_input_gets_one_line_errors(mtp_models, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder, _, plain, *_ = mtp_models["dense"]
    llm = sparrow.load(plain, threads=2)
    assert llm.model.mtp is None  # a file without the layer loads as before
    with pytest.raises(SparrowError, match="has no MTP layer") as e:
        list(llm.stream([int(t) for t in PROMPT[:10]], max_tokens=3, speculative="mtp"))
    assert "\n" not in str(e.value)

    def edited(name, edit):
        dst = str(tmp_path / name)
        shutil.copytree(folder, dst)
        path = os.path.join(dst, "model.safetensors")
        t = load_file(path)
        edit(t)
        save_file(t, path, metadata={"format": "pt"})
        return dst

    def fc(t):
        t["mtp.fc.weight"] = t["mtp.fc.weight"][:, :E]

    def k_proj(t):
        t["mtp.layers.0.self_attn.k_proj.weight"] = t["mtp.layers.0.self_attn.k_proj.weight"][:7]

    def norm(t):
        del t["mtp.norm.weight"]

    cases = [
        (fc, r"tensor mtp.fc.weight has shape \(48, 48\), expected \(48, 96\)"),
        (k_proj, r"tensor mtp.layers.0.self_attn.k_proj.weight has shape \(7, 48\), expected \(20, 48\)"),
        (norm, "missing tensor mtp.norm.weight"),
    ]
    for edit, message in cases:
        with pytest.raises(SparrowError, match=message) as e:
            sparrow.load(edited(edit.__name__, edit))
        assert "\n" not in str(e.value)


def test_the_server_takes_speculative_mtp_per_request(predictable, mtp_models):
    """A request's `speculative: "mtp"` gives plain decoding's tokens through the engine (the
    prompt's hidden rows kept from its prefill, the drafter made after it); a server on a model
    without the layer answers 400 naming the field, and refuses to start with it as its default."""
    import httpx
    from inprocess_server import serving

    from sparrow.server.app import ServerState

    body = {"prompt": [int(t) for t in PROMPT[:30]], "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    state = ServerState()
    with serving(state, predictable["dense"], timeout=300) as base:
        kv, freed = state.engine.kv, []  # what each request's cache holds when the engine frees it
        free = kv.free
        kv.free = lambda req: (freed.append(req.seq.slot.cache.hidden), free(req))[1]
        plain = httpx.post(base + "/v1/completions", json=body, timeout=300)
        spec = httpx.post(base + "/v1/completions", json={**body, "speculative": "mtp"}, timeout=300)
        # one token: done at its prefill, before any drafter: its cache keeps no hidden rows either
        one = {**body, "max_tokens": 1, "speculative": "mtp"}
        assert httpx.post(base + "/v1/completions", json=one, timeout=300).status_code == 200
    assert freed == [None, None, None]  # (the prefix cache may keep these caches)
    assert plain.status_code == 200 and spec.status_code == 200, spec.text
    assert spec.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    details = spec.json()["usage"]["completion_tokens_details"]  # drafts kept and refused
    assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] > 0, details
    llm = sparrow.load(mtp_models["dense"][2], threads=2)  # no MTP layer
    with serving(ServerState(), llm, timeout=300) as base:
        r = httpx.post(base + "/v1/completions", json={**body, "speculative": "mtp"}, timeout=300)
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative", r.text
    with pytest.raises(SparrowError, match="has no MTP layer"):
        ServerState(speculative=SpeculativeParams(method="mtp")).attach(llm)


def test_mtp_drafter_restarts_where_hidden_rows_are_missing(predictable):
    """Positions whose hidden rows the target never computed (a prompt prefix from the prefix
    cache) are not in the head's cache: it starts at the first position it has rows for, and
    the tokens are plain decoding's."""
    llm = predictable["dense"]
    ids = [int(t) for t in PROMPT[:30]]
    sampling = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = _run(llm, ids, sampling)[0]
    set_threads(llm.threads)
    seq = Sequence.create(llm.runner, llm.tokenizer, ids, sampling, llm.ctx, "f32", None)
    spec = make_speculator(llm.handle, llm.runner, SpeculativeParams(method="mtp", tokens=3), seq, "f32")
    gen = generate_step(llm.runner, seq, spec=spec)
    toks = [next(gen).token_id]  # after the prefill, before the first draft
    for p in range(20):
        del seq.slot.cache.hidden[p]
    toks += [o.token_id for o in gen]
    assert toks == plain
    assert spec.drafter.base == 20 and spec.drafted > 0
    spec.release()
