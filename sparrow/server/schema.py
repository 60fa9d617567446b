"""The HTTP API's published schema: pydantic models of every request and response body.

FastAPI validates request bodies against these models and publishes them at /openapi.json and
/docs. Types are strict (no "1" -> 1 or true -> 1 coercion, no NaN) so a wrong type is a 400
naming the field; unknown fields are ignored, as permissive OpenAI-compatible servers do. Checks
that need more than a type (a tool name that matches no tool, a JSON schema sparrow cannot
compile) are made where the request is turned into a GenRequest (protocol.py, sparrow.structured).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, NonNegativeInt, Tag, field_validator, model_validator

from ..params import KV_DTYPES, MAX_SPEC_TOKENS, REPETITION_PENALTY, SELECTORS, SPARSE_ATTN, SPECULATIVE_METHODS

KVDType = Literal[KV_DTYPES]  # type: ignore[valid-type]
Selector = Literal[SELECTORS]  # type: ignore[valid-type]
SparseMode = Literal[SPARSE_ATTN]  # type: ignore[valid-type]
SpecMethod = Literal[(*SPECULATIVE_METHODS, "none")]  # type: ignore[valid-type]


def _integral(v):
    # JSON Schema's "integer" includes 2.0, and so does this API (2.5, "2" and true stay errors);
    # an int is also a valid number, so float fields are unaffected
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
        return int(v)
    return [_integral(x) for x in v] if isinstance(v, list) else v


INT_LIMIT = 2**63  # integers are int64 from here on (numba, numpy); a larger one is a 400, not a 500


def _check_values(v) -> None:
    """Raises ValueError for what no field may hold, however deep in lists and free-form objects:
    a lone UTF-16 surrogate (JSON "\\ud800" decodes to one; it has no UTF-8 form, so the
    tokenizer and the JSON encoder would fail on it) and an integer outside int64. Models nested
    in v were checked by their own validators, so their errors name their own fields."""
    if isinstance(v, str):
        if _SURROGATE.search(v):
            raise ValueError("text may not hold a lone UTF-16 surrogate (U+D800-U+DFFF)")
    elif isinstance(v, int) and not isinstance(v, bool):
        if not -INT_LIMIT <= v < INT_LIMIT:
            raise ValueError("integer out of range: must fit in 64 bits (-2^63 to 2^63-1)")
    elif isinstance(v, (list, tuple)):
        for x in v:
            _check_values(x)
    elif isinstance(v, dict):
        for k, x in v.items():
            _check_values(k)
            _check_values(x)


_SURROGATE = re.compile("[\ud800-\udfff]")


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    @field_validator("*", mode="before")
    @classmethod
    def _integral(cls, v):
        return _integral(v)

    @field_validator("*", mode="after")
    @classmethod
    def _representable(cls, v):
        _check_values(v)
        return v

    @model_validator(mode="after")
    def _extras_representable(self):
        _check_values(self.__pydantic_extra__ or {})  # the extra keys an _Open model keeps
        return self


class _Open(_Model):
    """Passed on as given (to the chat template or the grammar compiler): extra keys are kept."""

    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------------- chat messages
class TextPart(_Model):
    type: Literal["text"] = "text"
    text: str


class ImageURL(_Open):
    url: str = Field(description="a data: URL of the image (base64); file:// where the server allows a local path")
    detail: str | None = None

    @field_validator("url")
    @classmethod
    def _no_nul(cls, v: str) -> str:
        if "\x00" in v:  # no path can hold one (the OS would refuse it with an error of its own)
            raise ValueError("the URL may not hold a NUL character")
        return v


class ImageURLPart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL


class ImagePart(_Open):
    """An image part in the shape some clients send ({"type": "image", "image": ...})."""

    type: Literal["image"]


_PART_TAGS = {"text": "TextPart", "image_url": "ImageURLPart", "image": "ImagePart"}


def _part_kind(v) -> str | None:
    # the part's "type" picks the one model to check it against, so an error names that model's field
    kind = v.get("type", "text") if isinstance(v, dict) else getattr(v, "type", None)
    return _PART_TAGS.get(kind) if isinstance(kind, str) else None


def _content_kind(v) -> str | None:
    return "string" if isinstance(v, str) else "parts" if isinstance(v, list) else None


ContentPart = Annotated[
    Annotated[TextPart, Tag("TextPart")]
    | Annotated[ImageURLPart, Tag("ImageURLPart")]
    | Annotated[ImagePart, Tag("ImagePart")],
    Discriminator(
        _part_kind,
        custom_error_type="content_part",
        custom_error_message="a part must be {'type': 'text', 'text': ...} "
        "or {'type': 'image_url', 'image_url': {'url': ...}}",
    ),
]
Content = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[ContentPart], Tag("parts")],
    Discriminator(
        _content_kind, custom_error_type="content", custom_error_message="must be a string or a list of parts"
    ),
]


class FunctionCall(_Model):
    name: str
    arguments: str | dict[str, Any] = Field("{}", description="JSON text (an object is accepted too)")


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    # documents what protocol.py checks: only an assistant message may leave out its content
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"properties": {"role": {"const": "assistant"}}},
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
            ]
        }
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = Field(None, description="text, or a list of parts; only an assistant message may omit it")
    name: str | None = None
    reasoning_content: str | None = Field(None, description="an assistant's earlier reasoning (Qwen3 templates)")
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


# ---------------------------------------------------------------------- tools and formats
class FunctionDef(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class JSONSchemaFormat(_Open):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(_Model):
    include_usage: bool | None = None


# ---------------------------------------------------------------------- requests
def _refused(when: str):
    """A field of OpenAI's request that sparrow does not apply: declared so that sending it is a 400
    naming it (protocol.py, REFUSED), never a 200 that silently ignored it."""
    return Field(None, description=f"not supported: 400 {when}")


def _no_effect(what: str):
    """A field of OpenAI's request that cannot change the answer here: accepted and ignored."""
    return Field(None, description=f"accepted, no effect ({what})")


class _Sampling(_Model):
    """Fields shared by chat and text completions. None means the model's generation_config value
    (temperature, top_p, top_k, min_p, repetition_penalty), else OpenAI's default."""

    model: str | None = None
    n: int | None = Field(
        None,
        ge=1,
        le=128,
        description="choices per prompt, sharing its prefill; with a seed, choice i samples with seed + i",
    )
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0, description="0: greedy")
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY[0], le=REPETITION_PENALTY[1])
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="token id (a decimal string) -> a bias in [-100, 100] added to its logit"
    )
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: str | list[str] | None = Field(None, description="at most 16 stop strings")
    ignore_eos: bool | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    sparse_attn: bool | SparseMode | None = Field(
        None,
        description="sparse decode attention for this request: true / 'on', false / 'off', or 'auto' (v3 on "
        "4-bit key codes with a top-p budget past the context where sparse decode pays on this CPU); default 'off'",
    )
    sparse_k: int | None = Field(None, ge=1)
    sparse_block: int | None = Field(None, ge=1)
    sparse_probe: int | None = Field(None, ge=1)
    sparse_prefill: bool | None = None
    sparse_select: Selector | None = Field(
        None, description="block selector: seed (the default of 'on'), v2 or v3 (auto's)"
    )
    sparse_p: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="v3: per head and step, blocks in order of estimated mass until they hold this share of it, "
        "at most sparse_k (default: always sparse_k blocks)",
    )
    sparse_min_blocks: int | None = Field(None, ge=1, description="v3 with sparse_p: at least this many blocks")
    sparse_dense_layers: int | None = Field(
        None, ge=0, description="v2 / v3: the first layers with a KV cache decode exact (default 2)"
    )
    sparse_key_bits: Literal[8, 4] | None = Field(
        None, description="v3: score keys by int8 codes (8, the default) or 4-bit ones (half the bytes a key)"
    )
    kv_dtype: KVDType | None = Field(None, description="KV cache type for this request (default: the server's)")
    speculative: SpecMethod | None = Field(
        None,
        description="speculative decoding (same tokens and logits as without it): ngram, draft (the server's "
        "--draft-model), sparse, mtp (the model's own draft layer: Qwen3.5), or none; "
        "default: the server's --speculative",
    )
    spec_tokens: int | None = Field(None, ge=1, le=MAX_SPEC_TOKENS, description="most tokens drafted per step")
    spec_ngram: int | None = Field(None, ge=1, le=64, description="ngram: longest suffix looked up")
    spec_sparse_k: int | None = Field(None, ge=1, description="sparse drafting: blocks per head (default 8)")
    spec_sparse_select: Selector | None = Field(None, description="sparse drafting: block selector")
    sparse_trace: bool | None = Field(
        None,
        description="with sparse_attn: return which KV blocks each layer and head read for each token "
        "(choices[0].sparse_trace; README: Web UI)",
    )
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: Any = _no_effect("an end-user id for OpenAI's abuse monitoring")


MAX_MESSAGES = 32768  # a conversation's messages (each costs a template at least a token: no context holds more)


def _few_messages(v):
    # before pydantic builds a model per message (220,000 of them in an 8 MB body took ~3 s)
    if isinstance(v, list) and len(v) > MAX_MESSAGES:
        raise ValueError(f"at most {MAX_MESSAGES} messages, got {len(v)}")
    return v


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1, description=f"at most {MAX_MESSAGES}")

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded(cls, v):
        return _few_messages(v)

    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat template")
    functions: Any = _refused("unless null (deprecated: use tools)")
    function_call: Any = _refused("unless null (deprecated: use tool_choice)")
    audio: Any = _refused("unless null (text models)")
    modalities: Any = _refused('unless null or ["text"]')
    reasoning_effort: Any = _refused("unless null (Qwen3: chat_template_kwargs enable_thinking)")
    verbosity: Any = _refused("unless null")
    web_search_options: Any = _refused("unless null (no network)")
    moderation: Any = _refused("unless null or false")
    store: Any = _refused("unless null or false (nothing is stored)")
    metadata: Any = _no_effect("tags for stored completions")
    service_tier: Any = _no_effect("one tier here")
    prediction: Any = _no_effect("a latency hint; the answer is the same without it")
    prompt_cache_key: Any = _no_effect("the prefix cache matches prompts by their tokens")
    prompt_cache_retention: Any = _no_effect("the prefix cache keeps entries by LRU")
    prompt_cache_options: Any = _no_effect("the prefix cache keeps entries by LRU")
    safety_identifier: Any = _no_effect("an end-user id for OpenAI's abuse monitoring")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string or token ids, or a batch of either: choice index = prompt index * n + choice"
    )
    max_tokens: int | None = Field(
        None, ge=0, description="default 16 (OpenAI's); 0 answers an empty text, finish_reason length"
    )
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = Field(
        None, description="each choice's text starts with its prompt; with logprobs, the prompt tokens' first"
    )
    best_of: Any = _refused("unless null or 1")
    suffix: Any = _refused('unless null or ""')


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[Message] | None = Field(None, min_length=1, description=f"at most {MAX_MESSAGES}")

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded(cls, v):
        return _few_messages(v)

    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------- responses (documentation)
class CacheSaved(BaseModel):
    object: Literal["cache.save"] = "cache.save"
    prompt_tokens: int
    saved_tokens: int = Field(description="positions now in the --prompt-cache folder: whole 512-token chunks")


class CacheCleared(BaseModel):
    object: Literal["cache.cleared"] = "cache.cleared"
    entries: int = Field(description="prefix-cache entries dropped from memory")
    files: int = Field(description="this model's files deleted from the --prompt-cache folder")


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = Field(description="speculative decoding: drafted tokens the model sampled too")
    rejected_prediction_tokens: int = Field(description="speculative decoding: drafted tokens it did not")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="with speculative decoding only"
    )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = Field(None, description="always null: sparrow never refuses")


class AssistantToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: None = Field(None, description="always null: sparrow never refuses")
    reasoning_content: str | None = None
    tool_calls: list[AssistantToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletion(BaseModel):
    """The answer; with "stream": true, server-sent `chat.completion.chunk` events instead."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for the first token of an echoed prompt")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    """The answer; with "stream": true, server-sent `text_completion` events instead."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    activations: Literal["f32", "q8"]  # sparrow's: the activations mode the model runs
    activations_why: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, for every 4xx and 5xx."""

    error: ErrorDetail


ERRORS = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in (
        (400, "invalid request: `param` names the field"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "request body too large"),
        (503, "the model is still loading"),
    )
}


def openapi(app) -> dict:
    """FastAPI's schema, less the 422 responses it adds to every body: sparrow answers 400."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in spec.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            spec.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = spec
    return app.openapi_schema
