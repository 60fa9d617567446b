"""vLLM's tokenizer endpoints (issue 69, item 3): `GET /tokenizer_info`, `/tokenize` (its shape kept)
and `/detokenize`, and lm-evaluation-harness's `local-completions` model using them as its
tokenizer offline: it detects them, and scores a loglikelihood task and a generation task with
no tokenizer files and no network (HF_HUB_OFFLINE)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from test_fuzz_files import tiny_gguf  # noqa: F401 - the fixture, shared
from test_openapi import error, post, served  # noqa: F401 - served: the fixture, shared

CTX = 1024
TASKS = Path(__file__).parent / "data" / "lm_eval"


def test_tokenizer_info_has_vllms_fields(served):  # noqa: F811
    r = httpx.get(served + "/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert {"tokenizer_class", "eos_token", "bos_token", "pad_token", "chat_template"} <= set(info)
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|endoftext|>"
    assert info["pad_token"] is None and info["model_max_length"] == CTX
    assert "<|im_start|>" in info["chat_template"]
    eos = post(served, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"] == info["eos_token_ids"][:1] and eos["count"] == 1 and eos["max_model_len"] == CTX
    assert info["added_tokens_decoder"][str(eos["tokens"][0])]["content"] == "<|im_end|>"
    ops = httpx.get(served + "/openapi.json").json()["paths"]
    assert "get" in ops["/tokenizer_info"]


def test_tokenize_detokenize_round_trip(served):  # noqa: F811
    text = "the heat is on"
    t = post(served, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert set(t) == {"count", "max_model_len", "tokens"} and t["count"] == len(t["tokens"])
    d = post(served, "/detokenize", {"tokens": t["tokens"]})
    assert d.status_code == 200 and d.json() == {"prompt": text}
    err = error(post(served, "/detokenize", {"tokens": [10**6]}))
    assert err["param"] == "tokens"
    err = error(post(served, "/detokenize", {"tokens": "abc"}))
    assert err["param"] == "tokens"


def test_lm_eval_remote_tokenizer(served):  # noqa: F811
    utils = pytest.importorskip("lm_eval.utils")
    url = served + "/v1/completions"
    assert utils.check_remote_tokenizer_support(url)
    tok = utils.RemoteTokenizer(url)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == tok.encode("<|im_end|>")[0]
    ids = tok.encode("the heat")
    assert tok.decode(ids) == "the heat" and tok("the heat")["input_ids"] == ids
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n")


def _tasks(tmp: Path) -> Path:
    out = tmp / "tasks"
    out.mkdir()
    data = TASKS / "sparrow_mc.jsonl"
    for y in TASKS.glob("*.yaml"):
        (out / y.name).write_text(y.read_text().replace("test: sparrow_mc.jsonl", f"test: {data}"))
    return out


@pytest.mark.parametrize("task", ["sparrow_mc", "sparrow_mc_gen"])
def test_lm_eval_local_completions_runs_offline_without_a_tokenizer(served, tmp_path, monkeypatch, task):  # noqa: F811
    """No `tokenizer` in model_args and the hub offline: the harness used to fail ("Tokenizer is
    required for loglikelihood tasks") after trying to download the model id's tokenizer."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": "tiny", "base_url": served + "/v1/completions", "max_length": CTX},
        tasks=[task],
        task_manager=TaskManager(include_path=str(_tasks(tmp_path))),
        batch_size=1,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    samples = out["samples"][task]
    assert len(samples) == 12
    if task == "sparrow_mc":
        lls = [float(r[0]) for s in samples for r in s["filtered_resps"]]
        assert len(lls) == 48 and all(ll < 0 for ll in lls)
        assert 0 <= out["results"][task]["acc,none"] <= 1
    else:
        assert all(isinstance(s["resps"][0][0], str) for s in samples)
