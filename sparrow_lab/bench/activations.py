"""`sparrow bench activations`: what the activations="q8" mode costs in accuracy and buys in speed.

The same text is decoded one token at a time (teacher forcing: every step sees the same
prefix) with exact f32 activations and with 8-bit activations, and the logits of each step
are compared: mean and max KL(f32 || q8), top-1 agreement, max and mean |logit difference|.
Then decode ms/token of both modes after the text (median of --decode steps). The q8 mode's
prefill (q8_0 / q4_x / q4_k weights) is compared the same way: the whole text in one
forward, logits at every position, and its time.

    sparrow bench activations                     # the default model, 400 positions
    sparrow bench activations --model qwen3.gguf --positions 200
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np

from sparrow_lab.eval import report
from sparrow_lab.eval.fidelity import kl_per_token
from sparrow_lab.eval.prompts import filler_sentences


def _teacher_forced(llm, ids) -> np.ndarray:
    """Logits [len(ids), V] of decode steps feeding ids one at a time from an empty cache."""
    slot = llm.runner.new_slot(ids, len(ids) + 1, "f32")
    return np.stack([llm.runner.decode([slot], [t])[0] for t in ids])


def _prefill(llm, ids) -> tuple[np.ndarray, float]:
    """(logits [len(ids), V] of one forward over ids from an empty cache, its seconds)."""
    from sparrow.models.decoder import Segment

    cache = llm.model.new_cache(len(ids) + 1, "f32")
    t0 = time.perf_counter()
    logits = llm.model.forward([Segment(np.asarray(ids, np.int64), cache, 0)], all_logits=True)
    return logits, time.perf_counter() - t0


def _decode_ms(llm, ids, n) -> float:
    slot = llm.runner.new_slot(ids, len(ids) + n + 1, "f32")
    llm.runner.prefill(slot)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        llm.runner.decode([slot], [ids[i % len(ids)]])
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> dict:
    from sparrow.api import load

    p = argparse.ArgumentParser(prog="sparrow bench activations", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF or HF folder (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--positions", type=int, default=400, help="teacher-forced positions compared")
    p.add_argument("--decode", type=int, default=32, help="decode steps timed per mode")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the JSON record here (default runs/activations-<timestamp>/)")
    a = p.parse_args(argv)
    llm = load(a.model, threads=a.threads, activations="f32")
    text = "Read this and summarise it in one line.\n" + " ".join(filler_sentences(random.Random(0), 80))
    ids = llm.prompt_ids([{"role": "user", "content": text}], chat=True)[: a.positions]
    rec = {"bench": "activations", "model": llm.name, "positions": len(ids), "threads": llm.threads}
    rec["environment"] = report.environment()
    logits, ms, pre, pre_s = {}, {}, {}, {}
    for mode in ("f32", "q8"):
        llm = llm.with_activations(mode)
        logits[mode] = _teacher_forced(llm, ids).astype(np.float64)  # [N, V]
        _decode_ms(llm, ids, 2)  # warm-up (compiles the mode's kernels)
        ms[mode] = _decode_ms(llm, ids, a.decode)
        _prefill(llm, ids)  # warm-up
        pre[mode], pre_s[mode] = _prefill(llm, ids)
    pkl = kl_per_token(pre["f32"].astype(np.float64), pre["q8"].astype(np.float64))
    rec.update(
        prefill_mean_kl=float(pkl.mean()),
        prefill_max_kl=float(pkl.max()),
        prefill_top1_agreement=float((pre["f32"].argmax(1) == pre["q8"].argmax(1)).mean()),
        prefill_ms_f32=pre_s["f32"] * 1e3,
        prefill_ms_q8=pre_s["q8"] * 1e3,
    )
    kl = kl_per_token(logits["f32"], logits["q8"])
    diff = np.abs(logits["f32"] - logits["q8"])
    rec.update(
        decode_ms_f32=ms["f32"],
        decode_ms_q8=ms["q8"],
        mean_kl=float(kl.mean()),
        max_kl=float(kl.max()),
        top1_agreement=float((logits["f32"].argmax(1) == logits["q8"].argmax(1)).mean()),
        max_abs_logit_diff=float(diff.max()),
        mean_abs_logit_diff=float(diff.mean()),
        speedup=ms["f32"] / ms["q8"],
    )
    rec["rows"] = [{"activations": m, "decode_ms": ms[m]} for m in ms]
    path = report.record_path("activations", a.json)
    with open(path, "w") as f:  # the record first, then the summary
        json.dump(rec, f, indent=2)
    print(f"{llm.name}: {len(ids)} teacher-forced positions, activations q8 vs f32")
    print(f"  mean KL {rec['mean_kl']:.3g} nats (max {rec['max_kl']:.3g}), top-1 agreement {rec['top1_agreement']:.4f}")
    print(f"  |logit diff| max {rec['max_abs_logit_diff']:.3g}, mean {rec['mean_abs_logit_diff']:.3g}")
    print(
        f"  decode ms/token after {len(ids)} tokens: f32 {rec['decode_ms_f32']:.2f}, q8 {rec['decode_ms_q8']:.2f}"
        f" ({rec['speedup']:.2f}x)"
    )
    print(
        f"  prefill of the {len(ids)} tokens: mean KL {rec['prefill_mean_kl']:.3g} (max "
        f"{rec['prefill_max_kl']:.3g}), top-1 {rec['prefill_top1_agreement']:.4f}; "
        f"f32 {rec['prefill_ms_f32']:.0f} ms, q8 {rec['prefill_ms_q8']:.0f} ms"
    )
    print(f"wrote {path}")
    return rec


if __name__ == "__main__":
    main()
