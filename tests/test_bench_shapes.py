"""Shape benchmarks: random-weight GGUFs with real Qwen3 tensor shapes (sparrow_lab.bench.shapes) and
the bench speed header. Real shapes are checked from their planned tensor tables (nothing big is
written); a tiny shape is written, loaded and run. llama.cpp is not needed (CI has none)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from sparrow.errors import SparrowError
from sparrow.loaders.gguf_file import GGUFFile
from sparrow_lab.bench import bandwidth, shapes, speed

TINY = dict(
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=16,
    ffn=128,
    vocab=512,
    tied=True,
    rope_theta=1e6,
    rms_eps=1e-6,
    context=256,
)

# Qwen/Qwen3-*/config.json: hidden, layers, heads, kv heads, intermediate, tied; unique parameters
# (tied embedding once) and the model cards' "non-embedding" counts.
REAL = {
    "qwen3-0.6b": (1024, 28, 16, 8, 3072, True, 596_049_920, 0.44e9),
    "qwen3-1.7b": (2048, 28, 16, 8, 6144, True, 1_720_574_976, 1.4e9),
    "qwen3-4b": (2560, 36, 32, 8, 9728, True, 4_022_468_096, 3.6e9),
    "qwen3-8b": (4096, 36, 32, 8, 12288, False, 8_190_735_360, 6.95e9),
}
BLOCK_NAMES = {
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_q_norm",
    "attn_k_norm",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_shape_tables(name):
    h, layers, heads, kv, ffn, tied, params, non_emb = REAL[name]
    s = shapes.SHAPES[name]
    assert (s["hidden"], s["layers"], s["heads"], s["kv_heads"], s["ffn"], s["tied"]) == (
        h,
        layers,
        heads,
        kv,
        ffn,
        tied,
    )
    assert (s["head_dim"], s["vocab"], s["rope_theta"], s["rms_eps"], s["context"]) == (128, 151936, 1e6, 1e-6, 40960)
    for qtype in ("q8_0", "q4_0"):  # every matrix in that type (q4_k_m: test_q4_k_m_mix)
        tensors = shapes.plan(name, qtype)
        by_name = {n: (ne, t) for n, ne, t in tensors}
        assert len(by_name) == len(tensors) == 2 + (not tied) + 11 * layers
        assert by_name["token_embd.weight"] == ((h, 151936), qtype)
        assert ("output.weight" in by_name) == (not tied)
        assert by_name["output_norm.weight"] == ((h,), "f32")
        for i in (0, layers - 1):
            b = f"blk.{i}."
            assert {n[len(b) : -len(".weight")] for n in by_name if n.startswith(b)} == BLOCK_NAMES
            assert by_name[b + "attn_q.weight"] == ((h, heads * 128), qtype)
            assert by_name[b + "attn_k.weight"] == ((h, kv * 128), qtype)
            assert by_name[b + "attn_v.weight"] == ((h, kv * 128), qtype)
            assert by_name[b + "attn_output.weight"] == ((heads * 128, h), qtype)
            assert by_name[b + "attn_q_norm.weight"] == ((128,), "f32")
            assert by_name[b + "ffn_gate.weight"] == ((h, ffn), qtype)
            assert by_name[b + "ffn_down.weight"] == ((ffn, h), qtype)
    assert shapes.param_count(name) == params
    emb = h * 151936 * (1 if tied else 2)
    assert abs((params - emb) - non_emb) / non_emb < 0.02
    # q8_0: 34 bytes per 32 weights; q4_0: 18 (norms are f32)
    assert abs(shapes.file_bytes(name, "q8_0") / (params * 34 / 32) - 1) < 0.001
    assert abs(shapes.file_bytes(name, "q4_0") / (params * 18 / 32) - 1) < 0.001


@pytest.mark.parametrize("name", sorted(REAL))
def test_q4_k_m_mix(name):
    # llama.cpp's Q4_K_M choices: q6_k for the output matrix (the tied embedding) and for attn_v
    # and ffn_down in use_more_bits layers (first and last eighth, every third in between)
    h, layers, heads, kv, ffn, tied, params, _ = REAL[name]
    by_name = {n: (ne, t) for n, ne, t in shapes.plan(name, "q4_k_m")}
    pure = {n: ne for n, ne, _ in shapes.plan(name, "q8_0")}
    assert {n: ne for n, (ne, _) in by_name.items()} == pure
    assert by_name["token_embd.weight"][1] == ("q6_k" if tied else "q4_k")
    assert tied or by_name["output.weight"][1] == "q6_k"
    more = [i for i in range(layers) if by_name[f"blk.{i}.ffn_down.weight"][1] == "q6_k"]
    assert more == [i for i in range(layers) if by_name[f"blk.{i}.attn_v.weight"][1] == "q6_k"]
    e = layers // 8
    assert more == sorted(set(range(e)) | set(range(7 * layers // 8, layers)) | set(range(e + 2, layers, 3)))
    assert {t for n, (ne, t) in by_name.items() if "attn_q." in n or "ffn_up" in n} == {"q4_k"}
    # 144 B per 256 (4.5 bits a weight) with some 6.5625-bit matrices: between the two
    assert params * 4.5 / 8 < shapes.file_bytes(name, "q4_k_m") < params * 6.5625 / 8


# Qwen/Qwen3-30B-A3B config.json: hidden 2048, 48 layers, 32 / 4 heads, head_dim 128, 128 experts,
# 8 routed, moe_intermediate_size 768, intermediate_size 6144, vocab 151936, untied; the model
# card's 30.5B parameters, 29.9B of them non-embedding.
A3B = "qwen3-30b-a3b"


def test_qwen3_30b_a3b_plan_and_metadata():
    s = shapes.SHAPES[A3B]
    assert (s["hidden"], s["layers"], s["heads"], s["kv_heads"], s["head_dim"], s["ffn"], s["tied"]) == (
        2048, 48, 32, 4, 128, 6144, False,
    )  # fmt: skip
    assert (s["experts"], s["experts_used"], s["expert_ffn"], s["vocab"], s["arch"]) == (
        128,
        8,
        768,
        151936,
        "qwen3moe",
    )
    params = shapes.param_count(A3B)
    assert params == 30_532_122_624
    assert abs((params - 2 * 2048 * 151936) / 29.9e9 - 1) < 0.01
    by_name = {n: (ne, t) for n, ne, t in shapes.plan(A3B, "q4_k_m")}
    assert len(by_name) == 3 + 48 * 12
    for i in range(48):
        b = f"blk.{i}."
        assert not any(n.startswith(b + "ffn_" + p + ".") for p in ("gate", "up", "down") for n in by_name)
        assert by_name[b + "ffn_gate_inp.weight"] == ((2048, 128), "f32")  # llama.cpp never quantises it
        assert by_name[b + "ffn_gate_exps.weight"] == ((2048, 768, 128), "q4_k")
        assert by_name[b + "ffn_up_exps.weight"] == ((2048, 768, 128), "q4_k")
        assert by_name[b + "attn_k.weight"] == ((2048, 512), "q4_k")
        assert by_name[b + "attn_output.weight"] == ((4096, 2048), "q4_k")
        # llama-quant's Q4_K_M: ffn_down (the stacked experts' too, layer from the name) and
        # attn_v get q6_k in use_more_bits layers
        more = i < 6 or i >= 42 or (i - 6) % 3 == 2
        down = by_name[b + "ffn_down_exps.weight"]
        assert down == ((768, 2048, 128), "q6_k" if more else "q4_k")
        assert by_name[b + "attn_v.weight"][1] == down[1]
    assert by_name["output.weight"] == ((2048, 151936), "q6_k")
    assert by_name["token_embd.weight"] == ((2048, 151936), "q4_k")
    assert 18.4e9 < shapes.file_bytes(A3B, "q4_k_m") < 18.7e9  # Qwen's own Q4_K_M file: 18.6 GB
    assert shapes.metadata(A3B) == {
        "qwen3moe.context_length": 40960,
        "qwen3moe.embedding_length": 2048,
        "qwen3moe.block_count": 48,
        "qwen3moe.feed_forward_length": 6144,
        "qwen3moe.attention.head_count": 32,
        "qwen3moe.attention.head_count_kv": 4,
        "qwen3moe.attention.key_length": 128,
        "qwen3moe.attention.value_length": 128,
        "qwen3moe.rope.freq_base": 1e6,
        "qwen3moe.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen3moe.expert_count": 128,
        "qwen3moe.expert_used_count": 8,
        "qwen3moe.expert_feed_forward_length": 768,
    }


def test_tiny_moe_shape_writes_loads_and_decodes(tmp_path):
    """The qwen3-30b-a3b layout with tiny layers: written, read back as llama.cpp names it,
    loaded as Qwen3-MoE and decoded end to end (decode steps against the prefill's logits)."""
    import sparrow
    from sparrow.models.decoder import Segment
    from sparrow.models.qwen3_moe import MoEBlock

    real = {k: v for k, v in shapes.SHAPES[A3B].items() if k != "bpe_tokens"}  # 151643: a real vocabulary
    tiny = dict(
        real, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=512, context=256,
        experts=8, experts_used=2, expert_ffn=256,
    )  # fmt: skip
    path = shapes.write_gguf(str(tmp_path / "tiny-moe.gguf"), tiny, "q4_k_m", name="tiny")
    f = GGUFFile(path)
    assert [(t.name, tuple(t.shape), t.tensor_type.name.lower()) for t in f.tensors] == shapes.plan(tiny, "q4_k_m")
    assert f.meta["general.architecture"] == "qwen3moe"
    for key, val in shapes.metadata(tiny).items():
        assert f.meta[key] == pytest.approx(val)
    router = np.asarray(next(t for t in f.tensors if t.name == "blk.0.ffn_gate_inp.weight").data)
    assert 0.015 < router.std() < 0.025  # random: a router of ones would tie every expert
    llm = sparrow.load(path, threads=1)
    cfg = llm.model.config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        "qwen3_moe", 8, 2, 256,
    )  # fmt: skip
    assert all(isinstance(lay.mlp, MoEBlock) for lay in llm.model.layers)
    ids = np.array([5, 17, 300, 42, 7, 99, 250, 3])
    full = llm.logits(ids)  # [T, V]
    assert np.isfinite(full).all() and 0.05 < full.std() < 1.0
    cache = llm.model.new_cache(len(ids))
    llm.model.forward([Segment(ids[:4], cache, 0)])
    steps = [llm.model.forward([Segment(ids[i : i + 1], cache, i, decode=True)])[0] for i in range(4, len(ids))]
    assert np.abs(np.stack(steps) - full[4:]).max() < 1e-4  # f32 rounding between the kernels
    seen = {e for lay in llm.model.layers for e in lay.mlp.route(np.random.default_rng(0).standard_normal(
        (16, 256)).astype(np.float32))[0].ravel().tolist()}  # fmt: skip
    assert len(seen) > 2  # tokens route to different experts


def test_metadata_keys():
    m = shapes.metadata("qwen3-1.7b")
    assert m == {
        "qwen3.context_length": 40960,
        "qwen3.embedding_length": 2048,
        "qwen3.block_count": 28,
        "qwen3.feed_forward_length": 6144,
        "qwen3.attention.head_count": 16,
        "qwen3.attention.head_count_kv": 8,
        "qwen3.attention.key_length": 128,
        "qwen3.attention.value_length": 128,
        "qwen3.rope.freq_base": 1e6,
        "qwen3.attention.layer_norm_rms_epsilon": 1e-6,
    }


def test_qwen3_vocabulary_layout():
    from sparrow.tokenizer import Tokenizer

    v = shapes.vocabulary("qwen3-1.7b")
    toks, types = v["tokens"], v["types"]
    assert len(toks) == len(set(toks)) == len(types) == 151936
    assert len(v["merges"]) == 151643 - 256
    present = set(toks[:151643])
    assert all(a + b in present for a, b in (m.split(" ") for m in v["merges"][::997]))
    assert toks[151643] == "<|endoftext|>" and toks[151645] == "<|im_end|>" and toks[151668] == "</think>"
    assert (v["bos"], v["eos"], v["pad"]) == (151643, 151645, 151643)
    assert types[151643] == 3 and types[151657] == 4 and types[151667] == 4  # <tool_call>, <think>: user-defined
    assert set(types[:151643]) == {1} and set(types[151669:]) == {5} and toks[151669] == "[PAD151669]"
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": toks,
        "tokenizer.ggml.token_type": np.array(types, np.int32),
        "tokenizer.ggml.merges": v["merges"],
        "tokenizer.ggml.bos_token_id": v["bos"],
        "tokenizer.ggml.eos_token_id": v["eos"],
    }
    tok = Tokenizer.from_gguf(SimpleNamespace(meta=meta))
    ids = tok.encode("Hello, world!\n<|im_end|>")
    assert ids[-1] == 151645 and max(ids[:-1]) < 151643
    assert tok.decode(ids) == "Hello, world!\n<|im_end|>"
    assert set(tok.eos_token_ids) == {151645, 151643}


@pytest.mark.parametrize("qtype", shapes.TYPES)
def test_tiny_shape_writes_loads_and_runs(tmp_path, qtype):
    import sparrow

    path = str(tmp_path / f"tiny-{qtype}.gguf")
    assert shapes.write_gguf(path, TINY, qtype, name="tiny") == path
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # no temporary file left
    f = GGUFFile(path)
    assert [(t.name, tuple(t.shape), t.tensor_type.name.lower()) for t in f.tensors] == shapes.plan(TINY, qtype)
    for key, val in shapes.metadata(TINY).items():
        assert f.meta[key] == pytest.approx(val)
    assert f.meta["general.architecture"] == "qwen3"
    assert f.meta["tokenizer.ggml.model"] == "gpt2" and f.meta["tokenizer.ggml.pre"] == "qwen2"
    assert len(f.meta["tokenizer.ggml.tokens"]) == 512
    assert f.meta["general.file_type"] == {"q8_0": 7, "q4_0": 2, "q4_k_m": 15}[qtype]
    from sparrow.quant import dequantize_blocks

    for t in f.tensors:
        if t.tensor_type.name != "F32":  # every matrix type the file holds (q4_k_m: q5_0, q8_0)
            vals = dequantize_blocks(np.asarray(t.data), t.tensor_type.name.lower())
            assert 0.015 < vals.std() < 0.025 and abs(vals.mean()) < 0.002, t.name

    llm = sparrow.load(path, threads=1)
    cfg = llm.model.config
    assert (cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.tie_word_embeddings) == (
        "qwen3",
        64,
        2,
        16,
        True,
    )
    logits = llm.logits([5, 17, 300, 42, 7, 99])
    assert logits.shape == (6, 512) and np.isfinite(logits).all()
    assert 0.05 < logits.std() < 1.0
    assert llm.tokenizer.eos_token_ids[0] == 512 - 26 + 2  # <|im_end|>


def test_tiny_q4_k_m_runs_k_quants(tmp_path):
    # widths that are multiples of 256, so the file holds q4_k and q6_k (TINY's fall back)
    import sparrow

    tiny_k = dict(TINY, hidden=256, head_dim=64, ffn=512, layers=8)
    path = shapes.write_gguf(str(tmp_path / "tiny-k.gguf"), tiny_k, "q4_k_m", name="tiny")
    f = GGUFFile(path)
    assert {t.tensor_type.name for t in f.tensors} == {"F32", "Q4_K", "Q6_K"}
    from sparrow.quant import dequantize_blocks

    for t in f.tensors:
        if t.tensor_type.name != "F32":
            vals = dequantize_blocks(np.asarray(t.data), t.tensor_type.name.lower())
            assert 0.015 < vals.std() < 0.025 and abs(vals.mean()) < 0.002, t.name
    llm = sparrow.load(path, threads=1)
    assert llm.model.layers[0].mlp.down.qtype == "q6_k" and llm.model.layers[1].mlp.down.qtype == "q4_k"
    logits = llm.logits([5, 17, 300, 42, 7, 99])
    assert logits.shape == (6, 512) and np.isfinite(logits).all()
    assert 0.05 < logits.std() < 1.0


def test_ensure_writes_once_into_xdg_cache(tmp_path, monkeypatch):
    monkeypatch.setitem(shapes.SHAPES, "tiny", TINY)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = shapes.ensure("tiny", "q4_0", log=lambda msg: None)
    assert path == str(tmp_path / "sparrow" / "shapes" / "tiny-q4_0.gguf") and os.path.exists(path)

    def fail(*a, **k):
        raise AssertionError("rewritten")

    monkeypatch.setattr(shapes, "write_gguf", fail)
    assert shapes.ensure("tiny", "q4_0") == path  # reused
    with pytest.raises(SparrowError, match="unknown shape"):
        shapes.ensure("qwen3-99b", "q8_0")
    with pytest.raises(SparrowError, match="q8_0, q4_0"):
        shapes.ensure("tiny", "q4_k")


def test_ensure_checks_free_space_and_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(shapes.shutil, "disk_usage", lambda p: SimpleNamespace(free=2 << 30))
    with pytest.raises(SparrowError, match="GiB free"):
        shapes.ensure("qwen3-8b", "q8_0")
    # a write that fails part-way leaves neither the file nor its temporary
    monkeypatch.setitem(shapes.SHAPES, "tiny", TINY)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(shapes, "_random_blocks", boom)
    with pytest.raises(OSError, match="disk full"):
        shapes.ensure("tiny", "q8_0", log=lambda msg: None)
    assert os.listdir(tmp_path / "sparrow" / "shapes") == []


def test_cpu_info_and_busy_threshold():
    from sparrow_lab.bench import host

    info = host.cpu_info()
    assert info["model"] and info["cpus"] == os.cpu_count()
    assert set(info["extensions"]) <= set(host._EXTENSIONS)
    busy = host.cpu_busy(0.2)
    assert busy is None or 0.0 <= busy <= 1.0
    assert host.busy_threshold(1) == 0.5 and host.busy_threshold(2) == 0.5 and host.busy_threshold(16) == 4.0


def test_bench_speed_on_tiny_shape(tmp_path, monkeypatch, capsys):
    """sparrow-only run (no --compare) through --shape, with the contention row and the header."""
    monkeypatch.setitem(shapes.SHAPES, "tiny", TINY)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(speed, "load_avg", lambda: 99.0)  # a busy machine at the start
    monkeypatch.setattr(speed, "cpu_busy", lambda interval=1.0: 0.9)
    out = tmp_path / "speed.json"
    rec = speed.main(
        [
            "--shape",
            "tiny",
            "--type",
            "q8_0",
            "--contexts",
            "40,80",
            "--rounds",
            "1",
            "--decode",
            "2",
            "--threads",
            "1",
            "--no-startup",
            "--contention",
            "--json",
            str(out),
        ]
    )
    assert rec["config"]["shape"] == "tiny" and rec["config"]["model"].endswith("tiny-q8_0.gguf")
    assert rec["busy_warning"] and "busy" in rec["busy_warning"]
    assert rec["contention"]["context"] == 40 and rec["contention"]["sparrow_tok_s"] > 0
    saved = json.loads(out.read_text())
    assert saved["contention"]["context"] == 40 and saved["cpu"]["model"] == rec["cpu"]["model"]
    md = capsys.readouterr().out
    assert "random weights, tiny shapes, q8_0" in md and "CPU: " in md and "vector extensions" in md
    assert "sparrow's code paths on this CPU" in md
    assert rec["default_activations"]["mode"] == "f32"  # q8_0 weights: exact (models/activations.py)
    assert "sparrow's default activations for this file on this CPU: f32 (mostly q8_0 weights" in md
    assert (
        "Load average (1 min): 99.0 at start" in md
        and "1/5/15 min at start" in md
        and "CPUs 90% busy in the second before the start" in md
        and "**Warning: the machine was busy" in md
    )
    assert "CONTENTION (one busy-looping process running" in md
    assert "| 80 | decode tok/s, sparse k=32, int8 KV |" in md


def test_bench_speed_q8_rows(tmp_path, monkeypatch, capsys):
    """--activations q8 adds a q8 prefill row (its own cache: the exact prefill and decode
    rows still see the exact one) and the q8 decode rows."""
    monkeypatch.setitem(shapes.SHAPES, "tiny", TINY)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = ["--shape", "tiny", "--type", "q4_0", "--contexts", "80", "--rounds", "1", "--decode", "2", "--threads", "1"]
    rec = speed.main(args + ["--no-startup", "--activations", "q8", "--json", str(tmp_path / "s.json")])
    row = rec["table"][80]
    assert row["prefill_q8_tok_s"] > 0 and row["decode_q8_f16_tok_s"] > 0 and row["prefill_tok_s"] > 0
    md = capsys.readouterr().out
    assert "| 80 | prefill tok/s, q8 activations |" in md
    assert "| 80 | decode tok/s, exact, f16 KV, q8 activations |" in md
    plain = speed.main(args + ["--no-startup", "--json", str(tmp_path / "p.json")])
    assert "prefill_q8_tok_s" not in plain["table"][80]


def test_bench_speed_stream_rows_and_roofline(tmp_path, monkeypatch, capsys):
    """The rows through LLM.stream: a fresh prompt prefills everything, the same prompt again
    takes its 512-token prefix from the prefix cache; every decode cell carries the bytes a
    token reads and the share of the measured bandwidth (here a fixed 10 GB/s)."""
    monkeypatch.setitem(shapes.SHAPES, "tiny", dict(TINY, context=1024))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(
        bandwidth, "read_bandwidth", lambda threads: {"gb_s": 10.0, "buffer_mib": 1, "threads": threads, "passes": 1}
    )
    args = ["--shape", "tiny", "--type", "q8_0", "--contexts", "600", "--rounds", "1", "--decode", "3"]
    rec = speed.main(args + ["--threads", "1", "--no-startup", "--json", str(tmp_path / "s.json")])
    run = rec["rounds"][0]["sparrow"][600]
    for name in ("exact", "sparse"):
        assert run[f"stream_{name}_fresh"]["cached_tokens"] == 0
        assert run[f"stream_{name}_cached"]["cached_tokens"] == 512
        assert run[f"stream_{name}_fresh"]["end_ms"] >= 0 and run[f"stream_{name}_fresh"]["loop_tok_s"] > 0
        counters = set(run[f"stream_{name}_fresh"]["during_decode"])
        assert counters == {"minor_faults", "involuntary_switches", "steal_ticks"}
    row = rec["table"][600]
    weights = bandwidth.weight_bytes(rec["config"]["model"])
    assert rec["weight_bytes"] == weights > 0
    cfg = rec["config"]
    kv = 2 * 2 * 2 * 16 * 4 * 600  # layers x (K, V) x kv heads x head_dim x f32 bytes x positions
    assert row["read_mb_exact"] == pytest.approx((weights + kv) / 1e6)
    assert row["bandwidth_exact"] == pytest.approx((weights + kv) * row["decode_exact_tok_s"] / 10e9)
    assert cfg["stream"] is True
    md = capsys.readouterr().out
    assert "Read bandwidth: 10.0 GB/s" in md
    assert "| 600 | decode tok/s through LLM.stream, exact, f32 KV: fresh prompt / same prompt again (512 tokens" in md
    assert "| 600 | the same, as a loop over the stream sees it (to the stream's end)" in md
    assert "| 600 | decode tok/s, exact, f32 KV | " in md and "of bandwidth) |" in md
    plain = speed.main(args + ["--threads", "1", "--no-startup", "--no-stream", "--json", str(tmp_path / "p.json")])
    assert "stream_exact_fresh" not in plain["rounds"][0]["sparrow"][600]


def test_weight_and_kv_bytes(tmp_path, monkeypatch):
    """What a decode token reads: the tensor table less the token embedding unless it is the
    output matrix too; expert tensors at experts used / experts; KV by dtype and sparsity."""
    import gguf
    from safetensors.numpy import save_file

    from sparrow.params import SparseParams

    monkeypatch.setitem(shapes.SHAPES, "tiny", TINY)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = shapes.ensure("tiny", "q8_0", log=lambda msg: None)
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    assert "output.weight" not in tensors  # tied: the embedding is the output matrix, read whole
    assert bandwidth.weight_bytes(path) == sum(tensors.values())

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_experts": 8, "num_experts_per_tok": 2}))
    f32 = np.zeros((4, 8), np.float32)  # 128 bytes each
    save_file(
        {
            "model.embed_tokens.weight": f32,
            "lm_head.weight": f32,
            "model.layers.0.mlp.experts.0.up_proj.weight": np.zeros((8, 8), np.float32),  # 256 bytes
        },
        str(folder / "model.safetensors"),
    )
    assert bandwidth.weight_bytes(str(folder)) == 128 + 256 * 2 // 8
    assert bandwidth.weight_bytes(str(tmp_path / "missing.gguf")) is None

    cfg = SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2, head_dim=16)
    assert bandwidth.kv_bytes_per_position(cfg, "f16") == 2 * 2 * 16 * 2
    assert bandwidth.kv_bytes_per_position(cfg, "int8") == 2 * 2 * (16 + 4)
    assert bandwidth.kv_read_bytes(cfg, 1000, "f32") == 4 * 1000 * 2 * 2 * 16 * 4
    hybrid = SimpleNamespace(**vars(cfg), layer_types=("linear_attention",) * 3 + ("full_attention",))
    assert bandwidth.kv_read_bytes(hybrid, 1000, "f32") == 1000 * 2 * 2 * 16 * 4  # KV in one layer of four
    sp = SparseParams(k=4, block=32, select="v2", dense_layers=1)
    per = 2 * 2 * 16 * 4
    assert bandwidth.kv_read_bytes(cfg, 1000, "f32", sp, 8.0) == 1000 * per + 3 * 128 * per + 8.0 * 1000
    assert bandwidth.fraction(1e9, 5.0, 10.0) == 0.5 and bandwidth.fraction(None, 5.0, 10.0) is None
    bw = bandwidth.read_bandwidth(1, passes=2, nbytes=1 << 20)
    assert bw["gb_s"] > 0 and bw["threads"] == 1


def test_moe_decode_bench_on_tiny_layers(tmp_path):
    from sparrow_lab.bench import moe_decode

    real = {k: v for k, v in shapes.SHAPES[A3B].items() if k != "bpe_tokens"}
    tiny = dict(real, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=512, experts=8, experts_used=2,
                expert_ffn=256)  # fmt: skip
    path = shapes.write_gguf(str(tmp_path / "tiny-moe.gguf"), tiny, "q4_k_m", name="tiny")
    rows = moe_decode.run(path, threads=1, rounds=1, steps=2, prefill=4)
    assert set(rows) == set(moe_decode.VARIANTS)
    for v in ("widen+dot", "staged"):  # the staged variants have stages, the MoE block's parts inside
        assert set(rows[v]) == {"step_ms", *moe_decode.STAGES, *moe_decode.MOE_PARTS.values()}
        assert rows[v]["mlp_block"] >= rows[v]["moe: experts"] > 0
    assert set(rows["fused"]) == {"step_ms"}  # one compiled call: nothing staged ran
    assert "| **step (median)** |" in moe_decode.table(rows)


def test_llama_no_repack_switches_only_inside(monkeypatch):
    # llama-cpp-python reads llama_model_default_params() in Llama(); _extra_bufts(False) makes
    # that say use_extra_bufts False while the model loads, and puts the function back after
    import sys

    from sparrow_lab.bench import engines

    lib = SimpleNamespace(llama_model_default_params=lambda: SimpleNamespace(use_extra_bufts=True))
    monkeypatch.setitem(sys.modules, "llama_cpp", SimpleNamespace(llama_cpp=lib))
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", lib)
    original = lib.llama_model_default_params
    with engines._extra_bufts(True):
        assert lib.llama_model_default_params().use_extra_bufts is True
    with engines._extra_bufts(False):
        assert lib.llama_model_default_params().use_extra_bufts is False
    assert lib.llama_model_default_params is original and original().use_extra_bufts is True


# ------------------------------------------------------------------------------------------- Qwen3.5

# (hidden, layers, heads, kv heads, FFN, linear key heads, linear value heads, tied): the sources
# in shapes.py's module doc
QWEN35 = {
    "qwen3.5-0.8b": (1024, 24, 8, 2, 3584, 16, 16, True),
    "qwen3.5-2b": (2048, 24, 8, 2, 6144, 16, 16, True),
    "qwen3.5-4b": (2560, 32, 16, 4, 9216, 16, 32, True),
    "qwen3.5-9b": (4096, 32, 16, 4, 12288, 16, 32, False),
    "qwen3.5-35b-a3b": (2048, 40, 16, 2, None, 16, 32, False),
}
_F32 = {"attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight"}
_F32 |= {"ssm_norm.weight", "ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ffn_gate_inp.weight"}
_F32 |= {"ffn_gate_inp_shexp.weight"}


def _more_bits(i, n):  # llama-quant.cpp's use_more_bits
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@pytest.mark.parametrize("name", sorted(QWEN35))
def test_qwen35_shape_tables(name):
    h, n, heads, kv, ffn, lk, lv, tied = QWEN35[name]
    s = shapes.SHAPES[name]
    got = (s["hidden"], s["layers"], s["heads"], s["kv_heads"], s["ffn"], s["linear_k_heads"])
    assert got == (h, n, heads, kv, ffn, lk)
    assert (s["linear_v_heads"], s["tied"], s["head_dim"], s["vocab"], s["rotary_dim"]) == (lv, tied, 256, 248320, 64)
    assert (s["linear_key_dim"], s["linear_value_dim"], s["conv_kernel"], s["rope_theta"]) == (128, 128, 4, 1e7)
    moe = name.endswith("a3b")
    kinds = shapes.layer_types(name)
    assert kinds == ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    for qtype in shapes.TYPES:
        tensors = shapes.plan(name, qtype)
        by_name = {t[0]: t[1:] for t in tensors}
        per_layer = {"linear_attention": 11, "full_attention": 8}
        assert len(by_name) == len(tensors) == 2 + (not tied) + sum(per_layer[k] + (8 if moe else 3) for k in kinds)
        for tname, (_, t) in by_name.items():  # llama.cpp keeps these f32 (converter and quantizer)
            assert (t == "f32") == (tname.split(".", 2)[-1] in _F32 or tname == "output_norm.weight"), tname
        assert by_name["token_embd.weight"][0] == (h, 248320)
        conv = 2 * lk * 128 + lv * 128
        assert by_name["blk.0.attn_qkv.weight"][0] == (h, conv)
        assert by_name["blk.0.ssm_conv1d.weight"] == ((4, conv), "f32")
        assert by_name["blk.0.attn_gate.weight"][0] == by_name["blk.0.ssm_out.weight"][0][::-1] == (h, lv * 128)
        assert by_name["blk.0.ssm_alpha.weight"][0] == by_name["blk.0.ssm_beta.weight"][0] == (h, lv)
        assert by_name["blk.0.ssm_a"][0] == by_name["blk.0.ssm_dt.bias"][0] == (lv,)
        assert by_name["blk.3.attn_q.weight"][0] == (h, 2 * heads * 256)  # query and output gate
        assert by_name["blk.3.attn_k.weight"][0] == by_name["blk.3.attn_v.weight"][0] == (h, kv * 256)
        assert by_name["blk.3.attn_output.weight"][0] == (heads * 256, h)
        assert "blk.3.attn_qkv.weight" not in by_name and "blk.0.attn_q.weight" not in by_name
        if moe:
            assert by_name["blk.0.ffn_down_exps.weight"][0] == (512, h, 256)
            assert by_name["blk.0.ffn_gate_shexp.weight"][0] == (h, 512)
            assert by_name["blk.0.ffn_gate_inp_shexp.weight"] == ((h, 1), "f32")
        else:
            assert by_name["blk.0.ffn_down.weight"][0] == (ffn, h)
    m = shapes.metadata(name)
    a = "qwen35moe" if moe else "qwen35"
    assert m[f"{a}.attention.recurrent_layers"] == [k == "linear_attention" for k in kinds]
    assert m[f"{a}.rope.dimension_sections"] == [11, 11, 10, 0] and m[f"{a}.rope.dimension_count"] == 64
    assert (m[f"{a}.ssm.group_count"], m[f"{a}.ssm.time_step_rank"], m[f"{a}.ssm.inner_size"]) == (lk, lv, lv * 128)
    assert (f"{a}.feed_forward_length" in m) == (not moe)


def test_qwen35_q4_k_m_mix():
    # llama-quant.cpp's Q4_K_M on a qwen35 file: attn_qkv and attn_v are one category (one a
    # layer, one counter), q6_k in use_more_bits layers as ffn_down (and, by the layer in the name,
    # the experts' and shared expert's down); ssm_alpha / ssm_beta / attn_gate / ssm_out q4_k
    for name in ("qwen3.5-0.8b", "qwen3.5-9b", "qwen3.5-35b-a3b"):
        n = shapes.SHAPES[name]["layers"]
        by_name = {t[0]: t[2] for t in shapes.plan(name, "q4_k_m")}
        for i in range(n):
            b, want = f"blk.{i}.", "q6_k" if _more_bits(i, n) else "q4_k"
            v = by_name.get(b + "attn_qkv.weight") or by_name[b + "attn_v.weight"]
            downs = [
                by_name[b + d]
                for d in ("ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")
                if b + d in by_name
            ]
            assert v == want and set(downs) == {want}, (name, i)
        special = ("down", "attn_qkv", "attn_v.", "token_embd", "output.")
        assert {t for k, t in by_name.items() if t != "f32" and not any(m in k for m in special)} == {"q4_k"}
        tied = shapes.SHAPES[name]["tied"]
        assert (
            by_name["token_embd.weight"] == ("q6_k" if tied else "q4_k")
            and by_name.get("output.weight", "q6_k") == "q6_k"
        )
    # published sizes: a Qwen3.5-4B Q8_0 file of 4,482,403,424 bytes (tensor data + ~11 MB of
    # vocabulary), Qwen3.5-9B Q4_K_M "5.23 GB" (GiB) / "5.6e9" as llama-quantize makes it
    assert 4.482e9 - 20e6 < shapes.file_bytes("qwen3.5-4b", "q8_0") < 4.482e9
    assert abs(shapes.file_bytes("qwen3.5-9b", "q4_k_m") / 2**30 - 5.23) < 0.01
    assert abs(shapes.param_count("qwen3.5-9b") / 1e9 - 8.95) < 0.01  # llama.cpp's "8.95B"


def _tiny35(moe: bool) -> dict:
    """Qwen3.5's layout at small widths (key dim = value dim, as llama.cpp's qwen35 needs); the
    default tokenizer's vocabulary so llama.cpp's converter can write the same config."""
    real = shapes.SHAPES["qwen3.5-35b-a3b" if moe else "qwen3.5-0.8b"]
    tiny = {k: v for k, v in real.items() if k != "bpe_tokens"}
    tiny.update(
        hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, rotary_dim=8, mrope_section=(2, 1, 1),
        vocab=49152, context=1024, linear_k_heads=2, linear_v_heads=4, linear_key_dim=32, linear_value_dim=32,
    )  # fmt: skip
    if moe:
        tiny.update(experts=8, experts_used=2, expert_ffn=32, shared_ffn=64)
    else:
        tiny.update(ffn=96)
    return tiny


@pytest.mark.parametrize("moe", [False, True], ids=["qwen35", "qwen35moe"])
def test_tiny_qwen35_writes_loads_and_decodes(tmp_path, moe):
    """The writer's qwen35 / qwen35moe file read back (names, shapes, types, keys), loaded by
    sparrow as Qwen3.5 and decoded: decode steps against the prefill's logits."""
    import sparrow
    from sparrow.models.decoder import Segment

    tiny = _tiny35(moe)
    path = shapes.write_gguf(str(tmp_path / "tiny35.gguf"), tiny, "q4_k_m", name="tiny")
    f = GGUFFile(path)
    assert [(t.name, tuple(t.shape), t.tensor_type.name.lower()) for t in f.tensors] == shapes.plan(tiny, "q4_k_m")
    assert f.meta["general.architecture"] == ("qwen35moe" if moe else "qwen35")
    assert f.meta["tokenizer.ggml.pre"] == "qwen35"
    for key, val in shapes.metadata(tiny).items():
        got = f.meta[key]
        assert (list(got) if isinstance(val, list) else got) == pytest.approx(val), key
    data = {t.name: np.asarray(t.data) for t in f.tensors if t.tensor_type.name == "F32"}
    assert (-8 <= data["blk.0.ssm_a"]).all() and (data["blk.0.ssm_a"] <= -0.5).all()
    assert abs(data["blk.0.ssm_dt.bias"].mean() + 3) < 1.0 and np.abs(data["blk.0.ssm_conv1d.weight"]).max() <= 0.5
    llm = sparrow.load(path, threads=1)
    cfg = llm.config
    assert cfg.architecture == ("qwen3_5_moe" if moe else "qwen3_5") and cfg.gguf_layout
    assert cfg.layer_types == tuple(shapes.layer_types(tiny)) and cfg.rotary_dim == 8
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim) == (2, 4, 32)
    if moe:
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
        assert cfg.shared_expert_intermediate_size == 64
    ids = np.array([5, 17, 300, 42, 7, 99, 250, 3])
    full = llm.logits(ids)
    assert full.shape == (8, 49152) and np.isfinite(full).all() and 0.05 < full.std() < 2.0
    cache = llm.model.new_cache(len(ids))
    llm.model.forward([Segment(ids[:4], cache, 0)])
    steps = [llm.model.forward([Segment(ids[i : i + 1], cache, i, decode=True)])[0] for i in range(4, len(ids))]
    assert np.abs(np.stack(steps) - full[4:]).max() < 1e-3 * np.abs(full).max()


_CONVERTER = os.environ.get("SPARROW_LLAMA_CONVERTER", os.path.expanduser("~/.cache/sparrow/llama-cpp-python-0.3.36"))


def _converted(folder: str, out: str, outtype: str) -> str:
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.path.join(_CONVERTER, "gguf-py"))
    cmd = [sys.executable, os.path.join(_CONVERTER, "convert_hf_to_gguf.py"), folder, "--outfile", out]
    r = subprocess.run(cmd + ["--outtype", outtype, "--no-mtp"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def _hf_folder(tiny: dict, folder: str, moe: bool) -> str:
    """The same config saved by transformers (random weights) with the default tokenizer."""
    import shutil

    transformers = pytest.importorskip("transformers")
    from reference_models import rewrite_config, save_default_tokenizer

    cfg = dict(
        vocab_size=tiny["vocab"], hidden_size=tiny["hidden"], num_hidden_layers=tiny["layers"],
        num_attention_heads=tiny["heads"], num_key_value_heads=tiny["kv_heads"], head_dim=tiny["head_dim"],
        linear_num_key_heads=tiny["linear_k_heads"], linear_num_value_heads=tiny["linear_v_heads"],
        linear_key_head_dim=tiny["linear_key_dim"], linear_value_head_dim=tiny["linear_value_dim"],
        linear_conv_kernel_dim=tiny["conv_kernel"], max_position_embeddings=tiny["context"],
        rms_norm_eps=tiny["rms_eps"], tie_word_embeddings=tiny["tied"], layer_types=shapes.layer_types(tiny),
        full_attention_interval=tiny["full_attention_interval"],
        rope_parameters={
            "rope_type": "default", "rope_theta": tiny["rope_theta"], "mrope_interleaved": True,
            "partial_rotary_factor": tiny["rotary_dim"] / tiny["head_dim"],
            "mrope_section": list(tiny["mrope_section"]),
        },
    )  # fmt: skip
    if moe:
        cfg.update(
            num_experts=tiny["experts"], num_experts_per_tok=tiny["experts_used"],
            moe_intermediate_size=tiny["expert_ffn"], shared_expert_intermediate_size=tiny["shared_ffn"],
        )  # fmt: skip
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**cfg))
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(intermediate_size=tiny["ffn"], **cfg))
    model.save_pretrained(folder)
    save_default_tokenizer(folder + "-tok")
    for name in os.listdir(folder + "-tok"):
        shutil.copy(os.path.join(folder + "-tok", name), folder)
    if moe:  # the converter keys its pre-tokenizer on model_type (see test_qwen3_5_gguf.py): dense's
        rewrite_config(folder, lambda cfg: cfg.update(model_type="qwen3_5_text"))
    return folder


@pytest.mark.skipif(
    not os.path.isfile(os.path.join(_CONVERTER, "convert_hf_to_gguf.py")),
    reason="llama.cpp's converter is not installed",
)
@pytest.mark.parametrize("moe", [False, True], ids=["qwen35", "qwen35moe"])
def test_tiny_qwen35_layout_equals_llama_cpp_converter(tmp_path, moe):
    """The writer's file against llama.cpp's converter on the same config at Q8_0: the same
    tensor names, shapes and f32-or-quantised split, and the same model keys and values."""
    import gguf

    tiny = _tiny35(moe)
    ref = gguf.GGUFReader(_converted(_hf_folder(tiny, str(tmp_path / "hf"), moe), str(tmp_path / "ref.gguf"), "q8_0"))
    ours = gguf.GGUFReader(shapes.write_gguf(str(tmp_path / "ours.gguf"), tiny, "q8_0", name="tiny"))

    def tensors(r):
        return sorted((t.name, tuple(int(d) for d in t.shape), t.tensor_type.name) for t in r.tensors)

    def keys(r):
        a = r.fields["general.architecture"].contents()
        return {k: f.contents() for k, f in r.fields.items() if k.startswith(a + ".")} | {"arch": a}

    assert tensors(ours) == tensors(ref)
    got, want = keys(ours), keys(ref)
    if moe:  # the folder's model_type says qwen3_5_text (for the tokenizer), so the converter's
        # AutoConfig fills the dense default intermediate_size (12288), which no tensor uses; a
        # qwen3_5_moe config has none (Qwen3_5MoeTextConfig: None), so no feed_forward_length
        assert want.pop("qwen35moe.feed_forward_length") == 12288
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k]), k
    assert ours.fields["general.file_type"].contents() == ref.fields["general.file_type"].contents() == 7


@pytest.mark.parametrize("moe", [False, True], ids=["qwen35", "qwen35moe"])
def test_tiny_qwen35_runs_in_llama_cpp(tmp_path, moe):
    """llama.cpp (llama-cpp-python) loads the writer's file and gives finite logits."""
    llama_cpp = pytest.importorskip("llama_cpp")
    tiny = dict(_tiny35(moe), vocab=512)
    path = shapes.write_gguf(str(tmp_path / "tiny35.gguf"), tiny, "q8_0", name="tiny")
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    llm.eval([5, 17, 300, 42, 7, 99])
    logits = np.asarray(llm.scores[:6])
    assert logits.shape == (6, 512) and np.isfinite(logits).all() and logits.std() > 0


def test_image_rows_only_for_shapes_with_a_vision_tower():
    """`bench speed --images` benches a shape's vision tower: refused (one line) for a shape
    without one; a qwen3vl text file always goes to the image rows, a Qwen3.5 shape only when
    asked; sides are parsed and bounded."""
    from sparrow_lab.bench import shapes_vl, speed_vl

    assert shapes.image_bench("qwen3-vl-2b", None) and shapes.image_bench("qwen3.5-0.8b", "448")
    assert not shapes.image_bench("qwen3.5-0.8b", None)
    with pytest.raises(SparrowError, match="qwen3-1.7b has no vision tower"):
        shapes.image_bench("qwen3-1.7b", "448")
    assert speed_vl._sides(SimpleNamespace(images="448,1024")) == (448, 1024)
    for bad in ("448,x", "16"):
        with pytest.raises(SparrowError, match="--images"):
            speed_vl._sides(SimpleNamespace(images=bad))
    # the Qwen3.5-0.8B tower: no DeepStack tensors, 12 blocks of width 768
    names = dict(shapes_vl.plan("qwen3.5-0.8b"))
    assert not any(n.startswith("v.deepstack") for n in names)
    assert names["v.blk.11.ffn_up.weight"] == (3072, 768) and "v.blk.12.ln1.weight" not in names
    assert names["mm.2.weight"] == (1024, 4 * 768)  # the merger projects to the text width
