"""Request options as typed, validated objects: sampling, block-sparse attention, KV storage.

They are built once at the edge (CLI arguments, an HTTP request, `LLM` keyword arguments) and
passed down as objects; nothing below the edge re-validates or rebuilds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .errors import SparrowError

KV_DTYPES = ("f32", "f16", "int8")
# block selectors: the article's (spec) and sparrow's (docs/SPARSE_SELECT_V2.md, docs/SPARSE_SELECT_V3.md)
SELECTORS = ("seed", "v2", "v3")
# --sparse-attn: exact; sparse at every length; sparse past the context where it pays on this CPU
# (SparseParams.auto: v3 on 4-bit key codes with a top-p budget, from the crossover of
# kernels/attention/crossover.py)
SPARSE_ATTN = ("off", "on", "auto")
# auto meets issue 70's KL, recall and aggregation bars but not its greedy-text bar, which no
# choice of blocks meets on the default model (docs/evaluation.md): so it stays opt-in
SPARSE_ATTN_DEFAULT = "off"
# auto's settings: v3 on 4-bit key codes (half the bytes a key of int8 ones, for 1.0-1.1x their KL,
# docs/evaluation.md), top-p 0.95 of the estimated mass, at most 32 blocks
AUTO_K, AUTO_P, AUTO_KEY_BITS = 32, 0.95, 4
V2_DENSE_LAYERS = 2  # v2 runs the first layers exact: they hold most of k=8's loss (docs/evaluation.md, "Selector v2")
# The selector word the kernels take (SparseParams.flags; kernels/attention/select.py reads it):
# v2's bits, then v3's bit, its 4-bit key codes' bit and its budget in the same int: bits 8..23
# min_blocks, bits 24..40 p in units of 2**-16 (0: a fixed k)
V2_ON, V2_SINK, V2_RECENT = 1, 2, 4
V3_ON, V3_KEY4, V3_MIN_SHIFT, V3_P_SHIFT, V3_P_ONE = 8, 16, 8, 24, 1 << 16
V3_KEY_BITS = (8, 4)  # v3's key codes: int8 (the default) or 4-bit (half the bytes a key)
QUANTIZE = (None, "q8_0")  # weight conversions at load: none, or f32/f16/bf16 -> q8_0


def check_kv_dtype(name: str) -> str:
    """Returns name if it is a KV cache storage kind, else raises SparrowError."""
    if name not in KV_DTYPES:
        raise SparrowError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")
    return name


@dataclass
class SparseParams:
    """Per-request block-sparse attention settings (None instead of this means exact)."""

    k: int = 32  # blocks selected per query head
    block: int = 32  # tokens per block
    probe: int = 8  # probe keys per block
    prefill: bool = False  # also select blocks for prefill queries (causal prefix, no importance)
    # "seed": the article's rule; "v2": block-summary scores (docs/SPARSE_SELECT_V2.md); "v3": every
    # key scored in int8, blocks ranked by estimated softmax mass (docs/SPARSE_SELECT_V3.md)
    select: str = "seed"
    dense_layers: int | None = None  # v2, v3: layers 0..dense_layers-1 exact (None: V2_DENSE_LAYERS)
    # v3's top-p budget: per head and step, blocks in order of estimated mass until their share
    # reaches p (None: always k), at least min_blocks and at most k
    p: float | None = None
    min_blocks: int = 1
    key_bits: int = 8  # v3: the bits of the key codes it scores (8, or 4: half the bytes a key)
    # v2 ablation switches (bench --selectors v2-nosink, v2-norecent): always take block 0 / the last block
    sink: bool = True
    recent: bool = True
    # sparse once a decoded token attends over this many positions, exact (bit for bit) below;
    # None: where sparse decode starts to pay on this CPU (sparse_attn='auto'; state.sparse.sparse_at)
    from_context: int | None = 0

    def __post_init__(self):
        for name in ("k", "block", "probe"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SparrowError(
                    f"sparse attention needs integer k, block and probe >= 1 (got k={self.k!r}, "
                    f"block={self.block!r}, probe={self.probe!r})"
                )
        if self.select not in SELECTORS:
            raise SparrowError(f"sparse_select must be one of {', '.join(SELECTORS)}, got {self.select!r}")
        if self.dense_layers is None:
            self.dense_layers = 0 if self.select == "seed" else V2_DENSE_LAYERS
        d = self.dense_layers
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise SparrowError(f"sparse_dense_layers must be an integer >= 0, got {d!r}")
        if self.select == "seed" and (d or not (self.sink and self.recent)):
            raise SparrowError("sparse_dense_layers, sink and recent are v2 / v3 settings (sparse_select='v2' or 'v3')")
        if self.select == "v3" and not (self.sink and self.recent):
            raise SparrowError("sink and recent are v2 settings: v3 forces no block in (sparse_select='v3')")
        kb = self.key_bits
        if isinstance(kb, bool) or not isinstance(kb, int) or kb not in V3_KEY_BITS:
            raise SparrowError(f"sparse_key_bits must be 8 or 4, got {self.key_bits!r}")
        if self.key_bits != 8 and self.select != "v3":
            raise SparrowError(
                f"sparse_key_bits is a v3 setting (sparse_select='v3'), got sparse_select={self.select!r}"
            )
        self._check_budget()
        f = self.from_context
        if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f < 0):
            raise SparrowError(f"sparse_from_context must be an integer >= 0, got {f!r}")

    @classmethod
    def auto(cls) -> SparseParams:
        """sparse_attn='auto' with nothing refined: v3 on 4-bit key codes with the top-p budget,
        exact below the CPU's crossover (from_options decides its settings)."""
        return cls.from_options(sparse_attn="auto")

    def _check_budget(self):
        """p and min_blocks: v3's top-p budget (each error names the field)."""
        if self.p is not None:
            if self.select != "v3":
                raise SparrowError(f"sparse_p is a v3 setting (sparse_select='v3'), got sparse_select={self.select!r}")
            if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0 < self.p <= 1:
                raise SparrowError(f"sparse_p must be a number in (0, 1], got {self.p!r}")
            self.p = float(self.p)
        m = self.min_blocks
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= 0xFFFF:
            raise SparrowError(f"sparse_min_blocks must be an integer in [1, 65535], got {m!r}")
        if m != 1 and self.p is None:
            raise SparrowError("sparse_min_blocks needs sparse_p (a fixed k takes k blocks)")
        if m > self.k:
            raise SparrowError(f"sparse_min_blocks ({m}) must not exceed sparse_k ({self.k}), the most blocks taken")

    def for_layer(self, index: int) -> SparseParams | None:
        """These settings for layer `index`, or None where v2 keeps the layer exact."""
        return None if index < self.dense_layers else self

    @property
    def copy_key(self) -> tuple:
        """Which copy beside the KV this selector's decode reads (SparseState.copy_for, the KV
        budget's charge): (block, n_probe) the seed's probe keys, (block, "v2") v2's summaries,
        (block, "v3") v3's int8 key codes, (block, "v3q4") its 4-bit ones."""
        if self.select == "seed":
            return self.block, self.probe
        return self.block, "v3q4" if self.key_bits == 4 else self.select

    @property
    def flags(self) -> int:
        """The selector as the kernels take it: 0 seed; v2 = 1, + 2 with the sink, + 4 with recency;
        v3 = 8 (+ 16 with 4-bit key codes) + min_blocks << 8 + p << 24, p in units of 2**-16 rounded
        to nearest (0: fixed k)."""
        if self.select == "seed":
            return 0
        if self.select == "v3":
            p = 0 if self.p is None else max(1, round(self.p * V3_P_ONE))
            key4 = V3_KEY4 if self.key_bits == 4 else 0
            return V3_ON | key4 | (self.min_blocks << V3_MIN_SHIFT) | (p << V3_P_SHIFT)
        return V2_ON | (V2_SINK if self.sink else 0) | (V2_RECENT if self.recent else 0)

    @property
    def label(self) -> str:
        """Short name for tables and records: seed, v2, v2-nosink, v2-norecent, v2-dense0, v3,
        v3-p0.95, v3-p0.9-min4, v3-q4-p0.95, ..."""
        frm = [] if self.from_context == 0 else [f"from{'auto' if self.from_context is None else self.from_context}"]
        if self.select == "seed":
            return "-".join(["seed"] + frm)
        if self.select == "v3":
            parts = ["v3"] + (["q4"] if self.key_bits == 4 else []) + ([f"p{self.p:g}"] if self.p is not None else [])
            parts += [f"min{self.min_blocks}"] if self.min_blocks != 1 else []
            parts += [f"dense{self.dense_layers}"] if self.dense_layers != V2_DENSE_LAYERS else []
            return "-".join(parts + frm)
        parts = ["v2"] + (["nosink"] if not self.sink else []) + (["norecent"] if not self.recent else [])
        if self.dense_layers != V2_DENSE_LAYERS:
            parts.append(f"dense{self.dense_layers}")
        return "-".join(parts + frm)

    @classmethod
    def from_label(cls, label: str, **kw) -> SparseParams:
        """Inverse of `label` (bench --selectors): "seed", "v2", "v2-nosink-norecent-dense0", "v3-p0.95", ..."""
        head, *mods = label.strip().split("-")
        opts: dict = {"select": head}
        if mods and mods[-1].startswith("from"):  # any selector: from<N> / fromauto
            f = mods.pop()[4:]
            if f != "auto" and not f.isdigit():
                raise SparrowError(f"unknown selector modifier {'from' + f!r} in {label!r} (from<N>, fromauto)")
            opts["from_context"] = None if f == "auto" else int(f)
        if head not in SELECTORS or (head == "seed" and mods):
            raise SparrowError(
                f"unknown selector {label!r} (seed, v2, v2-nosink, v2-norecent, v2-dense<N>, "
                "v3, v3-q4, v3-p<P>, v3-min<N>)"
            )
        for m in mods:
            if m in ("nosink", "norecent"):
                opts["sink" if m == "nosink" else "recent"] = False
            elif m.startswith("dense") and m[5:].isdigit():
                opts["dense_layers"] = int(m[5:])
            elif head == "v3" and m == "q4":
                opts["key_bits"] = 4
            elif head == "v3" and m.startswith("min") and m[3:].isdigit():
                opts["min_blocks"] = int(m[3:])
            elif head == "v3" and m.startswith("p") and _is_number(m[1:]):
                opts["p"] = float(m[1:])
            else:
                raise SparrowError(
                    f"unknown selector modifier {m!r} in {label!r} (nosink, norecent, dense<N>; v3: q4, p<P>, min<N>)"
                )
        return cls(**opts, **kw)

    @classmethod
    def from_options(
        cls,
        sparse_attn: bool | str | None = None,
        sparse_k: int | None = None,
        sparse_block: int | None = None,
        sparse_probe: int | None = None,
        sparse_prefill: bool = False,
        sparse_select: str | None = None,
        sparse_p: float | None = None,
        sparse_min_blocks: int | None = None,
        sparse_dense_layers: int | None = None,
        sparse_key_bits: int | None = None,
    ) -> SparseParams | None:
        """The flat option names the CLI, the HTTP API and `LLM` keywords use -> settings or
        None (exact attention). sparse_attn: "off" / False, "on" / True, "auto" (None:
        SPARSE_ATTN_DEFAULT); the other options refine the mode's settings (auto: v3 on 4-bit key
        codes, top-p 0.95, at most 32 blocks, from the crossover on)."""
        mode = sparse_mode(sparse_attn)
        if mode == "off":
            return None
        auto = mode == "auto"
        select = sparse_select or ("v3" if auto else "seed")
        return cls(
            k=(AUTO_K if auto else 32) if sparse_k is None else sparse_k,
            block=32 if sparse_block is None else sparse_block,
            probe=8 if sparse_probe is None else sparse_probe,
            prefill=bool(sparse_prefill),
            select=select,
            p=AUTO_P if auto and select == "v3" and sparse_p is None else sparse_p,
            min_blocks=1 if sparse_min_blocks is None else sparse_min_blocks,
            dense_layers=sparse_dense_layers,
            key_bits=(AUTO_KEY_BITS if auto and select == "v3" else 8) if sparse_key_bits is None else sparse_key_bits,
            from_context=None if auto else 0,
        )


def sparse_mode(value) -> str:
    """sparse_attn as given (a bool, "off" / "on" / "auto", None for the default) -> its mode."""
    if value is None:
        return SPARSE_ATTN_DEFAULT
    if value is True or value is False:
        return "on" if value else "off"
    if value not in SPARSE_ATTN:
        raise SparrowError(f"sparse_attn must be true, false or one of {', '.join(SPARSE_ATTN)}, got {value!r}")
    return value


SPARSE_OPTIONS = (
    "sparse_attn",
    "sparse_k",
    "sparse_block",
    "sparse_probe",
    "sparse_prefill",
    "sparse_select",
    "sparse_p",
    "sparse_min_blocks",
    "sparse_dense_layers",
    "sparse_key_bits",
)


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


SPECULATIVE_METHODS = ("ngram", "draft", "sparse", "mtp")
MAX_SPEC_TOKENS = 32  # most tokens drafted per verification


@dataclass
class SpeculativeParams:
    """Speculative decoding (None instead of this: plain decoding). A drafter proposes up to
    `tokens` tokens, one forward of the target checks them all, and the tokens, logits and KV
    cache are plain decoding's, bit for bit (engine/speculative.py says why)."""

    # ngram: prompt lookup; draft: a smaller model; sparse: this model, sparse attention; mtp: the
    # model's own multi-token-prediction layer (Qwen3.5)
    method: str = "ngram"
    tokens: int = 4  # K: most tokens drafted per verification
    ngram: int = 3  # ngram: the longest suffix of the text so far looked up (then shorter ones, down to 1)
    draft_model: str | None = None  # draft: the smaller model's path (sharing the target's tokenizer)
    sparse: SparseParams | None = None  # sparse: the drafter's attention (None: seed selector, k=8)
    adaptive: bool = True  # shorten the draft while drafts are rejected, down to none for a while

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise SparrowError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        for name, hi in (("tokens", MAX_SPEC_TOKENS), ("ngram", 64)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise SparrowError(f"spec_{name} must be an integer in [1, {hi}], got {v!r}")
        if self.method == "draft" and not self.draft_model:
            raise SparrowError("speculative 'draft' needs a draft model (--draft-model PATH)")
        if self.method != "draft" and self.draft_model:
            raise SparrowError("a draft model is only used with speculative 'draft'")
        if self.method == "sparse" and self.sparse is None:
            self.sparse = SparseParams(k=8)
        if self.method != "sparse" and self.sparse is not None:
            raise SparrowError("spec_sparse_* settings are only used with speculative 'sparse'")

    @property
    def label(self) -> str:
        """Short name for tables and logs: ngram-K4, sparse-seed-k8-K4, draft-K4."""
        mid = f"-{self.sparse.label}-k{self.sparse.k}" if self.sparse is not None else ""
        return f"{self.method}{mid}-K{self.tokens}"

    @classmethod
    def from_options(
        cls,
        speculative: str | None = None,
        spec_tokens: int = 4,
        spec_ngram: int = 3,
        draft_model: str | None = None,
        spec_sparse_k: int | None = None,
        spec_sparse_select: str | None = None,
        spec_adaptive: bool = True,
    ) -> SpeculativeParams | None:
        """The flat option names the CLI, the HTTP API and `LLM` keywords use -> settings or
        None (plain decoding)."""
        if speculative is None:
            if draft_model or spec_sparse_k is not None or spec_sparse_select is not None:
                raise SparrowError("draft_model and spec_sparse_* need speculative ('draft' or 'sparse')")
            return None
        sparse = None
        if speculative == "sparse":
            sparse = SparseParams(k=8 if spec_sparse_k is None else spec_sparse_k, select=spec_sparse_select or "seed")
        elif spec_sparse_k is not None or spec_sparse_select is not None:
            raise SparrowError("spec_sparse_k and spec_sparse_select are only used with speculative 'sparse'")
        return cls(speculative, spec_tokens, spec_ngram, draft_model, sparse, spec_adaptive)


SPECULATIVE_OPTIONS = (
    "speculative",
    "spec_tokens",
    "spec_ngram",
    "draft_model",
    "spec_sparse_k",
    "spec_sparse_select",
    "spec_adaptive",
)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0  # 0: greedy, as OpenAI's minimum reads (the smallest set of tokens is the best one)
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/llama.cpp style: divides positive logits, multiplies negative ones
    presence_penalty: float = 0.0  # OpenAI style, subtracted once per seen token
    frequency_penalty: float = 0.0  # OpenAI style, subtracted per occurrence
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to report (0 = only the chosen token)
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to that token's logit before any
    # filter or greedy pick (after the penalties); -100 all but bans it. Keys may be ints or the
    # decimal strings JSON gives; the ids are checked against the model's vocabulary where it is known.
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        if isinstance(self.stop, str):  # one stop string, as OpenAI and the CLI allow
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, int) and not isinstance(v, bool):
                setattr(self, name, float(v))

    def validate(self) -> SamplingParams:
        def bad(msg):
            raise SparrowError(msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature <= 100.0):
            bad(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 <= self.top_p <= 1.0):
            bad(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        # bounded so that dividing or multiplying a float32 logit by it stays finite (1e-320
        # is > 0 as a Python float but 0 in float32, and the sampler divided by zero)
        if not (REPETITION_PENALTY[0] <= self.repetition_penalty <= REPETITION_PENALTY[1]):
            bad(f"repetition_penalty must be in [1e-6, 1e6], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            bad(f"top_logprobs must be in [0, 20], got {self.logprobs}")
        if not isinstance(self.logit_bias, dict):
            bad(f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}")
        for k, v in self.logit_bias.items():
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                bad(f"logit_bias keys must be token ids (integers >= 0), got {k!r}"[:200])
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                bad(f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {k}"[:200])
        return self

    def check_vocab(self, vocab_size: int) -> SamplingParams:
        """Raises SparrowError when a token id this request names is not in the model's vocabulary."""
        bad = sorted(k for k in self.logit_bias if k >= vocab_size)
        if bad:
            raise SparrowError(f"logit_bias names token {bad[0]}, outside the vocabulary [0, {vocab_size})")
        return self


def _token_key(k):
    # "42" -> 42 (JSON object keys are strings); anything else is left for validate() to refuse
    if isinstance(k, str) and k.isascii() and k.isdigit():
        return int(k)
    return k


REPETITION_PENALTY = (1e-6, 1e6)  # its allowed range (SamplingParams.validate, the server schema)
SAMPLING_OPTIONS = tuple(f.name for f in fields(SamplingParams))


def options_to_params(options: dict) -> tuple[SamplingParams, SparseParams | None]:
    """Flat keyword options (SamplingParams fields and the sparse_* names) -> the two objects.
    An unknown name is an error, not silently ignored."""
    unknown = set(options) - set(SAMPLING_OPTIONS) - set(SPARSE_OPTIONS)
    if unknown:
        raise SparrowError(f"unknown option(s): {', '.join(sorted(unknown))}")
    sampling = SamplingParams(**{k: v for k, v in options.items() if k in SAMPLING_OPTIONS})
    sparse = SparseParams.from_options(**{k: v for k, v in options.items() if k in SPARSE_OPTIONS})
    return sampling, sparse
