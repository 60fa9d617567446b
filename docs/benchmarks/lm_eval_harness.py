"""Drives `sparrow serve` with lm-evaluation-harness (issue 38, item 7): a client nobody here wrote.

    pip install lm_eval
    python docs/benchmarks/lm_eval_harness.py [--model PATH.gguf] [--out table.md]

On the multiple-choice task kept in tests/data/lm_eval (no download), it runs
- `local-completions` against the server: loglikelihoods through `echo` + `logprobs`, prompts
  sent as batches of token-id lists;
- `local-chat-completions` against the server: the same items answered by generation (the letter);
- the harness's own `hf` backend on the same weights (transformers loads the GGUF), both ways;
- sparrow's in-process API (`LLM.prompt_logprobs`) on the token ids the harness sent.

It fails (exit status 1) unless every per-choice loglikelihood of the server equals the
in-process API's within 1e-4 and each accuracy of the server is the hf backend's within one item,
and prints the table (item, choice, sparrow ll, in-process ll, hf ll).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TASKS = Path(__file__).resolve().parents[2] / "tests" / "data" / "lm_eval"
TOLERANCE = 1e-4  # nats, per choice: server against the in-process API


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _task_dir(tmp: Path) -> Path:
    """The task YAMLs with the data file's absolute path (the harness resolves it from the cwd)."""
    out = tmp / "tasks"
    out.mkdir()
    data = TASKS / "sparrow_mc.jsonl"
    for y in TASKS.glob("*.yaml"):
        text = y.read_text().replace("test: sparrow_mc.jsonl", f"test: {data}")
        (out / y.name).write_text(text)
    return out


def _hf_tokenizer(model: Path, tmp: Path) -> str:
    """The GGUF's tokenizer as a transformers folder (both the API models and hf read it)."""
    from transformers import AutoTokenizer

    folder = tmp / "tokenizer"
    AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name).save_pretrained(folder)
    return str(folder)


def _serve(model: Path, port: int, threads: int | None):
    cmd = [sys.executable, "-m", "sparrow.cli", "serve", "--model", str(model), "--port", str(port)]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    import httpx

    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"sparrow serve exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("sparrow serve did not get ready in 15 minutes")


def _evaluate(model: str, model_args: dict, task: str, tasks: Path, chat: bool = False, batch_size: int = 1):
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=batch_size,
        log_samples=True,
        apply_chat_template=chat,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return out["results"][task], samples


def _lls(samples) -> dict:
    """(doc id, choice) -> loglikelihood, from a multiple_choice run's samples."""
    return {(s["doc_id"], j): float(r[0]) for s in samples for j, r in enumerate(s["filtered_resps"])}


def _pairs(sample) -> list[tuple[str, str]]:
    args = sample["arguments"]
    if isinstance(args, dict):  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
        return [(a["arg_0"], a["arg_1"]) for a in args.values()]
    return [tuple(a) for a in args]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF file (default: sparrow's default model)")
    ap.add_argument("--threads", type=int, help="the server's and the in-process API's threads")
    ap.add_argument("--out", help="also write the table (markdown) here")
    a = ap.parse_args(argv)

    import sparrow
    from sparrow.loaders import default_model_path

    model = Path(a.model or default_model_path()).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="sparrow-lm-eval-"))
    t0 = time.perf_counter()
    try:
        tasks = _task_dir(tmp)
        tokenizer = _hf_tokenizer(model, tmp)
        port = _port()
        server = _serve(model, port, a.threads)
        try:
            base = f"http://127.0.0.1:{port}/v1"
            api = {"model": model.name, "tokenizer_backend": "huggingface", "tokenizer": tokenizer, "max_retries": 1}
            comp, comp_samples = _evaluate(
                "local-completions", {**api, "base_url": base + "/completions"}, "sparrow_mc", tasks, batch_size=8
            )
            chat_args = {**api, "base_url": base + "/chat/completions", "tokenized_requests": False}
            chat, chat_samples = _evaluate("local-chat-completions", chat_args, "sparrow_mc_gen", tasks, chat=True)
        finally:
            server.terminate()
            server.wait(30)
        hf_args = {"pretrained": str(model.parent), "gguf_file": model.name, "tokenizer": tokenizer}
        hf_args.update(dtype="float32", device="cpu")
        hf, hf_samples = _evaluate("hf", hf_args, "sparrow_mc", tasks)
        hf_chat, hf_chat_samples = _evaluate("hf", hf_args, "sparrow_mc_gen", tasks, chat=True)

        # the in-process API on the token ids the harness sent (its own context/continuation split)
        from lm_eval.models.openai_completions import LocalCompletionsAPI

        lm = LocalCompletionsAPI(base_url=base + "/completions", **api)
        llm = sparrow.load(str(model), threads=a.threads)
        inproc = {}
        for s in comp_samples:
            for j, (context, continuation) in enumerate(_pairs(s)):
                ctx_ids, cont_ids = lm._encode_pair(context, continuation)
                lps = llm.prompt_logprobs(ctx_ids + cont_ids)
                inproc[(s["doc_id"], j)] = sum(e[1] for e in lps[len(ctx_ids) :])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    served, ref = _lls(comp_samples), _lls(hf_samples)
    lines = [
        "| item | choice | sparrow ll | in-process ll | hf ll | correct |",
        "|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for doc, j in sorted(served):
        d = abs(served[doc, j] - inproc[doc, j])
        worst = max(worst, d)
        answer = comp_samples[doc]["target"]
        lines.append(
            f"| {doc} | {j} | {served[doc, j]:.6f} | {inproc[doc, j]:.6f} | {ref[doc, j]:.6f} | "
            f"{'*' if j == answer else ''} |"
        )
    n = len(comp_samples)
    acc = [comp["acc,none"], hf["acc,none"]]
    gen = [chat["exact_match,letter"], hf_chat["exact_match,letter"]]
    worst_hf = max(abs(served[k] - ref[k]) for k in served)
    summary = [
        f"model {model.name}, {n} items, {len(served)} choices; {time.perf_counter() - t0:.0f} s in all",
        f"loglikelihood accuracy: sparrow {acc[0]:.3f}, hf {acc[1]:.3f}",
        f"generation (chat) exact match: sparrow {gen[0]:.3f}, hf {gen[1]:.3f}",
        f"largest |sparrow - in-process| {worst:.2e} (must be <= {TOLERANCE:g}); largest |sparrow - hf| {worst_hf:.2e}",
    ]
    text = "\n".join(lines + [""] + summary)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    ok = worst <= TOLERANCE and all(abs(x - y) * n <= 1 + 1e-9 for x, y in (acc, gen))
    print("OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
