"""Model configuration: one dataclass, built from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import SparrowError

# HF `architectures[0]` / `model_type` and GGUF `general.architecture` -> sparrow family name.
_HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}
_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "qwen3vl": "qwen3"}
SUPPORTED = "llama, qwen2, qwen3, qwen3_moe"


@dataclass
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", ...} or None
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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, i: int) -> bool:
        """Whether layer i uses the MoE block (transformers' Qwen3-MoE rule)."""
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % max(1, self.decoder_sparse_step) == 0

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
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0)) if arch == "qwen3_moe" else 0
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 0)),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=_check_rope_scaling(scaling),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            num_experts=int(num_experts or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            mrope_section=_mrope_section(scaling or rope),
        )

    @classmethod
    def from_gguf(cls, meta: dict, tensor_names: set[str], vocab_size: int) -> ModelConfig:
        """meta: GGUF key -> python value; tensor_names: GGUF tensor names present."""
        garch = meta.get("general.architecture")
        arch = _GGUF_ARCHS.get(garch)
        if arch is None:
            raise SparrowError(
                f"unsupported architecture {garch!r} in GGUF; supported: llama, qwen2, qwen3, qwen3moe, qwen3vl"
            )
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
        return cls(
            architecture=arch,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", 0) or 0),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(get("attention.key_length", hidden // heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=_check_rope_scaling(scaling),
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            num_experts=int(get("expert_count", 0) or 0),
            num_experts_per_tok=int(get("expert_used_count", 0) or 0),
            moe_intermediate_size=int(get("expert_feed_forward_length", 0) or 0),
            # llama.cpp's qwen3moe always renormalises the top-k weights.
            norm_topk_prob=arch == "qwen3_moe",
            mrope_section=tuple(int(s) for s in get("rope.dimension_sections", ()))[:3] if garch == "qwen3vl" else (),
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


def _mrope_section(rope: dict | None) -> tuple[int, ...]:
    """Qwen3-VL's `mrope_section` from rope_scaling (Hub spelling) or rope_parameters (transformers 5)."""
    sec = (rope or {}).get("mrope_section") or ()
    if sec and not (rope or {}).get("mrope_interleaved", True):
        raise SparrowError("only interleaved M-RoPE (Qwen3-VL) is supported")
    return tuple(int(s) for s in sec)


def _check_rope_scaling(scaling: dict | None) -> dict | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise SparrowError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
    return dict(scaling, rope_type=kind)
