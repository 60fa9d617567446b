"""One generation request, as every front door (the command line, the Python API, the server)
hands it to the engine, and the one place each kind of option is parsed and merged.

Each edge builds a `GenerationRequest` once, from its own spelling of the options (argparse
flags, `LLM.stream` keywords, a JSON body), through `sampling_and_sparse` and
`speculative_params`; the engine (engine/engine.py) and `LLM.stream` take it as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import SparrowError
from .params import (
    SAMPLING_OPTIONS,
    SPARSE_OPTIONS,
    SamplingParams,
    SparseParams,
    SpeculativeParams,
    options_to_params,
)


@dataclass(frozen=True)
class GenerationRequest:
    """A prompt's token ids (image pads expanded) and every setting of its generation."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    sparse: SparseParams | None = None  # None: exact attention
    speculative: SpeculativeParams | None = None  # None: plain decoding
    kv_dtype: str | None = None  # None: the model's default
    constraints: list | None = None  # structured output: one grammar state per choice (n of them), or None
    images: list = field(default_factory=list)  # the prompt's preprocessed images (vision.preprocess.PixelImage)
    n: int = 1  # choices of the prompt, sharing its prefill; choice i samples with seed + i
    prompt_logprobs: int | None = None  # report each prompt token's logprob, with this many alternatives
    score_only: bool = False  # generate nothing: prefill (for prompt_logprobs) and finish
    trace: bool = False  # sparse decode: each output carries its step's block selections
    timeout: float | None = None  # seconds (None: the engine's default)
    # Prefix-cache hook for inputs that are not token ids (images): a salt naming them (e.g. a hash
    # of their bytes) so only requests with the same inputs share KV; cacheable=False opts out.
    cache_salt: str | None = None
    cacheable: bool = True

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", list(self.prompt_ids))  # a list of its own
        if self.constraints is not None and len(self.constraints) != self.n:
            raise ValueError(f"{self.n} choices but {len(self.constraints)} grammar states")

    @property
    def traced(self) -> bool:
        """Whether its outputs carry sparse selections (a trace of exact attention has none)."""
        return self.trace and self.sparse is not None


def sampling_and_sparse(
    options: Mapping, sampling: SamplingParams | None = None, sparse: SparseParams | None = None
) -> tuple[SamplingParams, SparseParams | None]:
    """The sampling and sparse settings from flat options (SamplingParams fields and the
    sparse_* names: `LLM` keywords, the command line's flags) or from the objects, validated.
    Objects win, keywords are the convenience; giving both for one kind is an error, and so is
    an unknown name."""
    kw_sampling, kw_sparse = options_to_params(dict(options))
    if sampling is not None and any(k in SAMPLING_OPTIONS for k in options):
        raise SparrowError("pass sampling settings as `sampling=SamplingParams(...)` or as keywords, not both")
    if sparse is not None and any(k in SPARSE_OPTIONS for k in options):
        raise SparrowError("pass sparse settings as `sparse=SparseParams(...)` or as sparse_* keywords, not both")
    return (sampling or kw_sampling).validate(), sparse or kw_sparse


def speculative_params(
    speculative: SpeculativeParams | str | None = None,
    options: Mapping | None = None,
    *,
    default: SpeculativeParams | None = None,
    draft_model: str | None = None,
    lenient: bool = False,
) -> SpeculativeParams | None:
    """The one merge of speculative settings -> SpeculativeParams, or None (plain decoding).

    speculative: the object (taken as it is: then `options` must be empty), a method name, or
    None. options: the flat spec_* names (and draft_model) the caller set. draft_model: the
    draft model's path.

    lenient (a server's request): `options` is the request's own (None: it said nothing, and
    `default`, the server's --speculative, applies); the method "none" turns speculation off; a
    request naming the default's method takes its unset spec_* from it; a spec_* setting the
    method does not use is ignored, as sparse_k is without sparse_attn; draft_model is the draft
    model the server holds, which only the method 'draft' uses."""
    if isinstance(speculative, SpeculativeParams):
        if options:
            raise SparrowError(
                "pass speculative settings as `speculative=SpeculativeParams(...)` or as keywords, not both"
            )
        return speculative
    if not lenient:
        options = dict(options or {})
        if draft_model is not None:
            options["draft_model"] = draft_model
        return SpeculativeParams.from_options(speculative, **options)
    if options is None:
        return default
    method = speculative or (default.method if default is not None else None)
    if method in (None, "none"):
        return None
    if method == "draft" and draft_model is None:
        raise SparrowError("this server has no draft model (start it with --draft-model PATH)")
    base = default if default is not None and default.method == method else None
    sp = base.sparse if base is not None else None
    return SpeculativeParams.from_options(
        method,
        options.get("spec_tokens", base.tokens if base else 4),
        options.get("spec_ngram", base.ngram if base else 3),
        draft_model if method == "draft" else None,
        options.get("spec_sparse_k", sp.k if sp else None) if method == "sparse" else None,
        options.get("spec_sparse_select", sp.select if sp else None) if method == "sparse" else None,
    )


SPEC_FLAGS = ("spec_tokens", "spec_ngram", "spec_sparse_k", "spec_sparse_select")  # the spec_* tunings
SAMPLING_FLAGS = (  # the SamplingParams fields the command line sets
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
)


def speculative_from_flags(a, serve: bool = False) -> SpeculativeParams | None:
    """The command line's --speculative and spec_* flags (an argparse namespace) -> settings.
    serve: the default of a server's requests that do not say (none without --speculative);
    its --draft-model is held for requests that ask for 'draft' whatever the default."""
    method = getattr(a, "speculative", None)
    if serve and method is None:
        return None
    draft = getattr(a, "draft_model", None) if method == "draft" or not serve else None
    return speculative_params(method, {k: getattr(a, k) for k in SPEC_FLAGS}, draft_model=draft)


def sampling_from_flags(a) -> tuple[SamplingParams, SparseParams | None]:
    """The command line's sampling and sparse flags (an argparse namespace) -> settings, parsed
    as `LLM` keywords are (sampling_and_sparse)."""
    options = {k: getattr(a, k) for k in (*SAMPLING_FLAGS, *SPARSE_OPTIONS)}
    options["stop"] = options["stop"] or []
    return sampling_and_sparse(options)
