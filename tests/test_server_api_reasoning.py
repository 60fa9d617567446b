"""Qwen3-style reasoning through the new APIs (issue 69): a tiny GGUF whose template opens
`<think>` in the generation prompt, so the answer is reasoning until `</think>` (a logit bias
makes the model write it after a few tokens). The chat endpoint's reasoning_content and content
come back as Anthropic `thinking` and `text` blocks and as a Responses `reasoning` item and
`message`, whole and streamed, through the official SDKs."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from test_fuzz_files import CHATML

import reference_models as rm
import sparrow
from sparrow.server.app import ServerState

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

THINKING = CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")
ASK = [{"role": "user", "content": "the heat"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import torch
    from inprocess_server import serving
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from sparrow.tokenizer import BYTE_DECODER

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**dict(rm.TINY_SPECS["qwen3"], vocab_size=384))).float().eval()
    letters = "etaoinshr"
    merges = [f"{a} {b}" for a in letters for b in letters]
    tokens = sorted(BYTE_DECODER, key=BYTE_DECODER.get) + [m.replace(" ", "") for m in merges]
    tokens += ["<think>", "</think>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    meta = dict(tokens=tokens, token_type=[1] * (len(tokens) - 5) + [4, 4, 3, 3, 3], merges=merges,
                bos=len(tokens) - 1, eos=len(tokens) - 2, chat_template=THINKING)  # fmt: skip
    path = str(tmp_path_factory.mktemp("thinking") / "tiny.gguf")
    rm.write_gguf(model, "qwen3", path, "F16", meta)
    llm = sparrow.load(path, ctx=1024)
    with serving(ServerState(), llm, timeout=120) as base:
        yield base, llm.tokenizer.token_to_id("</think>")


@pytest.fixture(scope="module")
def answer(served):
    """A bias on </think> that gives an answer with both reasoning and content, and that answer."""
    base, close = served
    for bias in np.arange(1.0, 20.0, 0.5):
        body = {"messages": ASK, "max_tokens": 12, "temperature": 0, "logit_bias": {str(close): float(bias)}}
        msg = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
        if msg.get("reasoning_content") and msg.get("content"):
            return body["logit_bias"], msg["reasoning_content"], msg["content"]
    pytest.fail("no bias gave reasoning and content")


def test_anthropic_thinking_blocks(served, answer):
    base, _ = served
    bias, reasoning, content = answer
    client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    extra = {"temperature": 0, "logit_bias": bias}
    m = client.messages.create(model="tiny", max_tokens=12, messages=ASK, extra_body=extra)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == reasoning and m.content[1].text == content
    with client.messages.stream(model="tiny", max_tokens=12, messages=ASK, extra_body=extra) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", reasoning),
        ("text", content),
    ]
    assert "content_block_start" in kinds and kinds[-1] == "message_stop"
    # thinking blocks go back as the assistant's reasoning: the same prompt as the chat endpoint's
    follow = ASK + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                    {"role": "user", "content": "more"}]  # fmt: skip
    n = client.messages.count_tokens(model="tiny", messages=follow).input_tokens
    chat = ASK + [{"role": "assistant", "content": content, "reasoning_content": reasoning},
                  {"role": "user", "content": "more"}]  # fmt: skip
    assert n == httpx.post(base + "/tokenize", json={"messages": chat}).json()["count"]


def test_responses_reasoning_item(served, answer):
    base, _ = served
    bias, reasoning, content = answer
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    kw = {"model": "tiny", "input": ASK, "max_output_tokens": 12, "temperature": 0, "extra_body": {"logit_bias": bias}}
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == reasoning and r.output_text == content
    events = list(client.responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == content
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == ["reasoning", "message"]
    last = events[-1].response
    assert [o.type for o in last.output] == ["reasoning", "message"] and last.output_text == content
