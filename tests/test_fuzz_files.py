"""Corrupt model files: every damaged GGUF or safetensors header gives one line of SparrowError,
never another exception, a hang or a big allocation.

A valid tiny GGUF (reference_models.write_gguf, a 384-token byte-level vocabulary) and a valid
safetensors file are damaged systematically: truncated at many offsets, every size, count and
offset of the header set to huge values, type tags changed, tensors placed past the end, metadata
arrays nested, a huge vocabulary claimed, single bytes of the tokenizer metadata flipped. Each
case is loaded under a watchdog (a hang guard, not a speed check) and tracemalloc (the peak must
stay far below what the claimed sizes would need).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import tracemalloc

import numpy as np
import pytest

import reference_models as rm
import sparrow
from sparrow.errors import SparrowError
from sparrow.loaders.safetensors import read_safetensors, read_safetensors_dir

WATCHDOG_S = 30  # a case still running after this is a hang (the tiny files load in ~20 ms)
PEAK_LIMIT = 256 << 20  # bytes; a huge count taken at its word would allocate gigabytes
HUGE = (2**62, 2**64 - 1)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang


def attempt(load, data: bytes, path: str, traced: bool = True):
    """Writes the damaged bytes and loads them: None if it loaded, else the SparrowError's text.
    traced: measure the peak allocation (tracemalloc makes loading ~2x slower)."""
    with open(path, "wb") as f:
        f.write(data)
    old = signal.signal(signal.SIGALRM, _alarm)
    if traced:
        tracemalloc.start()
    signal.setitimer(signal.ITIMER_REAL, WATCHDOG_S)
    try:
        load(path)
        return None
    except SparrowError as e:
        return str(e)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if traced:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            assert peak < PEAK_LIMIT, f"peak allocation {peak >> 20} MiB"


def check(cases, load, path, must_fail: bool, traced: bool = True):
    """cases: (label, bytes). Any exception but SparrowError fails the test, naming the case."""
    loaded = 0
    for label, data in cases:
        try:
            msg = attempt(load, data, path, traced)
        except Hang:
            pytest.fail(f"{label}: still loading after {WATCHDOG_S} s")
        except AssertionError as e:
            pytest.fail(f"{label}: {e}")
        except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
            pytest.fail(f"{label}: {type(e).__name__} escaped: {e}")
        if must_fail:
            assert msg is not None, f"{label}: loaded"
        if msg is not None:
            assert msg.strip() and "\n" not in msg.strip() and len(msg) < 400, f"{label}: {msg[:400]!r}"
        loaded += msg is None
    print(f"\n{os.path.basename(path)}: {len(cases)} damaged files, {len(cases) - loaded} one-line errors")


# ---------------------------------------------------------------------- GGUF
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from sparrow.tokenizer import BYTE_DECODER

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**dict(rm.TINY_SPECS["qwen3"], vocab_size=384))).float().eval()
    letters = "etaoinshr"
    merges = [f"{a} {b}" for a in letters for b in letters]
    tokens = sorted(BYTE_DECODER, key=BYTE_DECODER.get) + [m.replace(" ", "") for m in merges]
    tokens += ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    meta = dict(
        tokens=tokens,
        token_type=[1] * (len(tokens) - 3) + [3] * 3,
        merges=merges,
        bos=len(tokens) - 1,
        eos=len(tokens) - 2,
        chat_template=CHATML,
    )
    path = str(tmp_path_factory.mktemp("fuzz") / "tiny.gguf")
    rm.write_gguf(model, "qwen3", path, "F16", meta)
    assert sparrow.load(path).tokenizer.encode("the heat")  # the undamaged file loads
    return open(path, "rb").read()


def _fields(data: bytes, path: str):
    """(name, parts as (offset, size, dtype)) of every metadata key and tensor info, from gguf's reader."""
    import gguf

    with open(path, "wb") as f:
        f.write(data)
    r = gguf.GGUFReader(path)
    base = r.data.ctypes.data
    out = [(k, f) for k, f in r.fields.items() if not k.startswith("GGUF.")]
    out += [(t.name, t.field) for t in r.tensors]
    return [(k, [(p.ctypes.data - base, p.nbytes, p.dtype) for p in f.parts]) for k, f in out]


def _put(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    return data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt) :]


def _load(path):
    sparrow.load(path)


def test_gguf_truncated_anywhere(tiny_gguf, tmp_path):
    fields = _fields(tiny_gguf, str(tmp_path / "x.gguf"))
    header_end = max(o + n for _, parts in fields for o, n, _ in parts)
    cuts = {0, 3, 4, 8, 16, 24} | {o + 1 for _, parts in fields for o, _, _ in parts[:6]}  # inside each part
    cuts |= set(np.linspace(header_end, len(tiny_gguf) - 1, 16).astype(int).tolist())  # inside the tensor data
    cases = [(f"cut at {c}", tiny_gguf[:c]) for c in sorted(cuts)]
    assert len(cases) > 100
    check(cases, _load, str(tmp_path / "cut.gguf"), must_fail=True, traced=False)


def test_gguf_huge_counts_lengths_and_offsets(tiny_gguf, tmp_path):
    fields = _fields(tiny_gguf, str(tmp_path / "x.gguf"))
    cases = [(f"n_tensors/n_kv at {o} = {v}", _put(tiny_gguf, o, "<Q", v)) for o in (8, 16) for v in (*HUGE, 10**6)]
    for name, parts in fields:
        sizes = [(o, n) for o, n, dt in parts if dt == np.uint64]
        # key/string lengths, array counts, tensor dims and offsets (and a few string lengths in arrays)
        for o, _ in sizes[:3] + sizes[-1:]:
            for v in (*HUGE, len(tiny_gguf)):
                cases.append((f"{name}: u64 at {o} = {v}", _put(tiny_gguf, o, "<Q", v)))
    assert len(cases) > 100
    check(cases, _load, str(tmp_path / "huge.gguf"), must_fail=True)


def test_gguf_numbers_out_of_range(tiny_gguf, tmp_path):
    """Every 32-bit number of the metadata (layer and head counts, widths, context, token ids) set
    to 0, 2^31 or 2^32-1: a head 2^31 wide once built 12 GiB of tables before failing."""
    fields = _fields(tiny_gguf, str(tmp_path / "x.gguf"))
    cases = []
    for name, parts in fields:
        if len(parts) == 4 and parts[3][1] == 4 and not name.startswith(("blk.", "token_embd", "output")):
            cases += [(f"{name} = {v}", _put(tiny_gguf, parts[3][0], "<I", v)) for v in (0, 2**31, 2**32 - 1)]
    assert len(cases) > 30
    check(cases, _load, str(tmp_path / "numbers.gguf"), must_fail=False)


def test_gguf_bos_token_id_out_of_range(tiny_gguf, tmp_path):
    """A BOS id past the vocabulary loaded and failed only at the first prompt (an index error)."""
    (o, _, _) = dict(_fields(tiny_gguf, str(tmp_path / "x.gguf")))["tokenizer.ggml.bos_token_id"][3]
    path = tmp_path / "bos.gguf"
    path.write_bytes(_put(tiny_gguf, o, "<I", 2**31))
    with pytest.raises(SparrowError, match="bos_token_id 2147483648 is not a token id"):
        sparrow.load(str(path))


def test_gguf_huge_vocabulary_and_tensor(tiny_gguf, tmp_path):
    fields = dict(_fields(tiny_gguf, str(tmp_path / "x.gguf")))
    count = fields["tokenizer.ggml.tokens"][4][0]  # the array's element count
    emb = fields["token_embd.weight"]
    rows = emb[3][0] + 8  # dims: [hidden, vocab]
    cases = [(f"{n} tokens", _put(tiny_gguf, count, "<Q", n)) for n in (10**9, 2**40, *HUGE)]
    cases += [(f"token_embd with {n} rows", _put(tiny_gguf, rows, "<Q", n)) for n in (10**9, 2**40, *HUGE)]
    check(cases, _load, str(tmp_path / "vocab.gguf"), must_fail=True)


def test_gguf_wrong_type_tags(tiny_gguf, tmp_path):
    fields = _fields(tiny_gguf, str(tmp_path / "x.gguf"))
    cases = [(f"version {v}", _put(tiny_gguf, 4, "<I", v)) for v in (0, 1, 4, 2**32 - 1)]
    for name, parts in fields:
        if name.startswith(("blk.", "token_embd", "output")):  # tensor info: n_dims and the ggml type
            tags = [(parts[2][0], (0, 9, 2**32 - 1)), (parts[-2][0], (4, 99, 2**32 - 1))]
        else:  # the value type, and an array's element type
            tags = [(parts[2][0], (0, 4, 5, 6, 7, 8, 9, 10, 12, 13, 2**32 - 1))]
            if len(parts) > 4 and parts[3][1] == 4 and parts[4][1] == 8:
                tags.append((parts[3][0], (*range(13), 99)))
        for o, values in tags:
            cases += [(f"{name}: tag at {o} = {v}", _put(tiny_gguf, o, "<I", v)) for v in values]
    assert len(cases) > 250
    # some retypings still read (uint32 as int32): those may load, the rest must fail cleanly
    check(cases, _load, str(tmp_path / "tags.gguf"), must_fail=False, traced=False)


def _nested_kv(depth: int, count: int = 1, pad: int = 32) -> bytes:
    """One metadata key holding arrays nested `depth` deep, padded to a multiple of `pad` bytes."""
    value = struct.pack("<I", 9)  # ARRAY
    for _ in range(depth):
        value += struct.pack("<IQ", 9, count)  # an array of `count` arrays ...
    value += struct.pack("<IQ", 0, 0)  # ... of zero uint8
    key_len = -(8 + len(value)) % pad + pad
    return struct.pack("<Q", key_len) + b"x" * key_len + value


def test_gguf_nested_metadata_arrays(tiny_gguf, tmp_path):
    """Inserted before the first key (a multiple of the alignment, so tensor data stays aligned)."""
    n_kv = struct.unpack_from("<Q", tiny_gguf, 16)[0]

    def with_kv(kv: bytes) -> bytes:
        return _put(tiny_gguf, 16, "<Q", n_kv + 1)[:24] + kv + tiny_gguf[24:]

    path = str(tmp_path / "nested.gguf")
    assert attempt(_load, with_kv(_nested_kv(2)), path) is None  # legal nesting loads
    deep = [(f"nested {d} deep", with_kv(_nested_kv(d))) for d in (5, 100, 5000, 100_000)]
    wide = [(f"{n} nested arrays", with_kv(_nested_kv(2, n))) for n in (10**9, *HUGE)]
    check(deep + wide, _load, path, must_fail=True)
    assert "nests arrays" in attempt(_load, deep[-1][1], path)


def test_gguf_flipped_tokenizer_bytes(tiny_gguf, tmp_path):
    """The bug found by hand: one flipped byte in a merge made `tokenizers` raise a bare Exception
    ("Error while initializing BPE: Token ... out of vocabulary") with a traceback."""
    fields = dict(_fields(tiny_gguf, str(tmp_path / "x.gguf")))
    merges = fields["tokenizer.ggml.merges"]
    first = merges[6][0]  # the first merge's text ("e e")
    path = str(tmp_path / "flip.gguf")
    msg = attempt(_load, _put(tiny_gguf, first, "<B", ord("Z")), path)  # "Z e": Z is no token
    assert msg is not None and "tokenizer" in msg and "\n" not in msg, msg
    lo, hi = fields["tokenizer.ggml.tokens"][0][0], merges[-1][0] + merges[-1][1]
    rng = np.random.default_rng(0)
    spots = sorted(set(rng.integers(lo, hi, 200).tolist()))
    cases = [(f"byte {o} ^ {x}", _put(tiny_gguf, o, "<B", tiny_gguf[o] ^ x)) for o, x in zip(spots, [1, 0x80] * 100)]
    check(cases, _load, path, must_fail=False, traced=False)


def test_huge_sentencepiece_token_is_no_hang():
    """A SentencePiece vocabulary's merges are derived by splitting every token (quadratic in its
    length): a corrupt multi-megabyte token must not stall loading."""
    from sparrow.tokenizer import _derive_merges

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, WATCHDOG_S)
    try:
        merges = _derive_merges(["a", "b", "ab", "a" * 4_000_000], [0.0, 0.0, -1.0, -2.0])
    except Hang:
        pytest.fail(f"still deriving merges after {WATCHDOG_S} s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert merges == [("a", "b")]


# ---------------------------------------------------------------------- safetensors
@pytest.fixture(scope="module")
def tiny_safetensors(tmp_path_factory) -> bytes:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {f"model.layers.{i}.w": rng.standard_normal((8, 16)).astype(np.float32) for i in range(3)}
    tensors["model.norm.weight"] = np.ones(16, np.float16)
    path = str(tmp_path_factory.mktemp("fuzz_st") / "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    assert set(read_safetensors(path)) == set(tensors)
    return open(path, "rb").read()


def _with_header(data: bytes, header) -> bytes:
    hlen = struct.unpack_from("<Q", data)[0]
    text = header if isinstance(header, (bytes, str)) else json.dumps(header)
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw + data[8 + hlen :]


def test_safetensors_damaged_headers(tiny_safetensors, tmp_path):
    data = tiny_safetensors
    hlen = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8 : 8 + hlen])
    name = "model.layers.1.w"
    cases = [(f"cut at {c}", data[:c]) for c in sorted({*range(0, 24), *range(0, len(data), 97), len(data) - 1})]
    cases += [(f"header length {v}", _put(data, 0, "<Q", v)) for v in (*HUGE, len(data) - 7, 1)]
    for text in ("[]", "1", '"x"', "null", "{", "[" * 100_000, '{"a": ' + "[" * 100_000, b"\xff\xfe{}"):
        cases.append((f"header {text[:12]!r}", _with_header(data, text)))
    entry = header[name]
    bad_entries = {
        "dtype": ["F64", "I8", 7, None, ["F32"], {"a": 1}],
        "shape": [
            [2**62],
            [2**62, 2**62],
            [2**40, 2**40, 2**40],
            [-1, 16],
            ["8", "16"],
            5,
            [1.5, 16],
            [True, 16],
            None,
        ],
        "data_offsets": [[0, 2**62], [2**62, 2**62 + 512], [512, 0], [-512, 0], [0], "0,512", None, [0.0, 512.0]],
    }
    for key, values in bad_entries.items():
        for v in values:
            cases.append((f"{key} = {v!r:.30}", _with_header(data, {**header, name: {**entry, key: v}})))
    cases += [(f"entry = {v!r}", _with_header(data, {**header, name: v})) for v in (5, [], "x", None)]
    cases.append(("a name with a newline", _with_header(data, {**header, "x\ny": {**entry, "dtype": "F64"}})))
    assert len(cases) > 80
    check(cases, read_safetensors, str(tmp_path / "model.safetensors"), must_fail=True)


def test_safetensors_bad_index(tiny_safetensors, tmp_path):
    st = tmp_path / "model.safetensors"
    st.write_bytes(tiny_safetensors)
    index = tmp_path / "model.safetensors.index.json"
    for text in ("[]", "{}", '{"weight_map": 5}', '{"weight_map": {"a": 5}}', '{"weight_map": {"a": "../x"}}', "{"):
        index.write_text(text)
        with pytest.raises(SparrowError) as e:
            read_safetensors_dir(str(tmp_path))
        assert "\n" not in str(e.value)
    os.remove(index)
    assert len(read_safetensors_dir(str(tmp_path))) == 4
