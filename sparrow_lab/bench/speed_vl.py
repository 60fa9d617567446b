"""`sparrow bench speed --shape qwen3-vl-2b` or `--shape qwen3.5-0.8b --images 448,1024`: an
image model's speed with random weights and the real shapes (text GGUF from bench/shapes.py,
mmproj from bench/shapes_vl.py) on one square image per side given (448 by default).

Per side and round: the vision encoder (ms, and the image's tokens), the prefill of the whole
prompt (image pads included) and greedy decode after it; beside it, step for step (alternating),
decode after a text-only prompt of the same length, so the cost of images on decode (none is
expected: only the rope position shifts) reads as a ratio. Medians over the rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np

DEFAULT_SIDES = (448,)


def _image(side: int):
    from PIL import Image

    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (side // 16, side // 16, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((side, side), Image.Resampling.BICUBIC)


def _sides(a) -> tuple[int, ...]:
    from sparrow.errors import SparrowError

    text = getattr(a, "images", None)
    if not text:
        return DEFAULT_SIDES
    try:
        sides = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SparrowError(f"--images: comma-separated image sides, got {text!r}") from None
    if not sides or min(sides) < 32 or max(sides) > 4096:
        raise SparrowError(f"--images: sides between 32 and 4096 pixels, got {text!r}")
    return sides


def _decode_pair(llm, slots, firsts, n: int) -> list[float]:
    """Seconds for n greedy decode steps of each slot, the slots' steps alternating so that a
    change in the machine's load falls on both alike."""
    toks, secs = list(firsts), [0.0] * len(slots)
    for _ in range(n):
        for j, slot in enumerate(slots):
            t0 = time.perf_counter()
            toks[j] = int(np.argmax(llm.runner.decode([slot], [toks[j]])[0]))
            secs[j] += time.perf_counter() - t0
    return secs


def _sparrow_rounds(llm, side: int, a, log) -> list[dict]:
    parts = [{"type": "image", "image": _image(side)}, {"type": "text", "text": "Describe it."}]
    ids, images = llm.prompt_and_images([{"role": "user", "content": parts}], chat=True)
    plain = [i for i in ids if i != llm.vision.image_token_id]
    plain = (plain * (len(ids) // len(plain) + 1))[: len(ids)]  # a text-only prompt of the same length
    rows = []
    for r in range(a.rounds + 1):  # round 0 compiles and warms up; not reported
        slot = llm.runner.new_slot(ids, len(ids) + a.decode, images=images)  # encodes the image
        t0 = time.perf_counter()
        logits = llm.runner.prefill(slot)
        prefill_s = time.perf_counter() - t0
        tslot = llm.runner.new_slot(plain, len(plain) + a.decode)
        text_logits = llm.runner.prefill(tslot)
        firsts = [int(np.argmax(logits)), int(np.argmax(text_logits))]
        dec_s, text_dec_s = _decode_pair(llm, [slot, tslot], firsts, a.decode)
        vis = slot.mm.timings[0]
        row = {
            "vision_ms": vis["ms"],
            "image_tokens": vis["tokens"],
            "prompt_tokens": len(ids),
            "prefill_tok_s": len(ids) / prefill_s,
            "prompt_s": vis["ms"] / 1e3 + prefill_s,  # image encode + prefill: time to the first token
            "decode_tok_s": a.decode / dec_s,
            "text_only_decode_tok_s": a.decode / text_dec_s,
            "loadavg": os.getloadavg()[0],
        }
        del slot, tslot
        if r:
            rows.append(row)
        tag = f"{side}px round {r}{' (warm-up)' if not r else ''}"
        log(f"{tag}: " + json.dumps({k: round(v, 2) for k, v in row.items()}) + "\n")
    return rows


def _median(rows: list[dict]) -> dict:
    return {k: statistics.median(x[k] for x in rows) for k in rows[0]}


def run(a, log=sys.stderr.write) -> dict:
    import sparrow

    from . import shapes, shapes_vl

    sides = _sides(a)
    text = shapes.ensure(a.shape, a.type, log=log)
    mmproj = shapes_vl.ensure_mmproj(a.shape, log=log)
    llm = sparrow.load(text, mmproj=mmproj, threads=a.threads)
    rec = {"shape": a.shape, "type": a.type, "threads": a.threads, "decode": a.decode, "sides": {}}
    rec["arch"] = shapes.SHAPES[a.shape].get("arch", "qwen3")
    for side in sides:
        rows = _sparrow_rounds(llm, side, a, log)
        rec["sides"][str(side)] = {"rounds": rows, "median": _median(rows)}
    if getattr(a, "compare", None) == "llama-cpp":
        from . import llama_vl

        chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "<image>Describe it."}])
        del llm  # the text weights are memory-mapped; llama.cpp maps the same file
        for side in sides:
            lrows = llama_vl.run(text, mmproj, _image(side), chat, a.threads, a.decode, a.rounds)
            for r in lrows:
                log(f"llama.cpp {side}px: " + json.dumps({k: round(v, 2) for k, v in r.items()}) + "\n")
            rec["sides"][str(side)]["llama_cpp"] = {"rounds": lrows, "median": _median(lrows)}
    return rec


_FAMILY = {"qwen3vl": "Qwen3-VL", "qwen35": "Qwen3.5", "qwen35moe": "Qwen3.5-MoE"}


def markdown(rec) -> str:
    family = _FAMILY.get(rec.get("arch"), rec.get("arch"))
    lines = [
        f"{family} speed, random weights with {rec['shape']} shapes (text {rec['type']}, vision f16), "
        f"{rec['threads']} threads, one square image per row, medians of "
        f"{len(next(iter(rec['sides'].values()))['rounds'])} rounds",
        "",
        "| image | vision encoder | image tokens | prompt tokens | prefill | decode after the image | "
        "decode after text only | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for side, r in rec["sides"].items():
        m = r["median"]
        lines.append(
            f"| {side}x{side} | {m['vision_ms']:.0f} ms | {m['image_tokens']:.0f} | {m['prompt_tokens']:.0f} | "
            f"{m['prefill_tok_s']:.1f} tok/s | {m['decode_tok_s']:.2f} tok/s | "
            f"{m['text_only_decode_tok_s']:.2f} tok/s | {m['decode_tok_s'] / m['text_only_decode_tok_s']:.2f} |"
        )
    return "\n".join(lines + _llama_rows(rec))


def _llama_rows(rec) -> list[str]:
    sides = [(side, r) for side, r in rec["sides"].items() if "llama_cpp" in r]
    if not sides:
        return []
    out = [
        "",
        "| image | engine | vision encoder | image tokens | prompt tokens | prefill (text side) | "
        "image + prefill | decode |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for side, r in sides:
        m, lm = r["median"], r["llama_cpp"]["median"]
        out += [
            f"| {side}x{side} | sparrow | {m['vision_ms']:.0f} ms | {m['image_tokens']:.0f} | "
            f"{m['prompt_tokens']:.0f} | {m['prefill_tok_s']:.1f} tok/s | {m['prompt_s']:.2f} s | "
            f"{m['decode_tok_s']:.2f} tok/s |",
            f"| | llama.cpp (mtmd) | {lm['vision_ms']:.0f} ms | {lm['image_tokens']:.0f} | "
            f"{lm['prompt_tokens']:.0f} | {lm['prefill_tok_s']:.1f} tok/s | {lm['prompt_s']:.2f} s | "
            f"{lm['decode_tok_s']:.2f} tok/s |",
            f"| | sparrow / llama.cpp | **{m['vision_ms'] / lm['vision_ms']:.2f}x time** | | | "
            f"{m['prefill_tok_s'] / lm['prefill_tok_s']:.2f}x | {m['prompt_s'] / lm['prompt_s']:.2f}x time | "
            f"{m['decode_tok_s'] / lm['decode_tok_s']:.2f}x |",
        ]
    return out


def main(a) -> int:
    from sparrow_lab.eval import report

    rec = run(a)
    out = report.record_path("speed", a.json)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(rec, f, indent=2)
    md = markdown(rec)
    print(md)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md + "\n")
    print(f"record: {out}", file=sys.stderr)
    return 0
