"""Random-weight GGUF files with the exact tensor shapes of real Qwen3 and Qwen3.5 models, for speed benchmarks.

`sparrow bench speed --shape qwen3-1.7b --type q8_0` benches both engines on such a file. It is
written once into `$XDG_CACHE_HOME/sparrow/shapes/<shape>-<type>.gguf` (default `~/.cache/...`),
atomically (temporary file + rename), and reused. Nothing is read from outside the package: the
weights are random and the vocabulary is synthesised (prompts are token ids anyway).

Shapes (Hugging Face `Qwen/Qwen3-*` config.json; all: head_dim 128, vocab 151936, rope theta 1e6,
rms eps 1e-6, context 40960, no biases, q/k RMSNorm over head_dim):

| shape      | hidden | layers | heads | kv heads | FFN   | tied | params (unique) | non-embedding |
|------------|--------|--------|-------|----------|-------|------|-----------------|---------------|
| qwen3-0.6b | 1024   | 28     | 16    | 8        | 3072  | yes  | 0.596 B         | 0.440 B       |
| qwen3-1.7b | 2048   | 28     | 16    | 8        | 6144  | yes  | 1.721 B         | 1.409 B       |
| qwen3-4b   | 2560   | 36     | 32    | 8        | 9728  | yes  | 4.022 B         | 3.633 B       |
| qwen3-8b   | 4096   | 36     | 32    | 8        | 12288 | no   | 8.191 B         | 6.946 B       |
| qwen3-30b-a3b | 2048 | 48     | 32    | 4        | 128 x 768, 8 routed | no | 30.532 B | 29.910 B |

qwen3-30b-a3b is a `qwen3moe` file (Qwen/Qwen3-30B-A3B config.json; llama.cpp's names and keys):
every layer sparse, `ffn_gate_inp` (the router, [E, hidden], f32 as llama.cpp keeps it, random
so that tokens route to different experts) and the experts stacked as `ffn_{gate,up,down}_exps`
(ggml ne = (in, out, expert)); `qwen3moe.expert_count` 128, `expert_used_count` 8,
`expert_feed_forward_length` 768, `feed_forward_length` 6144 (config's intermediate_size, which
no tensor uses). Its Q4_K_M is ~18.6 GB (17.3 GiB).

Tensors use llama.cpp's qwen3 names (`token_embd`, `blk.N.attn_q` ... `ffn_down`, `output_norm`,
`output` when untied) and ggml order (ne0 = input width). With q8_0 / q4_0 every matrix, the token
embedding included, is stored in that type (like `llama-quantize --pure`). q4_k_m mixes types as
llama.cpp's Q4_K_M does: q6_k for the output matrix (the token embedding when tied) and for attn_v
and ffn_down in the layers llama.cpp gives more bits (the first and last eighth, and every third
in between), q4_k for the rest; a matrix whose input width is not a multiple of 256 falls back
as llama.cpp's does (q4_k -> q5_0, q6_k -> q8_0). In MoE files the stacked experts follow the
same rules (llama-quant reads the layer of `ffn_down_exps` from its name: q6_k in those layers),
and the router is never quantised. Norms are f32 ones.
Weights are random block bytes, scaled so the values have a standard deviation of about 0.02
(random scale x 0.75..1.25 per block) around 0: uniform quants (q8_0: -127..127, q4_0: 1..15,
i.e. -7..7 around the zero point; q5_0: 0..31 around 16, q6_k: 0..63 around 32, each block's
scale of random sign; q4_k: 0..15 with each sub-block's min at -7.5 steps). That is what
quantising a random matrix whose values lie on the quant grid would give; activations stay
finite and logits sane (standard deviation ~1).

Qwen3.5 shapes (`qwen35` / `qwen35moe` files, exactly as llama.cpp's converter (llama-cpp-python
0.3.36: Qwen3_5TextModel / Qwen3_5MoeTextModel, run with --no-mtp) and llama-quantize write them;
all: head_dim 256, 64 rotary dims (partial_rotary_factor 0.25), M-RoPE sections [11, 11, 10, 0],
rope theta 1e7, rms eps 1e-6, context 262144, vocab 248320, every fourth layer gated full
attention and the rest Gated DeltaNet with 128-wide key and value heads and a 4-tap conv):

| shape           | hidden | layers | heads / kv | FFN        | DeltaNet k / v heads | tied | params  | sources |
|-----------------|--------|--------|------------|------------|----------------------|------|---------|---------|
| qwen3.5-0.8b    | 1024   | 24     | 8 / 2      | 3584       | 16 / 16              | yes* | 0.752 B | a, b, c |
| qwen3.5-2b      | 2048   | 24     | 8 / 2      | 6144       | 16 / 16              | yes* | 1.882 B | b, d    |
| qwen3.5-4b      | 2560   | 32     | 16 / 4     | 9216       | 16 / 32              | yes  | 4.206 B | b, e, f |
| qwen3.5-9b      | 4096   | 32     | 16 / 4     | 12288      | 16 / 32              | no   | 8.954 B | g, h    |
| qwen3.5-35b-a3b | 2048   | 40     | 16 / 2     | see below  | 16 / 32              | no   | 34.661 B | a, i, j |

(qwen3.5-35b-a3b: 256 experts of FFN 512, 8 routed a token, plus a shared expert of FFN 512.)

a: /work/shared/FACTS.md (0.8B layers / hidden / heads; 35B-A3B layers / hidden / experts).
b: apxml.com/models/qwen35-{08b,2b,4b} (hidden, layers, heads, head dim 256, FFN, rope theta 1e7).
c: a Gated DeltaNet tutorial's code comment (16 heads, d_k = d_v = 128 for Qwen3.5-0.8B).
d: awesomeagents.ai/models/qwen-3-5-2b (the model card's layout: DeltaNet 16 V / 16 QK heads).
e: quant.cpp issue 94, a Qwen3.5-4B GGUF's tensor table (ssm v 32 / k 16 heads, attn_qkv 8192 rows).
f: a Qwen3.5-4B Q8_0 file of 4,482,403,424 bytes = this table tied (+ ~11 MB vocabulary).
g: the Qwen3.5-9B model card as quoted on 2048ai.net (32 layers, 4096, DeltaNet 32 V / 16 QK
   heads, attention 16 / 4, FFN 12288); transformers' Qwen3_5TextConfig defaults are the same.
h: a Qwen3.5-9B Q4_K_M of "8.95B" params and 5.23 GiB (lzwjava.github.io) = this table untied.
i: headlessmode.com on Qwen3.5-35B-A3B (256 experts, 8 routed + 1 shared, expert dim 512,
   attention 16 / 2, DeltaNet 32 V / 16 QK); transformers' Qwen3_5MoeTextConfig defaults agree.
j: the converter's comment: Qwen3.5's mrope_section is [11, 11, 10].
k: the vision_config of Qwen3.5-0.8B and -4B's config.json as quoted in public repositories'
   tests (0.8B: depth 12, width 768, 12 heads, FFN 3072; 4B: 24, 1024, 16, 4096; both patch 16,
   merge 2, 2304 position embeddings, gelu_pytorch_tanh, no DeepStack layers).
*: no config.json was found for 0.8B / 2B; tied is inferred (the family's small models are, and
   the names fit 0.75 B / 1.88 B, not 1.01 B / 2.39 B untied).
Tensors: `attn_norm`, `post_attention_norm` and an FFN (`ffn_{gate,up,down}`; MoE: the router
`ffn_gate_inp`, `ffn_{gate,up,down}_exps`, `ffn_{gate,up,down}_shexp`, `ffn_gate_inp_shexp`) in
every layer; DeltaNet layers `attn_qkv` (q, k, v rows), `attn_gate` (z), `ssm_alpha`, `ssm_beta`,
`ssm_a` (-exp(A_log)), `ssm_dt.bias`, `ssm_conv1d.weight` [kernel, q+k+v channels], `ssm_norm`,
`ssm_out`; attention layers `attn_q` (query and output gate: 2 x heads x 256 rows), `attn_k`,
`attn_v`, `attn_q_norm`, `attn_k_norm`, `attn_output`. In llama-quantize's order (tensors outside
blocks by name, then block by block by name). f32 as llama.cpp keeps them: norms, `ssm_a`,
`ssm_dt.bias`, `ssm_conv1d`, the routers (`ffn_gate_inp`, `ffn_gate_inp_shexp`, one row).
q8_0 / q4_0: every other matrix in that type; q4_k_m as llama-quant.cpp's Q4_K_M does it: q6_k for
the output matrix (the embedding when tied), and in use_more_bits layers for `attn_qkv` / `attn_v`
(one "attn_v" counter over both) and `ffn_down` (experts' and shared expert's too); q4_k for the
rest, `attn_gate`, `ssm_alpha`, `ssm_beta`, `ssm_out` included. Sizes (tensor data):

| shape           | q8_0     | q4_0     | q4_k_m   |
|-----------------|----------|----------|----------|
| qwen3.5-0.8b    | 0.80 GB  | 0.43 GB  | 0.52 GB  |
| qwen3.5-2b      | 2.00 GB  | 1.06 GB  | 1.26 GB  |
| qwen3.5-4b      | 4.47 GB  | 2.37 GB  | 2.70 GB  |
| qwen3.5-9b      | 9.52 GB  | 5.04 GB  | 5.62 GB  |
| qwen3.5-35b-a3b | 36.89 GB | 19.57 GB | 21.16 GB |

No MTP layer (`--no-mtp`), so no `nextn_predict_layers` key: decode never reads it. The
35B-A3B writes no `feed_forward_length` (its config has no intermediate_size). Random f32 values:
see _f32_values (a decay that stays between ~0.6 and ~0.98 a token). Vocabulary as below with
Qwen3.5's sizes: 248,044 BPE tokens, Qwen3's 26 added tokens at 248044.. (`<|endoftext|>`,
`<|im_start|>`, `<|im_end|>` = 248046, as the configs' ids say), `[PAD...]` to 248320, pre
`qwen35` (Qwen3.5's later added tokens, past `</think>`, are left as padding).

Vocabulary (`tokenizer.ggml.model` gpt2, pre qwen2): Qwen3's layout with synthesised BPE tokens:
ids 0..255 the 256 byte-alphabet characters, then every 2-character then 3-character combination
(each with its merge) up to id 151642, the 26 real Qwen3 added tokens at 151643..151668
(`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, ... `</think>`; `<|...|>` ones are control tokens,
the rest user-defined, as llama.cpp's converter types them) and `[PAD151669]`.. unused slots up
to 151935. bos = padding = 151643, eos = 151645 `<|im_end|>`, no BOS added; a ChatML template.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from contextlib import contextmanager

import numpy as np

from sparrow.errors import SparrowError

_QWEN3 = dict(head_dim=128, vocab=151936, bpe_tokens=151643, rope_theta=1e6, rms_eps=1e-6, context=40960)
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(_QWEN3, hidden=1024, layers=28, heads=16, kv_heads=8, ffn=3072, tied=True),
    "qwen3-1.7b": dict(_QWEN3, hidden=2048, layers=28, heads=16, kv_heads=8, ffn=6144, tied=True),
    "qwen3-4b": dict(_QWEN3, hidden=2560, layers=36, heads=32, kv_heads=8, ffn=9728, tied=True),
    "qwen3-8b": dict(_QWEN3, hidden=4096, layers=36, heads=32, kv_heads=8, ffn=12288, tied=False),
    # Qwen3-30B-A3B (a qwen3moe GGUF): every layer sparse, 128 experts of FFN 768, 8 routed a
    # token; ffn is config.json's intermediate_size (6144), which no tensor uses.
    "qwen3-30b-a3b": dict(
        _QWEN3,
        hidden=2048,
        layers=48,
        heads=32,
        kv_heads=4,
        ffn=6144,
        tied=False,
        arch="qwen3moe",
        experts=128,
        experts_used=8,
        expert_ffn=768,
    ),
    # Qwen3-VL-2B-Instruct's text model (a qwen3vl GGUF: rope theta 5e6, M-RoPE sections); its
    # vision tower goes in a separate random mmproj (bench/shapes_vl.py).
    "qwen3-vl-2b": dict(
        _QWEN3,
        hidden=2048,
        layers=28,
        heads=16,
        kv_heads=8,
        ffn=6144,
        tied=True,
        rope_theta=5e6,
        context=262144,
        arch="qwen3vl",
        mrope_section=(24, 20, 20),
        vision=dict(
            depth=24, hidden=1024, ffn=4096, heads=16, patch=16, merge=2, positions=2304, deepstack=(5, 11, 17)
        ),
    ),
}
# Qwen3.5 (qwen35 / qwen35moe GGUFs, llama.cpp's converter layout without the MTP layer): every
# fourth layer gated full attention, the rest Gated DeltaNet; sources in the module doc.
_QWEN35 = dict(
    head_dim=256,
    vocab=248320,
    bpe_tokens=248044,
    rope_theta=1e7,
    rms_eps=1e-6,
    context=262144,
    arch="qwen35",
    rotary_dim=64,  # partial_rotary_factor 0.25 of head_dim 256
    mrope_section=(11, 11, 10),
    full_attention_interval=4,
    conv_kernel=4,
    linear_key_dim=128,
    linear_value_dim=128,
)
# Their vision towers (every Qwen3.5 checkpoint has one: Qwen3-VL's without DeepStack; source k),
# benched with `--images` (bench/speed_vl.py) and written as a separate random mmproj.
_QWEN35_VISION_08B = dict(depth=12, hidden=768, ffn=3072, heads=12, patch=16, merge=2, positions=2304, deepstack=())
_QWEN35_VISION_4B = dict(depth=24, hidden=1024, ffn=4096, heads=16, patch=16, merge=2, positions=2304, deepstack=())
SHAPES.update(
    {
        "qwen3.5-0.8b": dict(
            _QWEN35, hidden=1024, layers=24, heads=8, kv_heads=2, ffn=3584, linear_k_heads=16, linear_v_heads=16,
            tied=True, vision=_QWEN35_VISION_08B,
        ),
        "qwen3.5-2b": dict(
            _QWEN35, hidden=2048, layers=24, heads=8, kv_heads=2, ffn=6144, linear_k_heads=16, linear_v_heads=16,
            tied=True,
        ),
        "qwen3.5-4b": dict(
            _QWEN35, hidden=2560, layers=32, heads=16, kv_heads=4, ffn=9216, linear_k_heads=16, linear_v_heads=32,
            tied=True, vision=_QWEN35_VISION_4B,
        ),
        "qwen3.5-9b": dict(
            _QWEN35, hidden=4096, layers=32, heads=16, kv_heads=4, ffn=12288, linear_k_heads=16, linear_v_heads=32,
            tied=False,
        ),
        # no intermediate_size in its config (every layer sparse): no feed_forward_length key
        "qwen3.5-35b-a3b": dict(
            _QWEN35, hidden=2048, layers=40, heads=16, kv_heads=2, ffn=None, linear_k_heads=16, linear_v_heads=32,
            tied=False, arch="qwen35moe", experts=256, experts_used=8, expert_ffn=512, shared_ffn=512,
        ),
    }
)  # fmt: skip
TYPES = ("q8_0", "q4_0", "q4_k_m")


def image_bench(name: str, images: str | None) -> bool:
    """Whether `bench speed --shape name` benches images: asked with --images (a shape with a
    vision tower), or always for a qwen3vl text file, which has no text-only rows of its own."""
    s = SHAPES[name]
    if images and not s.get("vision"):
        raise SparrowError(f"--images: the shape {name} has no vision tower")
    return bool(images) or s.get("arch") == "qwen3vl"


_BLOCK = {"q8_0": 32, "q4_0": 32, "q5_0": 32, "q4_k": 256, "q6_k": 256}  # values a block
_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q5_0": 22, "q4_k": 144, "q6_k": 210}
_FILE_TYPE = {"q8_0": 7, "q4_0": 2, "q4_k_m": 15}  # gguf.LlamaFileType.MOSTLY_Q8_0 / _Q4_0 / _Q4_K_M
_FALLBACK = {"q4_k": "q5_0", "q6_k": "q8_0"}  # llama.cpp's, for rows not a multiple of 256
_STD = 0.02
# uniform quants: q8_0 in -127..127, q4_0 nibbles 1..15 (value q - 8 in -7..7)
_Q_STD = {
    "q8_0": np.sqrt((255**2 - 1) / 12),
    "q4_0": np.sqrt((15**2 - 1) / 12),
    "q5_0": np.sqrt((32**2 - 1) / 12),
    "q4_k": np.sqrt((16**2 - 1) / 12),
    "q6_k": np.sqrt((64**2 - 1) / 12),
}

# Qwen3's added tokens (tokenizer.json added_tokens), from id bpe_tokens on.
QWEN3_ADDED = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5
_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _shape(shape) -> dict:
    if isinstance(shape, dict):
        return shape
    if shape not in SHAPES:
        raise SparrowError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    return SHAPES[shape]


def _check_type(qtype):
    if qtype not in TYPES:
        raise SparrowError(f"unsupported --type {qtype!r} for a shape benchmark; choose from {', '.join(TYPES)}")


def plan(shape, qtype: str = "q8_0") -> list[tuple[str, tuple[int, ...], str]]:
    """The file's tensors in order: (GGUF name, ggml shape (ne0 = input width, ...), type)."""
    _check_type(qtype)
    s = _shape(shape)
    if is_hybrid(s):
        return _plan_qwen35(s, qtype)
    h, hd, f, v, n = s["hidden"], s["head_dim"], s["ffn"], s["vocab"], s["layers"]
    q, kv = s["heads"] * hd, s["kv_heads"] * hd
    mat = _mat_type(qtype)

    out = [("token_embd.weight", (h, v), mat((h, v), s["tied"]))]
    if not s["tied"]:
        out.append(("output.weight", (h, v), mat((h, v), True)))
    out.append(("output_norm.weight", (h,), "f32"))
    for i in range(n):
        b = f"blk.{i}."
        # llama.cpp's use_more_bits(i, n): attn_v and ffn_down of these layers get q6_k
        more = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
        out += [
            (b + "attn_norm.weight", (h,), "f32"),
            (b + "attn_q.weight", (h, q), mat((h, q))),
            (b + "attn_k.weight", (h, kv), mat((h, kv))),
            (b + "attn_v.weight", (h, kv), mat((h, kv), more)),
            (b + "attn_q_norm.weight", (hd,), "f32"),
            (b + "attn_k_norm.weight", (hd,), "f32"),
            (b + "attn_output.weight", (q, h), mat((q, h))),
            (b + "ffn_norm.weight", (h,), "f32"),
        ]
        if "experts" in s:  # stacked experts (ne2 = expert); the router stays f32, as llama.cpp keeps it
            e, fe = s["experts"], s["expert_ffn"]
            out += [
                (b + "ffn_gate_inp.weight", (h, e), "f32"),
                (b + "ffn_gate_exps.weight", (h, fe, e), mat((h, fe, e))),
                (b + "ffn_up_exps.weight", (h, fe, e), mat((h, fe, e))),
                (b + "ffn_down_exps.weight", (fe, h, e), mat((fe, h, e), more)),
            ]
        else:
            out += [
                (b + "ffn_gate.weight", (h, f), mat((h, f))),
                (b + "ffn_up.weight", (h, f), mat((h, f))),
                (b + "ffn_down.weight", (f, h), mat((f, h), more)),
            ]
    return out


def is_hybrid(shape) -> bool:
    """A Qwen3.5 shape (qwen35 / qwen35moe: Gated DeltaNet and gated full attention)."""
    return _shape(shape).get("arch", "qwen3").startswith("qwen35")


def _mat_type(qtype: str):
    """mat(ne, more_bits) -> the type of a quantised matrix: qtype, or Q4_K_M's q4_k / q6_k with
    llama.cpp's fallback for rows that are not a multiple of 256."""

    def mat(ne, more_bits=False):
        if qtype != "q4_k_m":
            return qtype
        t = "q6_k" if more_bits else "q4_k"
        return _FALLBACK[t] if ne[0] % _BLOCK[t] else t

    return mat


def layer_types(shape) -> list[str]:
    """A Qwen3.5 shape's layer kinds: full attention every full_attention_interval-th layer."""
    s = _shape(shape)
    every = s["full_attention_interval"]
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(s["layers"])]


def _plan_qwen35(s: dict, qtype: str) -> list[tuple[str, tuple[int, ...], str]]:
    """qwen35 / qwen35moe tensors in the order llama-quantize writes them (the loader's
    weight_name_comparer: tensors outside blocks by name, then block by block, by name)."""
    h, hd, v, n = s["hidden"], s["head_dim"], s["vocab"], s["layers"]
    mat = _mat_type(qtype)
    lk, lv, dk, dv = s["linear_k_heads"], s["linear_v_heads"], s["linear_key_dim"], s["linear_value_dim"]
    conv = 2 * lk * dk + lv * dv  # the conv runs over q, k and v
    head = [("token_embd.weight", (h, v), mat((h, v), s["tied"])), ("output_norm.weight", (h,), "f32")]
    if not s["tied"]:
        head.append(("output.weight", (h, v), mat((h, v), True)))
    out = sorted(head)
    for i, kind in enumerate(layer_types(s)):
        b = f"blk.{i}."
        # llama.cpp's use_more_bits: attn_qkv and attn_v share one counter (one of them a layer),
        # ffn_down (the experts' and the shared expert's too) goes by layer: q6_k in these
        more = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
        t = [(b + "attn_norm.weight", (h,), "f32"), (b + "post_attention_norm.weight", (h,), "f32")]
        if kind == "linear_attention":
            t += [
                (b + "attn_qkv.weight", (h, conv), mat((h, conv), more)),
                (b + "attn_gate.weight", (h, lv * dv), mat((h, lv * dv))),
                (b + "ssm_a", (lv,), "f32"),
                (b + "ssm_alpha.weight", (h, lv), mat((h, lv))),
                (b + "ssm_beta.weight", (h, lv), mat((h, lv))),
                (b + "ssm_conv1d.weight", (s["conv_kernel"], conv), "f32"),
                (b + "ssm_dt.bias", (lv,), "f32"),
                (b + "ssm_norm.weight", (dv,), "f32"),
                (b + "ssm_out.weight", (lv * dv, h), mat((lv * dv, h))),
            ]
        else:
            q, kv = s["heads"] * hd, s["kv_heads"] * hd
            t += [
                (b + "attn_q.weight", (h, 2 * q), mat((h, 2 * q))),  # query and output gate per head
                (b + "attn_k.weight", (h, kv), mat((h, kv))),
                (b + "attn_v.weight", (h, kv), mat((h, kv), more)),
                (b + "attn_q_norm.weight", (hd,), "f32"),
                (b + "attn_k_norm.weight", (hd,), "f32"),
                (b + "attn_output.weight", (q, h), mat((q, h))),
            ]
        if "experts" in s:
            e, fe, fs = s["experts"], s["expert_ffn"], s["shared_ffn"]
            t += [
                (b + "ffn_gate_inp.weight", (h, e), "f32"),
                (b + "ffn_gate_exps.weight", (h, fe, e), mat((h, fe, e))),
                (b + "ffn_up_exps.weight", (h, fe, e), mat((h, fe, e))),
                (b + "ffn_down_exps.weight", (fe, h, e), mat((fe, h, e), more)),
                (b + "ffn_gate_inp_shexp.weight", (h, 1), "f32"),  # one row: ggml counts it 1-D, kept
                (b + "ffn_gate_shexp.weight", (h, fs), mat((h, fs))),
                (b + "ffn_up_shexp.weight", (h, fs), mat((h, fs))),
                (b + "ffn_down_shexp.weight", (fs, h), mat((fs, h), more)),
            ]
        else:
            f = s["ffn"]
            t += [
                (b + "ffn_gate.weight", (h, f), mat((h, f))),
                (b + "ffn_up.weight", (h, f), mat((h, f))),
                (b + "ffn_down.weight", (f, h), mat((f, h), more)),
            ]
        out += sorted(t)
    return out


def _nbytes(ne, ttype) -> int:
    n = int(np.prod(ne))
    return n * 4 if ttype == "f32" else n // _BLOCK[ttype] * _BLOCK_BYTES[ttype]


def param_count(shape) -> int:
    """Unique parameters (a tied embedding counted once)."""
    return sum(int(np.prod(ne)) for _, ne, _ in plan(shape))


def file_bytes(shape, qtype: str) -> int:
    """Approximate file size: tensor data (metadata adds a few MB)."""
    return sum(_nbytes(ne, t) for _, ne, t in plan(shape, qtype))


def metadata(shape) -> dict:
    """The `qwen3.*` (or `qwen3vl.*`) model keys the file carries (llama.cpp's names)."""
    s = _shape(shape)
    a = s.get("arch", "qwen3")
    if is_hybrid(s):
        return _metadata_qwen35(s)
    keys = {
        f"{a}.context_length": s["context"],
        f"{a}.embedding_length": s["hidden"],
        f"{a}.block_count": s["layers"],
        f"{a}.feed_forward_length": s["ffn"],
        f"{a}.attention.head_count": s["heads"],
        f"{a}.attention.head_count_kv": s["kv_heads"],
        f"{a}.attention.key_length": s["head_dim"],
        f"{a}.attention.value_length": s["head_dim"],
        f"{a}.rope.freq_base": s["rope_theta"],
        f"{a}.attention.layer_norm_rms_epsilon": s["rms_eps"],
    }
    if "experts" in s:
        keys[f"{a}.expert_count"] = s["experts"]
        keys[f"{a}.expert_used_count"] = s["experts_used"]
        keys[f"{a}.expert_feed_forward_length"] = s["expert_ffn"]
    if "mrope_section" in s:
        keys[f"{a}.rope.dimension_sections"] = [*s["mrope_section"], 0]
        keys[f"{a}.n_deepstack_layers"] = len(s["vision"]["deepstack"])
    return keys


def _metadata_qwen35(s: dict) -> dict:
    """The keys llama.cpp's converter writes for a Qwen3.5 text config (Qwen3NextModel and
    _Qwen35MRopeMixin; without the MTP layer: no nextn_predict_layers, block_count = layers)."""
    a = s["arch"]
    keys = {
        f"{a}.block_count": s["layers"],
        f"{a}.context_length": s["context"],
        f"{a}.embedding_length": s["hidden"],
    }
    if s.get("ffn"):
        keys[f"{a}.feed_forward_length"] = s["ffn"]
    keys |= {
        f"{a}.attention.head_count": s["heads"],
        f"{a}.attention.head_count_kv": s["kv_heads"],
        f"{a}.rope.dimension_sections": [*s["mrope_section"], 0],
        f"{a}.rope.freq_base": s["rope_theta"],
        f"{a}.attention.layer_norm_rms_epsilon": s["rms_eps"],
    }
    if "experts" in s:
        keys[f"{a}.expert_count"] = s["experts"]
        keys[f"{a}.expert_used_count"] = s["experts_used"]
    keys[f"{a}.attention.key_length"] = s["head_dim"]
    keys[f"{a}.attention.value_length"] = s["head_dim"]
    if "experts" in s:
        keys[f"{a}.expert_feed_forward_length"] = s["expert_ffn"]
        keys[f"{a}.expert_shared_feed_forward_length"] = s["shared_ffn"]
    keys |= {
        f"{a}.ssm.conv_kernel": s["conv_kernel"],
        f"{a}.ssm.state_size": s["linear_key_dim"],
        f"{a}.ssm.group_count": s["linear_k_heads"],
        f"{a}.ssm.time_step_rank": s["linear_v_heads"],
        f"{a}.ssm.inner_size": s["linear_value_dim"] * s["linear_v_heads"],
        f"{a}.attention.recurrent_layers": [t == "linear_attention" for t in layer_types(s)],
        f"{a}.full_attention_interval": s["full_attention_interval"],
        f"{a}.rope.dimension_count": s["rotary_dim"],
    }
    return keys


def vocabulary(shape) -> dict:
    """Synthesised Qwen3-layout vocabulary: tokens, token types, merges, special ids (see module doc)."""
    from sparrow.tokenizer import BYTE_DECODER

    s = _shape(shape)
    vocab, n_bpe = s["vocab"], s.get("bpe_tokens", s["vocab"] - len(QWEN3_ADDED))
    if n_bpe < 256 or n_bpe + len(QWEN3_ADDED) > vocab:
        raise SparrowError(f"vocabulary of {vocab} cannot hold 256 bytes + {len(QWEN3_ADDED)} added tokens")
    alphabet = sorted(BYTE_DECODER, key=BYTE_DECODER.get)  # the 256 byte-level characters
    tokens, merges = list(alphabet), []
    level, prev = 1, alphabet
    while len(tokens) < n_bpe:
        new = []
        for a in prev:
            for b in alphabet:
                if len(tokens) == n_bpe:
                    break
                tokens.append(a + b)
                merges.append(f"{a} {b}")
                new.append(a + b)
        prev, level = new, level + 1
    types = [_NORMAL] * n_bpe
    for t in QWEN3_ADDED:
        tokens.append(t)
        types.append(_CONTROL if t.startswith("<|") and t.endswith("|>") else _USER_DEFINED)
    for i in range(len(tokens), vocab):
        tokens.append(f"[PAD{i}]")
        types.append(_UNUSED)
    return {"tokens": tokens, "types": types, "merges": merges, "bos": n_bpe, "eos": n_bpe + 2, "pad": n_bpe}


def cache_dir() -> str:
    from sparrow.kernels.runtime import cache_root

    return os.path.join(cache_root(), "shapes")


def shape_path(name: str, qtype: str) -> str:
    return os.path.join(cache_dir(), f"{name}-{qtype}.gguf")


def _random_blocks(rng, rows: int, k: int, qtype: str) -> np.ndarray:
    """[rows, k / block * blockbytes] uint8 of random blocks with value std ~0.02."""
    nb = k // _BLOCK[qtype]
    bb = _BLOCK_BYTES[qtype]
    blk = np.empty((rows, nb, bb), np.uint8)
    d = (_STD / _Q_STD[qtype]) * rng.uniform(0.75, 1.25, (rows, nb, 1)).astype(np.float32)
    if qtype in ("q5_0", "q6_k"):  # codes not symmetric about the zero point: a random sign instead
        d *= rng.choice(np.float32([-1, 1]), (rows, nb, 1))
    if qtype in ("q5_0", "q4_k", "q6_k"):
        blk[:] = rng.integers(0, 256, blk.shape, dtype=np.uint8)  # codes (all values equally likely)
    if qtype == "q4_k":
        # 6-bit sub-block scales sc in 40..63 and mins m = sc, dmin = 7.5 d: (d sc) q - (7.5 d) sc
        # = d sc (q - 7.5), symmetric about 0; d is scaled by the mean sc
        sc = rng.integers(40, 64, (rows, nb, 8), dtype=np.uint8)
        d /= np.float32(51.5)
        blk[:, :, 0:2] = d.astype(np.float16).view(np.uint8)
        blk[:, :, 2:4] = (d * np.float32(7.5)).astype(np.float16).view(np.uint8)
        lo, hi = sc[..., :4], sc[..., 4:]  # ggml's get_scale_min_k4 packing, with m = sc
        blk[:, :, 4:8] = lo | ((hi >> 4) << 6)
        blk[:, :, 8:12] = blk[:, :, 4:8]
        blk[:, :, 12:16] = (hi & 15) | ((hi & 15) << 4)
        return blk.reshape(rows, -1)
    if qtype == "q6_k":
        sc = rng.integers(64, 128, (rows, nb, 16), dtype=np.uint8)  # int8 scales, mean ~95.5
        d /= np.float32(95.5)
        blk[:, :, 192:208] = sc
        blk[:, :, 208:210] = d.astype(np.float16).view(np.uint8)
        return blk.reshape(rows, -1)
    blk[:, :, 0:2] = d.astype(np.float16).view(np.uint8)
    if qtype == "q5_0":
        return blk.reshape(rows, -1)
    if qtype == "q8_0":
        blk[:, :, 2:] = rng.integers(-127, 128, (rows, nb, 32), dtype=np.int8).view(np.uint8)
    else:
        lo = rng.integers(1, 16, (rows, nb, 16), dtype=np.uint8)
        hi = rng.integers(1, 16, (rows, nb, 16), dtype=np.uint8)
        blk[:, :, 2:] = lo | (hi << 4)
    return blk.reshape(rows, -1)


def _f32_values(rng, name: str, ne) -> np.ndarray:
    """An f32 tensor's values: norms are ones (a qwen35 file stores 1 + weight: weight 0); the
    routers and the shared expert's gate random (ones would tie every expert); the DeltaNet's
    A = -exp(A_log) in -8..-0.5 with dt bias -3 +- 0.5 (decay exp(-A softplus(a + dt)) ~ 0.6..0.98
    a token) and its depthwise conv kernel uniform in +-0.5 (1 / sqrt(kernel), torch's init)."""
    shape = ne[::-1]
    if name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
        return rng.standard_normal(shape, np.float32) * np.float32(_STD)
    if name.endswith(".ssm_a"):
        return -rng.uniform(0.5, 8.0, shape).astype(np.float32)
    if name.endswith(".ssm_dt.bias"):
        return rng.normal(-3.0, 0.5, shape).astype(np.float32)
    if name.endswith(".ssm_conv1d.weight"):
        return rng.uniform(-0.5, 0.5, shape).astype(np.float32)
    return np.ones(shape, np.float32)


@contextmanager
def gguf_writer(path: str, arch: str):
    """A gguf.GGUFWriter on a temporary file that becomes `path` only when the block completes;
    on any error (Ctrl-C included) the partial file is removed."""
    import gguf

    tmp = f"{path}.tmp-{os.getpid()}"
    w = gguf.GGUFWriter(tmp, arch)
    try:
        yield w
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_gguf(path: str, shape, qtype: str, *, seed: int = 0, name: str | None = None, log=None) -> str:
    """Writes the random-weight GGUF for shape (a name or a shape dict) to path, atomically."""
    import gguf

    s = _shape(shape)
    tensors = plan(s, qtype)
    name = name or (shape if isinstance(shape, str) else "custom")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    qtypes = {t: gguf.GGMLQuantizationType[t.upper()] for t in ("f32",) + tuple(_BLOCK)}
    with gguf_writer(path, s.get("arch", "qwen3")) as w:
        w.add_name(f"{name} shape, random weights ({qtype})")
        w.add_description("sparrow bench shapes: random weights with a real model's tensor shapes")
        w.add_file_type(_FILE_TYPE[qtype])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, val in metadata(s).items():
            if isinstance(val, list):
                w.add_array(key, val)
            else:
                (w.add_float32 if isinstance(val, float) else w.add_uint32)(key, val)
        voc = vocabulary(s)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen35" if is_hybrid(s) else "qwen2")
        w.add_token_list(voc["tokens"])
        w.add_token_types(voc["types"])
        w.add_token_merges(voc["merges"])
        w.add_bos_token_id(voc["bos"])
        w.add_eos_token_id(voc["eos"])
        w.add_pad_token_id(voc["pad"])
        w.add_add_bos_token(False)
        w.add_chat_template(_CHATML)
        for tname, ne, t in tensors:
            # the writer takes numpy order (out, in); quantised tensors by their byte shape
            if t == "f32":
                w.add_tensor_info(tname, ne[::-1], np.dtype(np.float32), _nbytes(ne, t))
            else:
                byte_shape = ne[:0:-1] + (ne[0] // _BLOCK[t] * _BLOCK_BYTES[t],)
                w.add_tensor_info(tname, byte_shape, np.dtype(np.uint8), _nbytes(ne, t), raw_dtype=qtypes[t])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        rng = np.random.default_rng(seed)
        t0, last, done, total = time.perf_counter(), 0.0, 0, sum(_nbytes(ne, t) for _, ne, t in tensors)
        for tname, ne, t in tensors:
            # stream each tensor in row chunks (~16 MB), with GGUFWriter's alignment padding
            w.write_padding(fout, fout.tell())
            if t == "f32":
                _f32_values(rng, tname, ne).tofile(fout)
            else:
                k, rows = ne[0], int(np.prod(ne[1:]))
                step = max(1, (16 << 20) // (k // _BLOCK[t] * _BLOCK_BYTES[t]))
                for r in range(0, rows, step):
                    _random_blocks(rng, min(step, rows - r), k, t).tofile(fout)
            nb = _nbytes(ne, t)
            w.write_padding(fout, nb)
            done += nb
            if log and t != "f32" and (time.perf_counter() - last > 1 or done == total):
                last = time.perf_counter()
                log(
                    f"\rwriting {os.path.basename(path)}: {done / total:4.0%} "
                    f"({done >> 20} / {total >> 20} MiB, {time.perf_counter() - t0:.0f} s)"
                )
    if log:
        log("\n")
    return path


def ensure(name: str, qtype: str, *, log=None) -> str:
    """The cached file for (shape, type), written first if missing (after a free-space check)."""
    _check_type(qtype)
    s = _shape(name)
    path = shape_path(name, qtype)
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    need = file_bytes(s, qtype) + (64 << 20)
    free = shutil.disk_usage(cache_dir()).free
    if free < need + (1 << 30):  # keep 1 GiB spare
        raise SparrowError(
            f"{name} {qtype} needs {need / 2**30:.1f} GiB in {cache_dir()}, only {free / 2**30:.1f} GiB free"
        )
    if log is None:

        def log(msg):
            sys.stderr.write(msg)
            sys.stderr.flush()

    log(f"writing {path} ({need / 2**30:.1f} GiB, once; reused afterwards)\n")
    return write_gguf(path, s, qtype, name=name, log=log)
