"""`GET /tokenizer_info` as vLLM serves it: what a client needs to use the server's tokenizer
through `/tokenize` and `/detokenize` instead of downloading one (lm-evaluation-harness's
`local-completions` model detects the three endpoints and then scores loglikelihood tasks
offline with no tokenizer files).

vLLM answers its tokenizer's `tokenizer_class` and init settings; here the same names are
filled from the model's own tokenizer (GGUF metadata or the folder's tokenizer files).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from ..chat_template import CHATML_TEMPLATE
from .schema import ERRORS


class TokenizerInfo(BaseModel):
    """vLLM's TokenizerInfoResponse: its named fields, and the tokenizer's settings beside them."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None = None
    chat_template: str = Field(description="the Jinja chat template the server renders conversations with")
    model_max_length: int = Field(description="the served context length")
    add_bos_token: bool
    add_eos_token: bool = False
    eos_token_ids: list[int] = Field(description="every id that ends a turn (sparrow's)")
    vocab_size: int
    added_tokens_decoder: dict[str, dict[str, Any]] = Field(description="special tokens by id, as transformers saves")


def info(llm) -> dict:
    tok = llm.tokenizer

    def text(i):
        return tok.id_to_token(i) if i is not None else None

    eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
    added = {
        str(i): {"content": tok.id_to_token(i), "special": True, "lstrip": False, "rstrip": False,
                 "normalized": False, "single_word": False}
        for i in sorted(tok._special_ids)
        if tok.id_to_token(i) is not None
    }  # fmt: skip
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text(tok.bos_token_id),
        "eos_token": text(eos),
        "pad_token": None,  # sparrow pads nothing; clients that need one use eos, as for most causal LMs
        "unk_token": None,
        "chat_template": tok.chat_template or CHATML_TEMPLATE,
        "model_max_length": llm.ctx,
        "add_bos_token": tok.add_bos,
        "add_eos_token": False,
        "eos_token_ids": list(tok.eos_token_ids),
        "vocab_size": tok.vocab_size,
        "added_tokens_decoder": added,
    }


def add_routes(app: FastAPI, state) -> None:
    @app.get("/tokenizer_info", response_model=None, responses={200: {"model": TokenizerInfo}, **ERRORS})
    async def tokenizer_info(request: Request):
        """The served model's tokenizer settings (vLLM's endpoint), for /tokenize and /detokenize."""
        state.require_ready()
        return info(state.llm)
