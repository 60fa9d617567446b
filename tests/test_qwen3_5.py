"""Qwen3.5 (hybrid Gated DeltaNet + gated attention, dense and MoE) against transformers, and the
engine's features on its per-sequence recurrent state.

Tiny odd-shaped models are built and saved by transformers here (weights from a seeded numpy
generator; norms and the DeltaNet's A_log / dt_bias drawn too, so 1 + weight and the decay are
exercised): more value heads than key heads, key and value head dims that differ, partial
rotary, a layer pattern with full attention in the middle, and prompts over several of
transformers' 64-token delta-rule chunks. Each model is also saved in the layout of the real
checkpoints (Qwen3_5ForConditionalGeneration: the text decoder under model.language_model., a
vision tower and mtp.* tensors beside it); images: test_qwen3_5_vision.py.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from test_gemm import bits, fma32

import sparrow
from reference_models import save_default_tokenizer
from sparrow.engine.generate import generate_step
from sparrow.engine.sequence import Sequence
from sparrow.engine.speculative import make_speculator
from sparrow.errors import SparrowError
from sparrow.kernels.deltanet import _rule_run, gated_deltanet
from sparrow.models.decoder import Segment
from sparrow.params import SamplingParams, SparseParams, SpeculativeParams
from sparrow.request import GenerationRequest
from sparrow.state.recurrent import HybridCache

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 49152  # the default model's tokenizer
PROMPT = np.random.default_rng(5).integers(100, VOCAB, 150)  # three of transformers' delta-rule chunks

_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=20,
    linear_num_key_heads=2,
    linear_num_value_heads=6,  # 3 value heads per key head
    linear_key_head_dim=12,
    linear_value_head_dim=10,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.4,  # 8 of 20 dims rotate
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)
SPECS = {
    "dense": dict(
        _TEXT,
        num_hidden_layers=5,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
    ),
    "moe": dict(
        _TEXT,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_experts=6,
        num_experts_per_tok=2,
    ),
}


def _seed(model, seed: int) -> None:
    """Every parameter from numpy's generator in name order: matrices normal(0, 0.2), the
    (1 + w) norms normal(0, 0.3), the gated norm 1 + normal(0, 0.3), A_log log(uniform(0.3, 3)),
    dt_bias normal(0, 0.5)."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            shape = tuple(p.shape)
            if name.endswith("A_log"):
                values = np.log(rng.uniform(0.3, 3.0, shape))
            elif name.endswith("dt_bias"):
                values = rng.normal(0.0, 0.5, shape)
            elif name.endswith("linear_attn.norm.weight"):
                values = 1.0 + rng.normal(0.0, 0.3, shape)
            elif p.ndim == 1:
                values = rng.normal(0.0, 0.3, shape)
            else:
                values = rng.normal(0.0, 0.2, shape)
            p.copy_(torch.from_numpy(values.astype(np.float32)))


def _build(kind: str, folder: str, tok_dir: str):
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    cfg_cls, model_cls = {
        "dense": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
        "moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
    }[kind]
    model = model_cls(cfg_cls(**SPECS[kind])).float().eval()
    _seed(model, 7 if kind == "dense" else 8)
    model.save_pretrained(folder)
    for f in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, f), folder)
    return model


def _as_conditional_generation(src: str, dst: str, kind: str) -> None:
    """The same weights in the layout of a real checkpoint: Qwen3_5(Moe)ForConditionalGeneration's
    config (text_config, vision_config) and tensor names, a tiny vision tower (loaded, never fed
    here); mtp.* tensors, where src has them, keep their names (test_qwen3_5_mtp.py)."""
    from safetensors.numpy import load_file, save_file
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionConfig, Qwen3_5VisionModel

    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v for k, v in tensors.items()
    }
    vision = dict(depth=1, hidden_size=8, intermediate_size=16, num_heads=1, out_hidden_size=48)
    vision["num_position_embeddings"] = 4
    tower = Qwen3_5VisionModel(Qwen3_5VisionConfig(**vision))
    out.update({"model.visual." + k: v.detach().numpy() for k, v in tower.state_dict().items()})
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        text = json.load(f)
    arch = "Qwen3_5MoeForConditionalGeneration" if kind == "moe" else "Qwen3_5ForConditionalGeneration"
    text.pop("architectures")
    text["model_type"] = "qwen3_5_moe_text" if kind == "moe" else "qwen3_5_text"
    cfg = {
        "architectures": [arch],
        "model_type": "qwen3_5_moe" if kind == "moe" else "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": False,
    }
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    for f in os.listdir(src):
        if f not in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(src, f), dst)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (folder, transformers model, its logits over PROMPT [T, V])."""
    root = tmp_path_factory.mktemp("qwen3_5")
    tok = str(root / "tok")
    save_default_tokenizer(tok)
    out = {}
    for kind in SPECS:
        folder = str(root / kind)
        ref = _build(kind, folder, tok)
        with torch.no_grad():
            logits = ref(torch.tensor(PROMPT[None])).logits[0].numpy()
        out[kind] = (folder, ref, logits)
        cg = str(root / (kind + "_cg"))
        _as_conditional_generation(folder, cg, kind)
        out[kind + "_cg"] = (cg, ref, logits)
    return out


@pytest.fixture(scope="module")
def llms(models):
    return {k: sparrow.load(v[0], threads=2) for k, v in models.items()}


def _prefill_then_decode(model, ids, split):
    """Logits [T, V]: ids[:split] as one prefill (every position), the rest as decode steps."""
    cache = model.new_cache(len(ids) + 1)
    rows = [model.forward([Segment(ids[:split], cache, 0)], all_logits=True)]
    for t in range(split, len(ids)):
        rows.append(model.forward([Segment(ids[t : t + 1], cache, t, decode=True)]))
    return np.concatenate(rows), cache


@pytest.mark.parametrize("kind", ["dense", "moe", "dense_cg", "moe_cg"])
def test_logits_match_transformers(models, llms, kind):
    _, _, ref = models[kind]
    model = llms[kind].model
    assert llms[kind].config.architecture == ("qwen3_5_moe" if kind.startswith("moe") else "qwen3_5")
    for split in (len(PROMPT), 97):  # the whole prompt prefilled; 97 prefilled, 53 decode steps
        got, _ = _prefill_then_decode(model, PROMPT, split)
        # f32 noise of two orders of the delta rule (transformers' 64-token chunks, sparrow's
        # recurrence): 1e-5..4e-5 of the largest logit measured
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max(), (split, np.abs(got - ref).max())
        assert np.array_equal(got.argmax(1), ref.argmax(1))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_continuation_equals_transformers_generate(models, llms, kind):
    _, ref, _ = models[kind]
    ids = [int(t) for t in PROMPT[:70]]
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
    want = want[0, len(ids) :].tolist()
    got = [o.token_id for o in llms[kind].stream(ids, max_tokens=24, temperature=0.0, ignore_eos=True)]
    assert got == want


def test_a_deltanet_layer_gives_the_same_bits_however_tokens_are_split():
    """The documented order (kernels/deltanet.py): a token's output and the state after it do
    not depend on how the run was cut into calls (prefill chunks, decode steps, verification);
    and the layer's mixing is the formula, written out here in float64."""
    rng = np.random.default_rng(0)
    T, Hk, Hv, Dk, Dv, K = 37, 2, 6, 12, 10, 4
    C = 2 * Hk * Dk + Hv * Dv
    qkv = rng.normal(size=(T, C)).astype(np.float32)
    z = rng.normal(size=(T, Hv * Dv)).astype(np.float32)
    b, a = (rng.normal(size=(T, Hv)).astype(np.float32) for _ in range(2))
    w = rng.normal(0, 0.5, size=(C, K)).astype(np.float32)
    neg_A = -rng.uniform(0.3, 3.0, Hv).astype(np.float32)
    dt = rng.normal(0, 0.5, Hv).astype(np.float32)
    norm_w = rng.uniform(0.5, 1.5, Dv).astype(np.float32)
    heads = np.arange(Hv) // 3
    runs = []
    for cuts in ([0, T], [0, 1, 17, 18, T], list(range(T + 1))):
        conv, S = np.zeros((K - 1, C), np.float32), np.zeros((Hv, Dk, Dv), np.float32)
        ys = [
            gated_deltanet((qkv[i:j], z[i:j], b[i:j], a[i:j]), (w, neg_A, dt, norm_w, heads, Hk, Dk, 1e-6), conv, S)
            for i, j in zip(cuts, cuts[1:])
        ]
        runs.append((np.concatenate(ys), S, conv))
    for run in runs[1:]:
        for x, y in zip(run, runs[0]):
            assert x.tobytes() == y.tobytes()
    # float64 reference
    x = np.concatenate([np.zeros((K - 1, C)), qkv.astype(np.float64)])
    c = sum(x[j : j + T] * w[:, j] for j in range(K))
    c = c / (1 + np.exp(-c))
    S = np.zeros((Hv, Dk, Dv))
    want = np.zeros((T, Hv, Dv))
    for t in range(T):
        for h in range(Hv):
            kh = heads[h]
            q = c[t, kh * Dk : (kh + 1) * Dk]
            k = c[t, (Hk + kh) * Dk : (Hk + kh + 1) * Dk]
            v = c[t, 2 * Hk * Dk + h * Dv : 2 * Hk * Dk + (h + 1) * Dv]
            q = q / np.sqrt(q @ q + 1e-6) / np.sqrt(Dk)
            k = k / np.sqrt(k @ k + 1e-6)
            S[h] *= np.exp(neg_A[h] * np.log1p(np.exp(a[t, h] + dt[h])))
            S[h] += np.outer(k, (v - k @ S[h]) / (1 + np.exp(-b[t, h])))
            o = q @ S[h]
            zz = z[t, h * Dv : (h + 1) * Dv]
            want[t, h] = o / np.sqrt(np.mean(o * o) + 1e-6) * norm_w * zz / (1 + np.exp(-zz))
    assert np.allclose(runs[0][0].reshape(T, Hv, Dv), want, rtol=1e-4, atol=1e-5)


def rule_reference(S, Q, K, V, dec, beta):
    """The delta rule in the order kernels/deltanet.py documents, element by element in f32
    (every fma rounded once: test_gemm.fma32): o [T, Dv], and S advanced in place."""
    S64 = lambda a: a.astype(np.float64)  # noqa: E731
    O = np.zeros((len(Q), S.shape[1]), np.float32)
    for t in range(len(Q)):
        mem = np.zeros(S.shape[1], np.float32)
        for i in range(S.shape[0]):  # decay, k @ S (i ascending)
            S[i] = S[i] * dec[t]
            mem = fma32(S64(S[i]) * np.float64(K[t, i]), mem)
        delta = (V[t] - mem) * beta[t]
        for i in range(S.shape[0]):  # update, q @ S
            S[i] = fma32(np.float64(K[t, i]) * S64(delta), S[i])
            O[t] = fma32(S64(S[i]) * np.float64(Q[t, i]), O[t])
    return O


@pytest.mark.parametrize("dk, dv", [(24, 100), (20, 120), (16, 8), (128, 128)])
def test_the_delta_rule_follows_its_documented_order(dk, dv):
    """_rule_run (its column groups of RULE_COLS, 16 and fewer columns: dv = 120 takes all
    three on AVX-512 and AVX2, as a prefill run and as decode steps) against the documented
    order written out in numpy, bit for bit."""
    rng = np.random.default_rng(dk + dv)
    T = 6
    Q, K = (rng.normal(0, 0.3, (T, dk)).astype(np.float32) for _ in range(2))
    V = rng.normal(size=(T, dv)).astype(np.float32)
    dec, beta = rng.uniform(0.7, 1.0, T).astype(np.float32), rng.uniform(0, 1, T).astype(np.float32)
    S0 = rng.normal(size=(dk, dv)).astype(np.float32)
    want_S = S0.copy()
    want = rule_reference(want_S, Q, K, V, dec, beta)
    for cuts in ([0, T], list(range(T + 1))):
        S, out = S0.copy(), np.full((T, dv), np.nan, np.float32)
        for i, j in zip(cuts, cuts[1:]):
            scratch = [np.empty(dv, np.float32) for _ in range(2)]
            _rule_run(S, Q[i:j], K[i:j], V[i:j], dec[i:j], beta[i:j], out[i:j], *scratch)
        assert np.array_equal(bits(out), bits(want)) and np.array_equal(bits(S), bits(want_S)), cuts


def test_hybrid_cache_rolls_back_only_to_positions_it_kept():
    c = HybridCache(1, 1, 4, 64, "f32", conv_shape=(2, 3, 8), ssm_shape=(2, 1, 2, 2))
    c.length = 16
    c.ssm[:] = 1.0
    c.checkpoint(16)
    c.ssm[:] = 2.0
    c.length = 20
    with pytest.raises(SparrowError, match="no copy at position 18"):
        c.truncate(18)
    c.truncate(16)
    assert c.length == 16 and (c.ssm == 1.0).all()
    c.truncate(0)
    assert c.length == 0 and not c.ssm.any()


def _run(llm, ids, sampling, sparse=None, spec=None, with_speculator=False):
    """(tokens, every sampled position's logits, the sequence cache[, the speculator, released])."""
    from sparrow.api import set_threads

    set_threads(llm.threads)
    seq = Sequence.create(llm.runner, llm.tokenizer, ids, sampling, llm.ctx, "f32", sparse)
    seen = []
    accept = seq.accept
    seq.accept = lambda logits: (seen.append(np.array(logits)), accept(logits))[1]
    speculator = make_speculator(llm.handle, llm.runner, spec, seq, "f32") if spec is not None else None
    toks = [o.token_id for o in generate_step(llm.runner, seq, spec=speculator)]
    if speculator is not None:
        speculator.release()
    out = toks, np.stack(seen), seq.slot.cache
    return (*out, speculator) if with_speculator else out


REPEATING = [int(t) for t in np.tile(PROMPT[:12], 6)]  # an ngram drafter finds drafts here


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize(
    "spec",
    [
        SpeculativeParams(method="ngram", tokens=4),
        SpeculativeParams(method="sparse", tokens=3, sparse=SparseParams(k=1, block=16)),
    ],
    ids=["ngram", "sparse"],
)
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_speculative_decoding_equals_plain(llms, kind, spec, sampling):
    llm = llms[kind]
    plain = _run(llm, REPEATING, sampling)
    got = _run(llm, REPEATING, sampling, spec=spec)
    assert_same_run(got, plain)


def assert_same_run(got, plain) -> None:
    """Two _run results: the same tokens, logits bytes, recurrent state and K rows."""
    assert got[0] == plain[0]
    assert got[1].tobytes() == plain[1].tobytes()
    a, b = got[2], plain[2]
    assert a.length == b.length
    assert a.ssm.tobytes() == b.ssm.tobytes() and a.conv.tobytes() == b.conv.tobytes()
    for la, lb in zip(a.layers, b.layers):
        assert la.k[:, : a.length].tobytes() == lb.k[:, : b.length].tobytes()


@pytest.mark.parametrize("select", ["seed", "v2"])
def test_sparse_attention_with_every_block_equals_exact(llms, select):
    llm = llms["dense"]
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids = [int(t) for t in PROMPT[:100]]
    exact = _run(llm, ids, sampling)
    every = _run(llm, ids, sampling, sparse=SparseParams(k=16, block=16, select=select))
    assert every[0] == exact[0]
    assert np.abs(every[1] - exact[1]).max() <= 1e-5


def test_sparse_attention_selects_within_the_full_attention_layers(llms):
    llm = llms["dense"]
    trace: list = []
    ids = [int(t) for t in PROMPT[:100]]
    out = list(
        llm.stream(ids, max_tokens=3, temperature=0.0, sparse_attn=True, sparse_k=2, sparse_block=16, trace=trace)
    )
    assert len(out) == 3 and trace
    layers = {layer for step in trace for layer, _ in step}
    assert layers == {0, 1}  # the model's two full-attention layers, by KV index


def test_the_servers_sparse_trace_names_the_full_attention_layers(llms):
    """sparse_trace on a hybrid model: the header lists the full-attention layers by their index in
    the model, and every step's data decodes to one row a head of each of them."""
    import threading

    from sparrow.engine.engine import Engine
    from sparrow.server.sparse_trace import Tracer, decode

    llm = llms["dense"]
    ids = [int(t) for t in PROMPT[:100]]
    sp = SparseParams(k=2, block=16)
    tracer = Tracer(llm, sp, ids)
    assert tracer.header["layers"] == llm.config.full_attention_layers and "kv_layers" not in tracer.header
    outs, done = [], threading.Event()

    def emit(kind, out):
        assert kind == "token", out
        outs.append(out)
        if out.finish_reason:
            done.set()

    engine = Engine(llm.handle)
    engine.start(warmup=False)
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        engine.submit(GenerationRequest(ids, params, sp, trace=True), emit)
        assert done.wait(120)
    finally:
        engine.stop()
    steps = [tracer.step(out) for out in outs]
    assert "data" not in steps[0] and all("data" in s for s in steps[1:])
    for s in steps[1:]:
        codes = decode(s, len(tracer.header["layers"]), tracer.header["heads"])  # [layers, heads, blocks]
        assert ((codes >= 0).sum(axis=2) == 2).all()  # k = 2 blocks a head in every full-attention layer


def test_a_second_request_reuses_the_prefix_cache_with_the_same_bits(llms):
    from test_prefix_cache import _submit_one

    from sparrow.engine.engine import Engine

    llm = llms["moe"]
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=1, ignore_eos=True, logprobs=0)
    first = [int(t) for t in PROMPT[:140]]
    engine = Engine(llm.handle, kv_budget=1 << 28)
    engine.runner.prefill_chunk = 32
    engine.start(warmup=False)
    try:
        (out1,), cached1 = _submit_one(engine, first, params, None)
        (out2,), cached2 = _submit_one(engine, first, params, None)
        second = first + out1 + [int(t) for t in PROMPT[:20]]  # the next turn
        (out3,), cached3 = _submit_one(engine, second, params, None)
    finally:
        engine.stop()
    assert cached1 == 0 and cached2 == 128 and cached3 >= 128
    assert out2 == out1
    alone = _run(llm, second, params)[0]
    assert out3 == alone


# Block formats take rows of whole 32-value blocks: the odd shapes above have none
BLOCK_SHAPED = dict(
    SPECS["dense"],
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=2,
    head_dim=32,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)


def save_block_shaped(root) -> tuple[str, object]:
    """The BLOCK_SHAPED model (seed 9) saved with the default tokenizer under root / "m":
    (folder, the transformers model)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    save_default_tokenizer(str(root / "tok"))
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**BLOCK_SHAPED)).float().eval()
    _seed(model, 9)
    model.save_pretrained(str(root / "m"))
    for f in os.listdir(root / "tok"):
        shutil.copy(root / "tok" / f, root / "m")
    return str(root / "m"), model


@pytest.fixture(scope="module")
def block_shaped(tmp_path_factory):
    return save_block_shaped(tmp_path_factory.mktemp("qwen3_5_blocks"))


def _quantized_by_sparrow(name, p) -> bool:
    # --quantize converts every projection and the untied head; the embedding is looked up,
    # the routers, the shared expert's gate, norms, conv and decay parameters stay f32
    return p.ndim == 2 and "embed_tokens" not in name and not name.endswith(("mlp.gate.weight", "expert_gate.weight"))


def test_quantize_q8_0_matches_transformers_on_the_rounded_weights(block_shaped):
    from reference_models import rounded_copy

    folder, model = block_shaped
    with torch.no_grad():
        ref = rounded_copy(model, "q8_0", _quantized_by_sparrow)(torch.tensor(PROMPT[None])).logits[0].numpy()
    llm = sparrow.load(folder, quantize="q8_0", threads=2, activations="f32")
    assert llm.model.layers[0].deltanet.out.qtype == "q8_0"
    got, _ = _prefill_then_decode(llm.model, PROMPT, 120)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_q8_activations_follow_the_exact_mode(block_shaped):
    """The faster mode (8-bit activations, as llama.cpp) is not exact: its logits stay near the
    exact mode's on the same weights, the same top-1 on most positions."""
    folder, _ = block_shaped
    exact, _ = _prefill_then_decode(sparrow.load(folder, quantize="q8_0", activations="f32").model, PROMPT, 120)
    fast, _ = _prefill_then_decode(sparrow.load(folder, quantize="q8_0", activations="q8").model, PROMPT, 120)
    assert np.median(np.abs(fast - exact)) <= 0.1 * np.median(np.abs(exact))  # 0.03-0.07 measured
    assert (fast.argmax(1) == exact.argmax(1)).mean() >= 0.8


def _edited(models, tmp_path, edit_config=None, edit_tensors=None):
    from safetensors.numpy import load_file, save_file

    src = models["dense"][0]
    dst = str(tmp_path / "edited")
    shutil.copytree(src, dst)
    if edit_config:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        edit_config(cfg)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    if edit_tensors:
        t = load_file(os.path.join(dst, "model.safetensors"))
        edit_tensors(t)
        save_file(t, os.path.join(dst, "model.safetensors"))
    return dst


def test_bad_files_get_one_line_errors_naming_the_key_or_tensor(models, tmp_path):
    def unknown_type(cfg):
        cfg["layer_types"][2] = "sliding_attention"

    def missing(t):
        del t["model.layers.2.linear_attn.dt_bias"]

    def misshaped(t):
        t["model.layers.1.self_attn.q_proj.weight"] = t["model.layers.1.self_attn.q_proj.weight"][:30]

    cases = [
        (dict(edit_config=unknown_type), "unknown layer_types entry 'sliding_attention'"),
        (dict(edit_tensors=missing), "missing tensor model.layers.2.linear_attn.dt_bias"),
        (
            dict(edit_tensors=misshaped),
            r"model.layers.1.self_attn.q_proj.weight has shape \(30, 48\), expected \(120, 48\)",
        ),
    ]
    for i, (edit, message) in enumerate(cases):
        folder = _edited(models, tmp_path / str(i), **edit)
        with pytest.raises(SparrowError, match=message) as e:
            sparrow.load(folder)
        assert "\n" not in str(e.value)


def test_after_a_restart_the_disk_prompt_cache_gives_the_fresh_bits(llms, tmp_path):
    """The recurrent state at each kept boundary goes into the file beside the K/V."""
    from test_prefix_cache import _submit_one

    from sparrow.engine.engine import Engine
    from sparrow.engine.runner import Runner
    from sparrow.state import disk as dc

    llm = llms["dense"]
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=2, ignore_eos=True, logprobs=0)
    first = [int(t) for t in PROMPT[:140]]
    second = first[:100] + [int(t) for t in PROMPT[:17]]

    def run(ids, disk):
        engine = Engine(llm.handle, runner=Runner(llm.model, 32), kv_budget=1 << 28, disk_cache=disk)
        engine.start(warmup=False)
        try:
            (out,), cached = _submit_one(engine, ids, params, None)
        finally:
            engine.stop()
        if disk is not None:
            disk.flush()
        return out, cached

    def disk():  # a new process's view of the folder
        return dc.DiskCache(str(tmp_path), 1 << 30, dc.identity_for(llm.checkpoint, llm.model, 32), llm.model.new_cache)

    run(first, disk())
    (name,) = os.listdir(tmp_path)
    meta = dc.read_header(str(tmp_path / name), {}).header["__metadata__"]
    assert meta["ssm_shape"] == "3,6,12,10" and meta["conv_shape"] == "3,3,108"
    d = disk()
    out, cached = run(second, d)
    assert cached == 96 and d.stats["hits"] == 1
    assert out == run(second, None)[0]


def test_save_prefix_and_load_prefix_carry_the_recurrent_state(models, tmp_path):
    folder = models["dense"][0]
    ids = [int(t) for t in PROMPT[:140]]
    params = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    writer, reader = sparrow.load(folder, threads=2), sparrow.load(folder, threads=2)
    writer.runner.prefill_chunk = reader.runner.prefill_chunk = 32  # the tiny prompt's whole chunks
    n = writer.save_prefix(ids[:130], str(tmp_path / "p.safetensors"))
    assert n == 128
    assert reader.load_prefix(str(tmp_path / "p.safetensors")) == n
    got = list(reader.stream(ids, **params))
    assert got[0].cached_tokens == n
    fresh = sparrow.load(folder, threads=2)
    assert [o.token_id for o in got] == [o.token_id for o in fresh.stream(ids, **params)]


def test_timing_reports_every_stage_and_changes_nothing(llms):
    """The staged forward's stages report to the model's timer (models.timing): the gated
    attention's projections, its attention, the Gated DeltaNet's mixing (as attention), the
    MLP and the head; the bits are those of an untimed forward."""
    from sparrow.models.timing import timed

    llm = llms["dense"]
    ids = [int(t) for t in PROMPT[:20]]
    plain = llm.logits(ids)
    with timed(llm.model) as timer:
        got = llm.logits(ids)
    assert got.tobytes() == plain.tobytes() and llm.model.timer is None
    assert timer.attn > 0 and timer.matmul > 0 and timer.mlp > 0 and timer.total >= timer.matmul + timer.attn
    assert timer.paths == {"staged": 1}
