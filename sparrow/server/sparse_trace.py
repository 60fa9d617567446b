"""The `sparse_trace` response field: which KV blocks each layer and head read for each token.

Opt-in per request (`"sparse_trace": true` with `"sparse_attn": true`). A header goes first (in
the stream's first chunk, or the whole answer's choice): the block size, the selector, the
traced layers (by their index in the model: a hybrid model's full-attention layers), the heads,
the stage names and the text of each prompt block, so that a client
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

Cost: a traced step decodes as an untraced one does (the fused step when the request runs
alone, the staged path beside others), and the kernels write its selections to arrays
(models.attention.Selections) that `step` packs with numpy alone. The server's CPU time per
token with the field, against without it (`sparrow bench sparse-trace`, side by side): +2.5%
on a quiet 2-CPU Xeon at k=32 after a 2,049-token prompt, about 1.5% of it the streaming
threads' packing (docs/benchmarks/xeon-amx-m167.md).
"""

from __future__ import annotations

import base64

import numpy as np

from ..kernels.attention.select import STAGE_NAMES


def header(llm, sparse, prompt_ids) -> dict:
    """The fields a client needs before the first step."""
    cfg = llm.config
    bs = sparse.block
    # the layers that select: KV layers (a hybrid model's full-attention ones) past v2 / v3's
    # exact first ones, named by their index in the model
    full = cfg.full_attention_layers
    kv = [j for j in range(len(full)) if sparse.for_layer(j) is not None]
    ids = [int(t) for t in prompt_ids]
    texts = [llm.tokenizer.decode(ids[a : a + bs]) for a in range(0, len(ids), bs)]
    return {
        "block": bs,
        "k": sparse.k,
        "p": sparse.p,  # v3's top-p budget (None: k blocks a head); each head's count is its bitmap's bits
        "selector": sparse.label,
        "layers": [full[j] for j in kv],
        "kv_layers": kv,  # the same layers by their index among the KV layers (the trace arrays' rows)
        "heads": cfg.num_attention_heads,
        "stages": list(STAGE_NAMES),
        "prompt_tokens": len(ids),
        "prompt_blocks": texts,
    }


def step(tokenizer, out, position: int, layers: np.ndarray, block: int) -> dict:
    """One generated token's entry; out: a StepOutput whose trace holds its decode step's
    selections as models.attention.Selections' arrays (None for the first token)."""
    entry = {"token": tokenizer.decode([out.token_id])}
    if out.trace is None:
        return entry
    n = -(-(position + 1) // block)
    sel, stages, nsel = (a[layers] for a in out.trace)  # [T, H, n], [T, H, n], [T, H]: the traced layers
    if sel.shape[2] != n:
        raise ValueError(f"a trace step of {sel.shape[2]} blocks at position {position} (block {block})")
    taken = np.arange(n) < nsel[..., None]  # [T, H, n]: each row's first nsel entries
    rows = np.broadcast_to(np.arange(nsel.size).reshape(nsel.shape + (1,)), taken.shape)
    read = np.zeros((nsel.size, n), np.bool_)  # [rows, n]
    read[rows[taken], sel[taken]] = True
    bitmaps = np.packbits(read, axis=1, bitorder="little")  # [rows, ceil(n / 8)]
    nib = stages[taken].astype(np.uint8)  # row-major, each row's blocks ascending (as sel lists them)
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
        self.layers = np.asarray(self.header.pop("kv_layers"), np.int64)
        self.position = len(prompt_ids) - 1  # the query that chose the next token's blocks

    def step(self, out) -> dict:
        entry = step(self.tokenizer, out, self.position, self.layers, self.header["block"])
        self.position += 1
        return entry
