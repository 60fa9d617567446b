"""The `sparse_trace` response field: which KV blocks each layer and head read for each token.

Opt-in per request (`"sparse_trace": true` with `"sparse_attn": true`). A header goes first (in
the stream's first chunk, or the whole answer's choice): the block size, the selector, the
traced layers, the heads, the stage names and the text of each prompt block, so that a client
can show what a block holds without tokenizing. Then one step per generated token:

    {"token": "text of this token", "position": p, "blocks": n, "data": "<base64>"}

`position` is the cache position whose query chose the blocks (the token before this one) and
`blocks` = ceil((p + 1) / block) the blocks it chose among. The first token comes from the
prefill, which selects nothing: its step has only `token`. `data` holds, for every traced
layer (in `layers` order) and every head 0..heads-1, row by row:
1. all rows' bitmaps first: ceil(blocks / 8) bytes a row, bit b % 8 of byte b // 8 (least
   significant first) set when block b was read;
2. then one stream of 4-bit stage codes (low nibble first), one for each set bit in row and
   block order: the index into `stages` of the rule that chose the block.

So a step holds at most rows x (ceil(blocks / 8) + k / 2) bytes before base64 (4/3 after it).
"""

from __future__ import annotations

import base64

import numpy as np

from ..kernels.attention.select import STAGE_NAMES

_CODE = {name: i for i, name in enumerate(STAGE_NAMES)}


def header(llm, sparse, prompt_ids) -> dict:
    """The fields a client needs before the first step."""
    cfg = llm.config
    bs = sparse.block
    layers = [i for i in range(cfg.num_hidden_layers) if sparse.for_layer(i) is not None]  # v2: early layers exact
    ids = [int(t) for t in prompt_ids]
    texts = [llm.tokenizer.decode(ids[a : a + bs]) for a in range(0, len(ids), bs)]
    return {
        "block": bs,
        "k": sparse.k,
        "selector": sparse.label,
        "layers": layers,
        "heads": cfg.num_attention_heads,
        "stages": list(STAGE_NAMES),
        "prompt_tokens": len(ids),
        "prompt_blocks": texts,
    }


def step(tokenizer, out, position: int, layers: list[int], heads: int, block: int) -> dict:
    """One generated token's entry; out: a StepOutput whose trace holds its decode step's
    selections [(layer, [(head, blocks, stages, mass)])] (None for the first token)."""
    entry = {"token": tokenizer.decode([out.token_id])}
    if not out.trace:
        return entry
    n = -(-(position + 1) // block)
    row = {layer: i for i, layer in enumerate(layers)}
    codes = np.full((len(layers), heads, n), -1, np.int8)  # -1: not read
    for layer, recs in out.trace:
        for h, blocks, stages, _ in recs:
            codes[row[layer], h, blocks] = [_CODE[s] for s in stages]
    codes = codes.reshape(-1, n)  # [rows, n]
    read = codes >= 0
    bitmaps = np.packbits(read, axis=1, bitorder="little")  # [rows, ceil(n / 8)]
    nib = codes[read].astype(np.uint8)  # row-major: each row's read blocks in ascending order
    if len(nib) % 2:
        nib = np.append(nib, np.uint8(0))
    packed = nib[0::2] | (nib[1::2] << 4)
    data = base64.b64encode(bitmaps.tobytes() + packed.tobytes()).decode("ascii")
    entry.update(position=position, blocks=n, data=data)
    return entry


def decode(entry: dict, n_layers: int, heads: int) -> np.ndarray:
    """A step's data back as stage codes [layers, heads, blocks] (-1: not read): the format's
    reference reader (the web page has its own, in app.js)."""
    n = entry["blocks"]
    raw = np.frombuffer(base64.b64decode(entry["data"]), np.uint8)
    rows, nb8 = n_layers * heads, -(-n // 8)
    read = np.unpackbits(raw[: rows * nb8].reshape(rows, nb8), axis=1, bitorder="little")[:, :n].astype(bool)
    packed = raw[rows * nb8 :]
    nib = np.stack([packed & 15, packed >> 4], axis=1).reshape(-1)[: int(read.sum())]
    codes = np.full((rows, n), -1, np.int8)
    codes[read] = nib
    return codes.reshape(n_layers, heads, n)


class Tracer:
    """One traced request: its header, and its steps in order."""

    def __init__(self, llm, sparse, prompt_ids):
        self.header = header(llm, sparse, prompt_ids)
        self.tokenizer = llm.tokenizer
        self.position = len(prompt_ids) - 1  # the query that chose the next token's blocks

    def step(self, out) -> dict:
        h = self.header
        entry = step(self.tokenizer, out, self.position, h["layers"], h["heads"], h["block"])
        self.position += 1
        return entry
