"""Model configuration: one dataclass, built from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .errors import SparrowError

# HF `architectures[0]` / `model_type` and GGUF `general.architecture` -> sparrow family name.
_HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
_GGUF_ARCHS = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "qwen3vl": "qwen3",
    "qwen35": "qwen3_5",
    "qwen35moe": "qwen3_5_moe",
}
SUPPORTED = "llama, qwen2, qwen3, qwen3_moe, qwen3_5, qwen3_5_moe"
HYBRID = ("qwen3_5", "qwen3_5_moe")  # Gated DeltaNet layers beside gated full attention
LAYER_TYPES = ("linear_attention", "full_attention")

# Rope scalings sparrow runs, and the keys each takes in an HF config / a sparrow.load override.
ROPE_SCALINGS = ("default", "linear", "llama3", "yarn")
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}


@dataclass
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "qwen3_5" | "qwen3_5_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # {"rope_type": "linear"|"llama3"|"yarn", ...} (HF's keys; yarn's factor and original length
    # always set) or None for plain RoPE
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    # Mixture of experts (Qwen3-MoE); zero experts means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    # Qwen3-VL's interleaved M-RoPE: head_dim/2 frequencies split over the (t, h, w) position
    # axes; empty for plain RoPE. Text tokens have t = h = w, where it equals plain RoPE.
    mrope_section: tuple[int, ...] = field(default_factory=tuple)
    # Qwen3.5 (hybrid): each layer's kind (LAYER_TYPES), the rotary part of head_dim (0: all of
    # it), the Gated DeltaNet's heads and dims, and the MoE's shared expert (0: none).
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    rotary_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    shared_expert_intermediate_size: int = 0
    # llama.cpp's qwen35 layout (loaders/names.py): norms hold 1 + weight, A = -exp(A_log) is
    # stored, value heads are tiled over the key heads (h % Hk) rather than grouped (h // ratio)
    gguf_layout: bool = False
    # Qwen3.5's multi-token-prediction layers the file declares (HF mtp_num_hidden_layers, GGUF
    # nextn_predict_layers; the GGUF's block_count counts them, num_hidden_layers does not).
    # Whether the head is there is decided by its tensors (models/qwen3_5_mtp.py).
    mtp_layers: int = 0

    @property
    def is_hybrid(self) -> bool:
        return bool(self.layer_types)

    @property
    def full_attention_layers(self) -> list[int]:
        """The layers that keep a KV cache: all of them, or a hybrid model's full-attention ones."""
        if not self.layer_types:
            return list(range(self.num_hidden_layers))
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, i: int) -> bool:
        """Whether layer i uses the MoE block (transformers' Qwen3-MoE rule)."""
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % max(1, self.decoder_sparse_step) == 0

    def with_rope_scaling(self, override: dict | None) -> ModelConfig:
        """This config with its rope scaling replaced, as if config.json said `override` (a
        sparrow.load / --rope-scaling override, checked by check_rope_override); None keeps it,
        {"rope_type": "default"} turns scaling off."""
        if override is None:
            return self
        scaling = _check_rope_scaling(check_rope_override(override), self.max_position_embeddings)
        return dataclasses.replace(self, rope_scaling=scaling)

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        arch = _hf_architecture(cfg)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = dict(rope)
        max_positions = int(cfg.get("max_position_embeddings", 4096))
        moe = arch in ("qwen3_moe", "qwen3_5_moe")
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0)) if moe else 0
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        hybrid = _hf_hybrid(cfg, arch, head_dim, rope) if arch in HYBRID else {}
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 0)),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=_check_rope_scaling(scaling, max_positions, cfg.get("original_max_position_embeddings")),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch in ("qwen3", "qwen3_moe", *HYBRID),
            num_experts=int(num_experts or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
            # Qwen3.5-MoE's router always renormalises its top-k weights
            norm_topk_prob=bool(cfg.get("norm_topk_prob", arch == "qwen3_5_moe")),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            # Qwen3.5 always runs interleaved M-RoPE, [11, 11, 10] where the config names none
            mrope_section=_mrope_section(scaling or rope) or ((11, 11, 10) if arch in HYBRID else ()),
            **hybrid,
        )

    @classmethod
    def from_gguf(cls, meta: dict, tensor_names: set[str], vocab_size: int) -> ModelConfig:
        """meta: GGUF key -> python value; tensor_names: GGUF tensor names present."""
        garch = meta.get("general.architecture")
        arch = _GGUF_ARCHS.get(garch)
        if arch is None:
            raise SparrowError(f"unsupported architecture {garch!r} in GGUF; supported: {', '.join(_GGUF_ARCHS)}")
        p = garch + "."

        def get(key, default=None):
            return meta.get(p + key, default)

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        kv_heads = get("attention.head_count_kv", heads)
        if not isinstance(kv_heads, int):  # per-layer array in some files
            kv_heads = kv_heads[0]
        scaling = None
        stype = get("rope.scaling.type")
        if stype and stype != "none":
            scaling = {"rope_type": stype, "factor": float(get("rope.scaling.factor", 1.0))}
            if stype == "yarn":
                scaling.update(_gguf_yarn(get, scaling["factor"]))
        max_positions = int(get("context_length", 4096))
        head_dim = int(get("attention.key_length", hidden // heads))
        nextn = int(get("nextn_predict_layers", 0) or 0) if arch in HYBRID else 0  # the MTP blocks, last
        return cls(
            architecture=arch,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", 0) or 0),
            num_hidden_layers=int(get("block_count")) - nextn,
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=_check_rope_scaling(scaling, max_positions),
            max_position_embeddings=max_positions,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm=arch in ("qwen3", "qwen3_moe", *HYBRID),
            num_experts=int(get("expert_count", 0) or 0),
            num_experts_per_tok=int(get("expert_used_count", 0) or 0),
            moe_intermediate_size=int(get("expert_feed_forward_length", 0) or 0),
            # llama.cpp's qwen3moe and qwen35moe always renormalise the top-k weights.
            norm_topk_prob=arch in ("qwen3_moe", "qwen3_5_moe"),
            mrope_section=tuple(int(s) for s in get("rope.dimension_sections", ()))[:3]
            if garch in ("qwen3vl", "qwen35", "qwen35moe")
            else (),
            **(_gguf_hybrid(get, int(get("block_count")) - nextn, head_dim, nextn) if arch in HYBRID else {}),
        )


def _hf_architecture(cfg: dict) -> str:
    names = list(cfg.get("architectures") or [])
    for n in names:
        if n in _HF_ARCHS:
            return _HF_ARCHS[n]
    mt = cfg.get("model_type")
    if mt in _MODEL_TYPES and not names:
        return _MODEL_TYPES[mt]
    what = names[0] if names else mt
    raise SparrowError(f"unsupported architecture {what!r}; supported: {SUPPORTED}")


def _hf_hybrid(cfg: dict, arch: str, head_dim: int, rope: dict) -> dict:
    """Qwen3.5's fields: layer kinds (layer_types, or full_attention_interval's pattern), the
    rotary dims (partial_rotary_factor of head_dim) and the Gated DeltaNet's shapes."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    types = tuple(types)
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        raise SparrowError(f"unknown layer_types entry {bad[0]!r}; known: {', '.join(LAYER_TYPES)}")
    if len(types) != n:
        raise SparrowError(f"layer_types has {len(types)} entries for {n} layers")
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2 or rotary > head_dim:
        raise SparrowError(f"partial_rotary_factor {factor} gives {rotary} rotary dims of head_dim {head_dim}")
    out = dict(
        layer_types=types,
        rotary_dim=rotary,
        linear_num_key_heads=int(cfg["linear_num_key_heads"]),
        linear_num_value_heads=int(cfg["linear_num_value_heads"]),
        linear_key_head_dim=int(cfg["linear_key_head_dim"]),
        linear_value_head_dim=int(cfg["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0) or 0),
        mtp_layers=int(cfg.get("mtp_num_hidden_layers", 0) or 0),
    )
    if out["linear_num_value_heads"] % out["linear_num_key_heads"]:
        raise SparrowError(
            f"linear_num_value_heads {out['linear_num_value_heads']} is not a multiple of "
            f"linear_num_key_heads {out['linear_num_key_heads']}"
        )
    return out


def _gguf_hybrid(get, n_layers: int, head_dim: int, nextn: int = 0) -> dict:
    """Qwen3.5's fields from llama.cpp's qwen35 keys (the converter's Mamba-style names); the
    `nextn` MTP blocks after the n_layers decoder layers have recurrent_layers entries too."""
    recurrent = get("attention.recurrent_layers")
    if recurrent is not None and nextn and len(recurrent) == n_layers + nextn:
        recurrent = recurrent[:n_layers]
    if recurrent is None:
        every = int(get("full_attention_interval", 4))
        recurrent = [(i + 1) % every != 0 for i in range(n_layers)]
    if len(recurrent) != n_layers:
        raise SparrowError(f"attention.recurrent_layers has {len(recurrent)} entries for {n_layers} layers")
    hv = int(get("ssm.time_step_rank"))
    rotary = int(get("rope.dimension_count", head_dim))
    if rotary < 2 or rotary % 2 or rotary > head_dim:
        raise SparrowError(f"rope.dimension_count {rotary} does not fit head dim {head_dim}")
    return dict(
        layer_types=tuple("linear_attention" if r else "full_attention" for r in recurrent),
        rotary_dim=rotary,
        linear_num_key_heads=int(get("ssm.group_count")),
        linear_num_value_heads=hv,
        linear_key_head_dim=int(get("ssm.state_size")),
        linear_value_head_dim=int(get("ssm.inner_size")) // hv,
        linear_conv_kernel_dim=int(get("ssm.conv_kernel", 4)),
        shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0) or 0),
        gguf_layout=True,
        mtp_layers=nextn,
    )


def _mrope_section(rope: dict | None) -> tuple[int, ...]:
    """Qwen3-VL's `mrope_section` from rope_scaling (Hub spelling) or rope_parameters (transformers 5)."""
    sec = (rope or {}).get("mrope_section") or ()
    if sec and not (rope or {}).get("mrope_interleaved", True):
        raise SparrowError("only interleaved M-RoPE (Qwen3-VL) is supported")
    return tuple(int(s) for s in sec)


def _check_rope_scaling(scaling: dict | None, max_positions: int, top_level_orig=None) -> dict | None:
    """A config's rope scaling as the Rope class takes it: rope_type set ("type" is the older
    spelling), None for plain RoPE; yarn's factor and original length filled in as transformers
    does. top_level_orig: config.json's own original_max_position_embeddings, which transformers
    prefers to the one in rope_scaling (Phi-3 configs)."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_SCALINGS:
        raise SparrowError(f"unsupported rope scaling {kind!r}; supported: {', '.join(ROPE_SCALINGS)}")
    out = {k: v for k, v in scaling.items() if k != "type"}
    out["rope_type"] = kind
    if kind != "yarn":
        return out
    # transformers: the original length defaults to max_position_embeddings, a missing factor to
    # their ratio (DeepSeek-V3's configs); llama.cpp's n_ctx_orig_yarn falls back the same way.
    orig = top_level_orig if top_level_orig is not None else out.get("original_max_position_embeddings")
    orig = _positive_int(max_positions if orig is None else orig, "yarn original_max_position_embeddings")
    factor = out.get("factor")
    out["original_max_position_embeddings"] = orig
    out["factor"] = _number(max_positions / orig if factor is None else factor, "yarn factor", 1.0, ">=")
    for key in ("attention_factor", "beta_fast", "beta_slow"):
        if out.get(key) is not None:  # transformers reads beta 0 / None as its default (32, 1)
            out[key] = _number(out[key], f"yarn {key}", 0.0, ">=" if key.startswith("beta") else ">")
    for key in ("mscale", "mscale_all_dim"):
        if out.get(key) is not None:
            out[key] = _number(out[key], f"yarn {key}", -math.inf, ">")
    if not isinstance(out.get("truncate", True), bool):
        raise SparrowError(f"yarn truncate must be true or false, got {out['truncate']!r}")
    return out


def check_rope_override(scaling) -> dict:
    """sparrow.load's rope_scaling, checked before anything loads: an HF rope_scaling dict such
    as {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, which
    replaces the model's own; {"rope_type": "default"} (or "none") turns scaling off. Stricter
    than a config: a typo in a key or a factor that scales nothing is an error."""
    if not isinstance(scaling, dict):
        raise SparrowError(
            f"rope_scaling must be a dict such as {{'rope_type': 'yarn', 'factor': 4.0}}, got {scaling!r}"
        )
    kind = scaling.get("rope_type", scaling.get("type"))
    supported = "none, " + ", ".join(ROPE_SCALINGS)
    if kind is None:
        raise SparrowError(f"rope_scaling needs a rope_type; supported: {supported}")
    if kind in ("none", "default"):
        extra = sorted(set(scaling) - {"rope_type", "type"})
        if extra:
            raise SparrowError(f"rope_scaling {kind!r} takes no other keys, got {', '.join(extra)}")
        return {"rope_type": "default"}
    if kind not in ROPE_SCALINGS:
        raise SparrowError(f"unsupported rope scaling {kind!r}; supported: {supported}")
    unknown = sorted(set(scaling) - {"rope_type", "type", *_ROPE_KEYS[kind]})
    if unknown:
        raise SparrowError(f"unknown {kind} rope_scaling key {unknown[0]!r}; known: {', '.join(_ROPE_KEYS[kind])}")
    if "factor" not in scaling:
        raise SparrowError(f"{kind} rope_scaling needs a factor (the context multiple, e.g. 4.0)")
    _number(scaling["factor"], "rope_scaling factor", 1.0, ">")
    if scaling.get("original_max_position_embeddings") is not None:
        _positive_int(scaling["original_max_position_embeddings"], "rope_scaling original_max_position_embeddings")
    return {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": kind}


def rope_scaling_from_flags(kind: str | None, scale: float | None, orig_ctx: int | None) -> dict | None:
    """The override of the llama.cpp-style flags `--rope-scaling none|linear|yarn --rope-scale F
    --yarn-orig-ctx N` (CLI, serve), or None when none is given. Without --yarn-orig-ctx, YaRN's
    original length is the model's max_position_embeddings (llama.cpp's and transformers' rule)."""
    if kind is None:
        if scale is not None or orig_ctx is not None:
            raise SparrowError("--rope-scale and --yarn-orig-ctx go with --rope-scaling linear or yarn")
        return None
    if kind == "none":
        if scale is not None or orig_ctx is not None:
            raise SparrowError("--rope-scaling none takes no --rope-scale or --yarn-orig-ctx")
        return {"rope_type": "default"}
    if kind not in ("linear", "yarn"):
        raise SparrowError(f"unsupported --rope-scaling {kind!r}; supported: none, linear, yarn")
    if scale is None:
        raise SparrowError(f"--rope-scaling {kind} needs --rope-scale (the context multiple, e.g. 4)")
    _number(scale, "--rope-scale", 1.0, ">")
    out = {"rope_type": kind, "factor": float(scale)}
    if orig_ctx is not None:
        if kind != "yarn":
            raise SparrowError("--yarn-orig-ctx goes with --rope-scaling yarn")
        out["original_max_position_embeddings"] = _positive_int(orig_ctx, "--yarn-orig-ctx")
    return out


def yarn_attention_factor(scaling: dict) -> float:
    """transformers' YaRN attention factor (_compute_yarn_parameters), by which cos and sin are
    scaled: attention_factor if set, else 0.1 ln(factor) + 1, or with mscale and mscale_all_dim
    the ratio of those two terms (DeepSeek's)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def _gguf_yarn(get, factor: float) -> dict:
    """YaRN's keys from llama.cpp's GGUF metadata, as HF rope_scaling keys. llama.cpp's converter
    writes HF's beta_fast, beta_slow and attention_factor as yarn_beta_fast, yarn_beta_slow and
    yarn_attn_factor; rope.scaling.attn_factor multiplies the attention factor (llama.cpp's
    hparams.rope_attn_factor). A missing original length falls back to context_length."""
    out = {}
    orig = get("rope.scaling.original_context_length")
    if orig is not None:
        out["original_max_position_embeddings"] = orig
    for key, name in (
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
        ("yarn_attn_factor", "attention_factor"),
    ):
        if get("rope.scaling." + key) is not None:
            out[name] = float(get("rope.scaling." + key))
    ext = get("rope.scaling.yarn_ext_factor")
    if ext is not None and float(ext) != 1.0:  # transformers' YaRN has no such knob (it is 1.0 there)
        raise SparrowError(f"unsupported YaRN yarn_ext_factor {ext} in GGUF; supported: 1.0")
    if get("rope.scaling.yarn_log_multiplier"):  # DeepSeek's mscale_all_dim; not a Qwen/Llama key
        raise SparrowError("unsupported YaRN yarn_log_multiplier in GGUF (DeepSeek's mscale_all_dim)")
    attn = get("rope.scaling.attn_factor")
    if attn is not None and float(attn) != 1.0:
        base = out.get("attention_factor", yarn_attention_factor({"factor": factor}))
        out["attention_factor"] = base * float(attn)
    return out


def _number(value, what: str, bound: float, op: str) -> float:
    """value as a float, checked finite and `op` bound (">" or ">="): one line naming `what` otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (value > bound if op == ">" else value >= bound):
        limit = "" if bound == -math.inf else f" {op} {bound:g}"
        raise SparrowError(f"{what} must be a number{limit}, got {value!r}")
    return float(value)


def _positive_int(value, what: str) -> int:
    """value as an int (an integral float, as JSON may write it, too), checked > 0."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value != int(value) or value < 1:
        raise SparrowError(f"{what} must be a positive integer, got {value!r}")
    return int(value)
