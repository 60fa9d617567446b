"""The server's `sparse_trace` field (server/sparse_trace.py): the blocks each layer and head read
per token, checked against the `--sparse-trace` machinery (api.stream's trace records), and
shown to leave the answer's tokens and logprobs unchanged to the bit."""

from __future__ import annotations

import base64
import json
import math

import httpx
import numpy as np
import pytest
from inprocess_server import serving

from sparrow.engine.runner import Runner
from sparrow.kernels.attention.select import STAGE_NAMES
from sparrow.models import fused as fused_mod
from sparrow.params import SparseParams
from sparrow.server.app import ServerState
from sparrow.server.sparse_trace import decode

FACTS = " ".join(f"The library in town {i} opens at {7 + i % 5} am and closes at {4 + i % 6} pm." for i in range(70))
MESSAGES = [{"role": "user", "content": FACTS + " When does the library in town 33 open?"}]
N = 12


@pytest.fixture(scope="module")
def base(default_llm):
    with serving(ServerState(), default_llm) as url:
        yield url


def _body(trace, stream=False, k=32, **kw):
    body = {
        "messages": MESSAGES,
        "max_tokens": N,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 3,
        "sparse_attn": True,
        "sparse_k": k,
        "stream": stream,
        **kw,
    }
    if trace is not None:
        body["sparse_trace"] = trace
    return body


def _whole(base, body) -> dict:
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(base, body, path="/v1/chat/completions") -> list[dict]:
    chunks = []
    with httpx.stream("POST", base + path, json=body, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _lps(logprobs) -> list:
    return [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]]) for e in logprobs]


@pytest.fixture(scope="module")
def traced(base):
    return _whole(base, _body(True))


def test_prompt_is_long_enough_to_select(traced):
    tr = traced["choices"][0]["sparse_trace"]
    assert math.ceil(tr["prompt_tokens"] / 32) > 32  # k=32 chooses among more blocks than it reads


def test_trace_changes_no_bits(base, traced):
    """Tokens and logprobs (floats as JSON gives them: every bit of a float32) are the same with the
    trace and without it, whole and streamed (a single stream decodes fused either way; the
    staged path's trace: test_selections_fused_and_staged_equal_the_records)."""
    plain = _whole(base, _body(None))["choices"][0]
    got = traced["choices"][0]
    assert got["message"]["content"] == plain["message"]["content"]
    assert _lps(got["logprobs"]["content"]) == _lps(plain["logprobs"]["content"])
    for trace in (True, False):
        chunks = _streamed(base, _body(trace, stream=True))
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        lps = [
            e
            for c in chunks
            if c["choices"] and c["choices"][0]["logprobs"]
            for e in c["choices"][0]["logprobs"]["content"]
        ]
        assert text == plain["message"]["content"]
        assert _lps(lps) == _lps(plain["logprobs"]["content"])


def test_trace_matches_the_sparse_trace_records(default_llm, base, traced):
    """Every step decodes to the blocks and stages api.stream's trace (the CLI's --sparse-trace)
    records for the same prompt and settings."""
    from sparrow.params import SamplingParams

    tr = traced["choices"][0]["sparse_trace"]
    ids = httpx.post(base + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert tr["prompt_tokens"] == len(ids)
    records = []
    outs = list(
        default_llm.stream(
            ids,
            sampling=SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
            sparse=SparseParams(k=32),
            trace=records,
        )
    )
    steps = tr["steps"]
    assert len(steps) == len(outs) == N
    assert [s["token"] for s in steps] == [default_llm.tokenizer.decode([o.token_id]) for o in outs]
    assert "data" not in steps[0]  # the first token comes from the prefill: nothing was selected
    assert len(records) == N - 1
    L, H = len(tr["layers"]), tr["heads"]
    assert tr["layers"] == list(range(default_llm.config.num_hidden_layers)) and H == 9
    for i, (step, rec) in enumerate(zip(steps[1:], records), start=1):
        assert step["position"] == len(ids) + i - 1 and step["blocks"] == math.ceil((step["position"] + 1) / 32)
        want = np.full((L, H, step["blocks"]), -1, np.int8)
        for layer, heads in rec:
            for h, blocks, stages, _ in heads:
                want[layer, h, blocks] = [tr["stages"].index(s) for s in stages]
        assert (decode(step, L, H) == want).all()
        assert ((want >= 0).sum(axis=2) <= 32).all()
        raw = base64.b64decode(step["data"])  # the stated bound: bitmaps plus a nibble a read block
        assert len(raw) == L * H * math.ceil(step["blocks"] / 8) + math.ceil((want >= 0).sum() / 2)


def test_header_and_streamed_steps(default_llm, base, traced):
    tr = traced["choices"][0]["sparse_trace"]
    ids = httpx.post(base + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert "".join(tr["prompt_blocks"]) == default_llm.tokenizer.decode(ids)  # ASCII: no character is cut
    assert len(tr["prompt_blocks"]) == math.ceil(len(ids) / 32)
    assert (tr["block"], tr["k"], tr["selector"]) == (32, 32, "seed")
    chunks = _streamed(base, _body(True, stream=True, logprobs=False, top_logprobs=None))
    first, rest = chunks[0]["choices"][0], [c["choices"][0].get("sparse_trace") for c in chunks[1:] if c["choices"]]
    assert first["delta"]["role"] == "assistant"
    assert first["sparse_trace"] == {k: v for k, v in tr.items() if k != "steps"}
    assert [s for s in rest if s] == tr["steps"]  # every token's step, the same as the whole answer's


def test_completions_and_errors(base):
    body = {"prompt": FACTS, "max_tokens": 3, "temperature": 0, "sparse_attn": True, "sparse_trace": True}
    r = httpx.post(base + "/v1/completions", json=body, timeout=600).json()
    assert len(r["choices"][0]["sparse_trace"]["steps"]) == 3
    chunks = _streamed(base, {**body, "stream": True}, "/v1/completions")
    assert chunks[0]["choices"][0]["text"] == "" and chunks[0]["choices"][0]["sparse_trace"]["k"] == 32
    steps = [c["choices"][0].get("sparse_trace") for c in chunks[1:] if c["choices"]]
    assert [s for s in steps if s] == r["choices"][0]["sparse_trace"]["steps"]
    bad = httpx.post(base + "/v1/chat/completions", json={"messages": MESSAGES, "sparse_trace": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sparse_trace"
    bad = httpx.post(base + "/v1/chat/completions", json={"messages": MESSAGES, "sparse_trace": "maybe"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sparse_trace"
    # one choice of one prompt, decoded plainly: n > 1, a batch and speculation are refused
    for extra, path in (
        ({"n": 2}, "/v1/chat/completions"),
        ({"speculative": "ngram"}, "/v1/chat/completions"),
        ({"prompt": [FACTS, FACTS]}, "/v1/completions"),
    ):
        req = {"messages": MESSAGES} if path.endswith("chat/completions") else {}
        bad = httpx.post(base + path, json={**req, "sparse_attn": True, "sparse_trace": True, **extra})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sparse_trace", extra


@pytest.mark.parametrize(
    "sp",
    [
        SparseParams(k=4),
        SparseParams(k=3, block=16, select="v2", dense_layers=2),
        SparseParams(k=64),  # more than the blocks: every block, stages as the selector reports them
    ],
    ids=["seed", "v2-dense2", "all-blocks"],
)
def test_selections_fused_and_staged_equal_the_records(default_llm, monkeypatch, sp):
    """The server's trace arrays (models.attention.Selections), filled by the fused step alone and
    by the staged path, hold the blocks and stages of the per-head records the CLI's trace makes
    (decode_attention's, staged), for the layers that select; the logits are the same bits."""
    monkeypatch.setattr(fused_mod, "BACKOFF_STEPS", 0)  # a busy machine must not move fused steps
    model = default_llm.model
    ids = np.asarray(default_llm.tokenizer.encode(FACTS)[:300], np.int64)
    runner = Runner(model)

    def run(mass, fused):
        model.use_fused = fused
        plan = model.fused_step()
        plan.backoff, before = 0, plan.steps
        try:
            slot = runner.new_slot(ids[:-6], len(ids), "f32", sp, trace=True, trace_mass=mass)
            runner.prefill(slot)
            logits, steps = [], []
            for t in ids[-6:]:
                logits.append(runner.decode([slot], [t])[0])
                steps.append(list(slot.trace) if mass else slot.trace.take())
                if mass:
                    slot.trace.clear()
            assert plan.steps - before == (6 if fused and not mass else 0)  # the path meant ran
            return np.stack(logits), steps
        finally:
            model.use_fused = True

    want_logits, records = run(True, False)
    layers = [i for i in range(model.config.num_hidden_layers) if sp.for_layer(i) is not None]
    for fused in (True, False):
        logits, steps = run(False, fused)
        assert logits.tobytes() == want_logits.tobytes()
        for rec, (sel, stages, nsel) in zip(records, steps):
            assert [layer for layer, _ in rec] == layers
            for layer, heads in rec:
                for h, blocks, names, _ in heads:
                    n = nsel[layer, h]
                    assert sel[layer, h, :n].tolist() == blocks, (fused, layer, h)
                    assert [STAGE_NAMES[c] for c in stages[layer, h, :n]] == names, (fused, layer, h)
