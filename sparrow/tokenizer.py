"""Tokenizer: text <-> ids for a model, built from a HF tokenizer.json or from GGUF metadata.

The BPE itself runs in HF `tokenizers` (Rust); this module only assembles it. A GGUF stores the
vocabulary, merges and token types under llama.cpp's keys plus a pre-tokenizer *name*; we turn the
name into the split regex llama.cpp uses for it, so ids match the model's own tokenizer.json.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import threading

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from sparrow.chat_template import render_chat
from sparrow.errors import SparrowError

__all__ = ["Tokenizer", "IncrementalDecoder", "SpecialText"]

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's tokenizer.json: Qwen2's with letters and combining marks (\p{M}) kept together.
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> how HF splits text for them.
# "digits": each digit isolated, then the GPT-2 regex (llama.cpp: "\p{N}" then the GPT-2 regex),
# which is what SmolLM2's / StarCoder's tokenizer.json do with Digits(individual_digits=True).
_PRE_DIGITS = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
}
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe"}  # llama.cpp looks whole words up before merging

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte alphabet: printable bytes stand for themselves, the rest are shifted past 255.
    bs = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_DECODER: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}


def _reader_meta(reader) -> dict:
    """The tokenizer's GGUF keys from a gguf.GGUFReader, as plain values (arrays as lists/numpy)."""
    meta = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            meta[key] = _gguf_strings(field)
        elif key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            meta[key] = _gguf_array(field)
        else:
            meta[key] = _gguf_value(reader, key)
    return meta


def _gguf_value(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    part = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return part.tobytes().decode("utf-8")
    return part.tolist()[0]


def _gguf_strings(field) -> list[str]:
    # Each string is its own part; tobytes() per part is ~0.6 us, the cheapest per-item access.
    parts = field.parts
    return [parts[i].tobytes().decode("utf-8", errors="replace") for i in field.data]


def _gguf_array(field) -> np.ndarray:
    parts = field.parts
    first, last = parts[field.data[0]], parts[field.data[-1]]
    base = first.base if isinstance(first.base, np.ndarray) else None
    n = len(field.data)
    # The elements lie back to back in the file; view them as one array instead of n tiny ones.
    if base is not None and last.ctypes.data - first.ctypes.data == (n - 1) * first.itemsize:
        start = first.ctypes.data - base.ctypes.data
        try:
            return np.frombuffer(base, dtype=np.uint8, count=n * first.itemsize, offset=start).view(first.dtype)
        except (ValueError, TypeError):  # base not a plain contiguous buffer: take the slow path
            pass
    return np.concatenate([parts[i] for i in field.data])


def _pre_tokenizer(pre: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _PRE_DIGITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level  # "gpt2", "default" and unknown names: the plain GPT-2 regex


def _respell_byte_level(tokens: list[str], merges: list[tuple[str, str]], added: np.ndarray):
    """Normal tokens stored raw instead of in the byte alphabet -> byte-alphabet spelling (merges too).

    Control/user-defined tokens keep their raw text (e.g. DeepSeek's "<｜end▁of▁sentence｜>"): they
    are matched as added tokens on the raw input, and the byte-level decoder passes them through.
    """
    alphabet = "".join(sorted(BYTE_DECODER))
    outside = re.compile("[^" + re.escape(alphabet) + "]")
    if not outside.search("".join(tokens)):
        return tokens, merges
    enc = {b: c for c, b in BYTE_DECODER.items()}

    def spell(t):
        return "".join(enc[b] for b in t.encode("utf-8")) if outside.search(t) else t

    tokens = [t if added[i] else spell(t) for i, t in enumerate(tokens)]
    return tokens, [(spell(a), spell(b)) for a, b in merges]


_MAX_SPLIT = 1024  # characters; real SentencePiece pieces are a few dozen at most


def _derive_merges(tokens: list[str], scores) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens, best score first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for tok, score in zip(tokens, scores):
        if len(tok) > _MAX_SPLIT:  # splitting costs len^2: a corrupt file's megabyte "token" would hang here
            continue
        local = [(tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab]
        local.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges.extend((l, r, score) for l, r in local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(l, r) for l, r, _ in merges]


_EOG_TEXTS = frozenset({"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>"})


class Tokenizer:
    """A model's tokenizer: encode/decode, special ids, chat template."""

    def __init__(
        self,
        hf: _HFTokenizer,
        *,
        bos_token_id=None,
        eos_token_ids=(),
        add_bos=False,
        chat_template=None,
        special_ids=(),
        decoder_kind="generic",
        strip_leading_space=False,
    ):
        self._tk = hf
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(int(i) for i in eos_token_ids))
        self.add_bos: bool = bool(add_bos and bos_token_id is not None)
        self.chat_template: str | None = chat_template
        self._special_ids = frozenset(special_ids)
        self._decoder_kind = decoder_kind  # "byte_level" | "sentencepiece" | "generic"
        self._strip_leading_space = strip_leading_space
        self._token_bytes_cache: dict[int, bytes] = {}
        self._specials: re.Pattern | None | bool = False  # False: not built yet (specials_pattern)
        self._plain: _HFTokenizer | None = None  # a copy that reads special-token text as text
        self._plain_lock = threading.Lock()

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source) -> Tokenizer:
        """From GGUF metadata: a sparrow GGUFFile (its `meta` dict) or a gguf.GGUFReader."""
        meta = source.meta if hasattr(source, "meta") else _reader_meta(source)
        _check_gguf_vocab(meta)
        try:
            return cls._from_gguf(meta)
        except SparrowError:
            raise
        except Exception as e:  # noqa: BLE001 - `tokenizers` raises a bare Exception on a bad vocabulary
            raise SparrowError(f"corrupt GGUF tokenizer: {' '.join(str(e).split())[:200]}") from None

    @classmethod
    def _from_gguf(cls, meta: dict) -> Tokenizer:
        model = meta.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise SparrowError(f"unsupported GGUF tokenizer model {model!r} (supported: gpt2, llama)")
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = np.asarray(meta.get("tokenizer.ggml.token_type", np.ones(len(tokens), np.int32)))
        pre = meta.get("tokenizer.ggml.pre")
        bos = meta.get("tokenizer.ggml.bos_token_id")
        if bos is not None and not (isinstance(bos, (int, np.integer)) and 0 <= bos < len(tokens)):
            raise SparrowError(
                f"corrupt GGUF tokenizer: bos_token_id {bos!r} is not a token id (vocabulary {len(tokens)})"
            )
        eos_ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        eos_ids = [i for i in eos_ids if i is not None and 0 <= i < len(tokens)]
        # A GGUF carries no generation_config.json: like llama.cpp, also end generation on the
        # end-of-turn tokens a chat model may emit (Qwen: <|im_end|> and <|endoftext|>).
        if eos_ids and tokens[eos_ids[0]] in _EOG_TEXTS:
            eos_ids += [i for i, t in enumerate(tokens) if t in _EOG_TEXTS]
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
        add_bos = meta.get("tokenizer.ggml.add_bos_token", model == "llama")
        if "tokenizer.ggml.merges" in meta:
            merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        elif model == "llama":
            merges = _derive_merges(tokens, np.asarray(meta["tokenizer.ggml.scores"]).tolist())
        else:
            raise SparrowError("GGUF byte-level tokenizer has no tokenizer.ggml.merges")
        is_added = (types == _TOKEN_CONTROL) | (types == _TOKEN_USER_DEFINED)
        if model == "gpt2":
            tokens, merges = _respell_byte_level(tokens, merges, is_added)
        vocab = dict(zip(tokens, range(len(tokens))))
        if len(vocab) != len(tokens):
            # Duplicate spellings (rare, e.g. unused slots): keep the first id, as llama.cpp does.
            vocab = {}
            for i, t in enumerate(tokens):
                vocab.setdefault(t, i)
        # Built through the Python API: ~5x faster than serialising 150K tokens to JSON for from_str.
        if model == "gpt2":
            hf = _HFTokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
            hf.pre_tokenizer = _pre_tokenizer(pre)
            hf.decoder = decoders.ByteLevel()
            kind, strip = "byte_level", False
        else:
            unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
            strip = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            hf = _HFTokenizer(models.BPE(vocab, merges, unk_token=tokens[unk], fuse_unk=True, byte_fallback=True))
            hf.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement="\u2581", prepend_scheme="first" if strip else "never", split=False
            )
            hf.decoder = decoders.Sequence(
                [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                + ([decoders.Strip(" ", 1, 0)] if strip else [])
            )
            kind = "sentencepiece"
        # Control tokens become special added tokens and user-defined ones plain added tokens, so
        # both match whole inside text.
        special_ids, added = [], []
        for i in np.flatnonzero(is_added).tolist():
            if vocab.get(tokens[i]) != i:
                continue
            special = int(types[i]) == _TOKEN_CONTROL
            added.append(AddedToken(tokens[i], special=special, normalized=False))
            if special:
                special_ids.append(i)
        hf.add_special_tokens([t for t in added if t.special])
        hf.add_tokens([t for t in added if not t.special])
        return cls(
            hf,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            add_bos=add_bos,
            chat_template=meta.get("tokenizer.chat_template"),
            special_ids=special_ids,
            decoder_kind=kind,
            strip_leading_space=strip,
        )

    @classmethod
    def from_hf_dir(cls, path) -> Tokenizer:
        path = os.fspath(path)
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise SparrowError(f"no tokenizer.json in {path}")
        with open(tj, encoding="utf-8") as f:
            text = f.read()
        try:
            spec = json.loads(text)
            hf = _HFTokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
            raise SparrowError(f"cannot load {tj}: {' '.join(str(e).split())}") from None
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        smap = _read_json(os.path.join(path, "special_tokens_map.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))

        def token_id(name):
            tok = config.get(name, smap.get(name))
            if isinstance(tok, dict):
                tok = tok.get("content")
            return hf.token_to_id(tok) if isinstance(tok, str) else None

        bos, eos = token_id("bos_token"), token_id("eos_token")
        eos_ids = [eos] if eos is not None else []
        gen_eos = gen.get("eos_token_id")
        eos_ids += gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []
        if bos is None and isinstance(gen.get("bos_token_id"), int):
            bos = gen["bos_token_id"]
        add_bos = config.get("add_bos_token")
        if add_bos is None and bos is not None:
            # No explicit flag: the post-processor decides (Llama-3's TemplateProcessing adds BOS).
            add_bos = hf.encode("a", add_special_tokens=True).ids[:1] == [bos]
        template = _read_chat_template(path, config)
        special_ids = [t["id"] for t in spec.get("added_tokens", []) if t.get("special")]
        kind, strip = _decoder_kind(spec.get("decoder"))
        return cls(
            hf,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            add_bos=bool(add_bos),
            chat_template=template,
            special_ids=special_ids,
            decoder_kind=kind,
            strip_leading_space=strip,
        )

    # ---- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, s) -> int | None:
        return self._tk.token_to_id(s)

    def id_to_token(self, i) -> str | None:
        return self._tk.id_to_token(int(i))

    def is_special(self, token_id) -> bool:
        return int(token_id) in self._special_ids

    def token_bytes(self, token_id) -> bytes | None:
        """The raw bytes one token stands for (None when the decoder is not byte-exact per token)."""
        token_id = int(token_id)
        b = self._token_bytes_cache.get(token_id)
        if b is None:
            if self._decoder_kind == "generic":
                return None
            tok = self._tk.id_to_token(token_id)
            if tok is None:
                return b""  # decode() drops ids outside the vocabulary too
            if self._decoder_kind == "byte_level":
                try:
                    b = bytes(BYTE_DECODER[c] for c in tok)
                except KeyError:  # not byte-alphabet spelled: the decoder passes it through as UTF-8
                    b = tok.encode("utf-8")
            elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">") and _is_hex(tok[3:5]):
                b = bytes([int(tok[3:5], 16)])  # byte-fallback token
            else:
                b = tok.replace("\u2581", " ").encode("utf-8")
            self._token_bytes_cache[token_id] = b
        return b

    def specials_pattern(self) -> re.Pattern | None:
        """A regex matching any special token's text, longest first (as `tokenizers` splits:
        leftmost-longest), one capturing group; None when the tokenizer has none."""
        if self._specials is False:
            texts = sorted(
                {t.content for t in self._tk.get_added_tokens_decoder().values() if t.special and t.content},
                key=lambda t: (-len(t), t),
            )
            self._specials = re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None
        return self._specials

    def encode_as_text(self, text: str) -> list[int]:
        """text's ids with special-token text in it encoded as the plain text it is (`<|im_end|>`
        becomes `<`, `|`, `im`, ...), never as the special token."""
        if self._plain is None:
            with self._plain_lock:
                if self._plain is None:
                    # A copy: the flag is the tokenizer's, and other threads encode with this one.
                    plain = _HFTokenizer.from_str(self._tk.to_str())
                    plain.encode_special_tokens = True
                    self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(
            self, skip_special_tokens=skip_special_tokens, strip_leading_space=self._strip_leading_space
        )

    # ---- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **kwargs) -> str:
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None
        eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None
        kwargs.setdefault("bos_token", bos)
        kwargs.setdefault("eos_token", eos)
        return render_chat(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )


class SpecialText:
    """Keeps special-token text that callers wrote (message content, tools, a system prompt) text,
    so that a user cannot forge a turn (`<|im_end|>\\n<|im_start|>system\\n...` in a message):
    special tokens in a chat prompt come only from its template, as in OpenAI's API.

    `escape` replaces each special token's text in the caller's strings with a marker (a
    private-use character absent from the template, around the token's number; the marker
    character itself, if a caller wrote it, is escaped the same way) before the template renders
    them; `encode` splits the rendered prompt at the special tokens left, which the template
    wrote, encodes those as special tokens and the text between them with special-token parsing
    off, each marker turned back into the text it stands for. When no caller string holds a
    special token (`active` is False), escape() returns its input unchanged and encode() is
    tokenizer.encode(), so ordinary prompts encode exactly as before.

    Image parts ({"type": "image" | "image_url"}) are passed through: their placeholders are the
    model's own special tokens, written after escaping."""

    def __init__(self, tokenizer: Tokenizer, values, template: str | None):
        self.tokenizer = tokenizer
        self.pattern = tokenizer.specials_pattern()
        self.active = self.pattern is not None and any(self.pattern.search(s) for s in _strings(values))
        self.texts: list[str] = []
        if self.active:
            seen = set(template or "") | set(self.pattern.pattern)  # what the template may write
            self.mark = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in seen)
            self._escape_re = re.compile(self.pattern.pattern[:-1] + "|" + re.escape(self.mark) + ")")
            self._unmark = re.compile(re.escape(self.mark) + r"(\d+)" + re.escape(self.mark))

    def escape(self, value):
        if not self.active:
            return value
        if isinstance(value, str):
            return self._escape_re.sub(self._marker, value)
        if isinstance(value, dict):
            if value.get("type") in ("image", "image_url"):
                return value
            return {self.escape(k): self.escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.escape(v) for v in value)
        return value

    def _marker(self, m: re.Match) -> str:
        self.texts.append(m.group(0))
        return f"{self.mark}{len(self.texts) - 1}{self.mark}"

    def encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        if not self.active:
            return tok.encode(text, add_special_tokens=False)
        ids = []
        for k, part in enumerate(self.pattern.split(text)):  # text, special, text, special, ..., text
            if k % 2:
                ids.append(tok.token_to_id(part))
            elif part:
                ids += tok.encode_as_text(self._unmark.sub(lambda m: self.texts[int(m.group(1))], part))
        return ids


def _strings(value):
    """Every string in value (dict keys too), except inside image parts."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        if value.get("type") not in ("image", "image_url"):
            for k, v in value.items():
                yield from _strings(k)
                yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _check_gguf_vocab(meta: dict) -> None:
    """The tokenizer keys a GGUF must hold, with the types and lengths the builder relies on."""

    def bad(key, why):
        raise SparrowError(f"corrupt GGUF tokenizer: {key} {why}")

    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        bad("tokenizer.ggml.tokens", "is missing or not a list of strings")
    n = len(tokens)
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        v = meta.get(key)
        if v is not None and (not isinstance(v, np.ndarray) or v.ndim != 1 or len(v) != n):
            bad(key, f"must be an array of {n} numbers, one per token")
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None and not (isinstance(merges, list) and all(isinstance(m, str) for m in merges)):
        bad("tokenizer.ggml.merges", "must be a list of strings")
    for key in ("model", "pre", "chat_template"):
        v = meta.get(f"tokenizer.{'' if key == 'chat_template' else 'ggml.'}{key}")
        if v is not None and not isinstance(v, str):
            bad(f"tokenizer.ggml.{key}", "must be a string")
    for key in ("bos", "eos", "eot", "eom", "unknown"):  # ids past the vocabulary are dropped, except unknown's
        v = meta.get(f"tokenizer.ggml.{key}_token_id")
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or (key == "unknown" and not 0 <= v < n)):
            bad(f"tokenizer.ggml.{key}_token_id", f"is {v!r:.40}, not a token id below {n}")


def _is_hex(s: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in s)


def _read_json(path) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise SparrowError(f"cannot read {path}: {' '.join(str(e).split())}") from None
    return data if isinstance(data, dict) else {}


def _read_chat_template(path, config) -> str | None:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template") or _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _decoder_kind(decoder) -> tuple[str, bool]:
    """How tokens become bytes under a tokenizer.json decoder, and whether one leading space is stripped."""
    if not isinstance(decoder, dict):
        return "generic", False
    kind = decoder.get("type")
    if kind == "ByteLevel":
        return "byte_level", False
    if kind == "Metaspace":
        return "sentencepiece", decoder.get("prepend_scheme", "always") != "never"
    if kind == "Sequence":
        parts = [d.get("type") for d in decoder.get("decoders", [])]
        if parts == ["ByteLevel"]:
            return "byte_level", False
        replaces_space = any(
            d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "\u2581" and d.get("content") == " "
            for d in decoder["decoders"]
        )
        if replaces_space and set(parts) <= {"Replace", "ByteFallback", "Fuse", "Strip"}:
            strip = any(d.get("type") == "Strip" and d.get("start", 0) >= 1 for d in decoder["decoders"])
            return "sentencepiece", strip
    return "generic", False


class IncrementalDecoder:
    """Streams text token by token; concatenated pushes + flush equal `decode(all ids)`.

    Works on each token's bytes, so a multibyte character split over tokens (byte-level BPE pieces,
    SentencePiece <0xNN> fallbacks) is held back until complete instead of surfacing as U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False, strip_leading_space: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._strip = strip_leading_space
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._ids: list[int] = []  # only for decoders without a per-token byte form
        self._emitted = ""

    def push(self, token_id) -> str:
        token_id = int(token_id)
        if self._skip and self._tok.is_special(token_id):
            return ""
        b = self._tok.token_bytes(token_id)
        if b is None:
            return self._push_generic(token_id)
        if self._strip and b:
            # The decoder strips one space from the start of the whole text, i.e. of the first bytes.
            b = b[1:] if b[:1] == b" " else b
            self._strip = False
        return self._utf8.decode(b)

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        if self._ids:
            full = self._tok.decode(self._ids, skip_special_tokens=self._skip)
            text += full[len(self._emitted) :]
            self._emitted = full
        return text

    def _push_generic(self, token_id: int) -> str:
        # Re-decode everything and emit the new tail, unless it ends in a half character.
        self._ids.append(token_id)
        full = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        if full.endswith("\ufffd") or not full.startswith(self._emitted):
            return ""
        new, self._emitted = full[len(self._emitted) :], full
        return new
