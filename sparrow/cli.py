"""Command line: `sparrow generate | chat | serve | compile | bench ...`.

User errors (SparrowError) print one line on stderr and exit with status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .errors import SparrowError
from .params import (
    KV_DTYPES,
    QUANTIZE,
    SELECTORS,
    SPARSE_ATTN,
    SPARSE_ATTN_DEFAULT,
    SPECULATIVE_METHODS,
    V3_KEY_BITS,
    SamplingParams,
    SparseParams,
)
from .request import sampling_from_flags, speculative_from_flags

DEMO_PROMPT = "In three sentences, why is the sky blue?"


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model", "-m", default=None, help="HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    )
    g.add_argument("--mmproj", default=None, metavar="GGUF", help="Qwen3-VL or Qwen3.5 mmproj (with a .gguf model)")
    g.add_argument("--ctx", type=int, default=None, help="context length (default: the model's)")
    g.add_argument(
        "--rope-scaling",
        default=None,
        choices=["none", "linear", "yarn"],
        help="replace the model's rope scaling (llama.cpp's flags; none: turn it off), e.g. "
        "--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 32768 --ctx 131072 (README, Long context)",
    )
    g.add_argument("--rope-scale", type=float, default=None, metavar="F", help="context multiple of --rope-scaling")
    g.add_argument(
        "--yarn-orig-ctx",
        type=int,
        default=None,
        metavar="N",
        help="YaRN: the model's native context (default: its max_position_embeddings)",
    )
    g.add_argument("--kv-dtype", default="f32", choices=KV_DTYPES, help="KV cache storage")
    g.add_argument(
        "--threads",
        "-t",
        type=int,
        default=None,
        help="compute threads (default: one per core; on a big.LITTLE CPU one per big core)",
    )
    g.add_argument(
        "--quantize", default=None, choices=[q for q in QUANTIZE if q], help="quantise f16/bf16/f32 weights at load"
    )
    g.add_argument(
        "--activations",
        default=None,
        choices=["f32", "q8"],
        help="f32: exact. q8: 8-bit activations over block-quantised weights, as llama.cpp does: faster, "
        "not exact. Default: exact, unless exact decode of this model's weights would trail llama.cpp's "
        "(q4/q5/q6 files from ~0.5B parameters) (README, Activations)",
    )


def _prompt_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompt-cache",
        default=None,
        metavar="DIR",
        help="also keep prompts' KV in DIR: later runs, and other processes sharing DIR, start from it "
        "(whole 512-token chunks, same bits)",
    )
    p.add_argument(
        "--prompt-cache-size", default=None, metavar="SIZE", help="most bytes DIR holds, LRU out (default 20G)"
    )


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", "-n", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g = p.add_argument_group("sparse attention")
    g.add_argument(
        "--sparse-attn",
        nargs="?",
        const="on",
        default=None,
        choices=SPARSE_ATTN,
        help="block-sparse top-k decode attention: off, on (alone: on) or auto (v3 on 4-bit key codes with a "
        f"top-p budget from the context length where sparse decode pays on this CPU; default {SPARSE_ATTN_DEFAULT})",
    )
    g.add_argument("--sparse-k", type=int, default=None, help="blocks per query head (default 32)")
    g.add_argument("--sparse-block", type=int, default=None, help="tokens per block (default 32)")
    g.add_argument("--sparse-probe", type=int, default=None, help="probe keys per block (seed selector; default 8)")
    g.add_argument(
        "--sparse-select",
        choices=SELECTORS,
        default=None,
        help="block selector: seed (the article's, the default of on), v2 (block summaries; "
        "docs/SPARSE_SELECT_V2.md) or v3 (every key scored in int8, blocks by estimated softmax mass; "
        "docs/SPARSE_SELECT_V3.md; auto's)",
    )
    g.add_argument(
        "--sparse-p",
        type=float,
        default=None,
        metavar="P",
        help="v3: per head and step, blocks in order of estimated mass until they hold P of it (e.g. 0.95), "
        "at most --sparse-k (default: always --sparse-k blocks)",
    )
    g.add_argument(
        "--sparse-min-blocks", type=int, default=None, metavar="N", help="v3 with --sparse-p: at least N blocks"
    )
    g.add_argument(
        "--sparse-key-bits",
        type=int,
        choices=V3_KEY_BITS,
        default=None,
        help="v3: score keys by int8 codes (8, the default) or 4-bit ones (half the bytes a key read)",
    )
    g.add_argument(
        "--sparse-dense-layers",
        type=int,
        default=None,
        metavar="N",
        help="v2 / v3: the first N layers with a KV cache decode exact (default 2)",
    )
    g.add_argument("--sparse-prefill", action="store_true", help="select blocks during prefill too")
    g.add_argument(
        "--sparse-trace", default=None, metavar="FILE", help="write selected blocks per token/layer/head as JSON lines"
    )
    _speculative_args(p)
    p.add_argument("--timings", action="store_true", help="print load/prefill/decode speed and per-token times")


def _speculative_args(p: argparse.ArgumentParser, serve: bool = False) -> None:
    g = p.add_argument_group("speculative decoding (same tokens and logits as without it)")
    g.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        default=None,
        help="draft tokens and check them in one forward: ngram (prompt lookup), draft (--draft-model), "
        "sparse (this model with sparse attention), "
        "mtp (the model's own draft layer: Qwen3.5)" + ("; the default of requests that do not say" if serve else ""),
    )
    g.add_argument("--spec-tokens", type=int, default=4, metavar="K", help="most tokens drafted per step")
    g.add_argument("--spec-ngram", type=int, default=3, metavar="N", help="ngram: longest suffix looked up")
    g.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH",
        help="a smaller model sharing the tokenizer"
        + (" (requests may then ask for speculative 'draft')" if serve else " (with --speculative draft)"),
    )
    g.add_argument("--spec-sparse-k", type=int, default=None, metavar="K", help="sparse: blocks per head (default 8)")
    g.add_argument("--spec-sparse-select", choices=SELECTORS, default=None, help="sparse: block selector (seed)")


def check_draft_path(a) -> None:
    """--draft-model must exist: checked before the target model loads, which may take minutes."""
    path = getattr(a, "draft_model", None)
    if path and not os.path.exists(path):
        raise SparrowError(f"--draft-model path not found: {path}")


def _params(a) -> tuple[SamplingParams, SparseParams | None]:
    """The sampling and sparse settings of the command line, built and validated once (and its
    speculative settings, as a.speculative_params)."""
    sampling, sparse = sampling_from_flags(a)
    check_draft_path(a)
    a.speculative_params = speculative_from_flags(a)
    return sampling, sparse


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _compile_notice(cold: bool | None = None, activations: str = "f32") -> None:
    """The compile notice and progress lines on stderr (kernels.runtime.announce_compiles), so a first
    run's pause does not look like a hang; cold: the cache's state before a load that may have
    compiled (the q8 mode's interleaving). serve() does the same."""
    from .kernels.runtime import COMPILE_NOTICE, COMPILE_NOTICE_Q8, announce_compiles

    announce_compiles(_stderr, notice=COMPILE_NOTICE_Q8 if activations == "q8" else COMPILE_NOTICE, cold=cold)


def _load(a):
    from .api import load
    from .config import rope_scaling_from_flags
    from .kernels.runtime import cache_is_cold

    rope_scaling = rope_scaling_from_flags(a.rope_scaling, a.rope_scale, a.yarn_orig_ctx)  # before the load
    cold = cache_is_cold()
    llm = load(
        a.model,
        kv_dtype=a.kv_dtype,
        threads=a.threads,
        quantize=a.quantize,
        ctx=a.ctx,
        progress=sys.stderr.isatty(),
        activations=a.activations,
        mmproj=getattr(a, "mmproj", None),
        rope_scaling=rope_scaling,
        prompt_cache=getattr(a, "prompt_cache", None),
        prompt_cache_size=getattr(a, "prompt_cache_size", None),
    )
    _compile_notice(cold, llm.model.activations)  # after the load: a model that fails to load compiles nothing
    if getattr(a, "timings", False):
        print(
            f"[LOAD] {llm.name}: {llm.load_seconds:.2f} s, {llm.config.architecture}, {llm.threads} threads, "
            f"activations {llm.model.activations} ({llm.activations_why})",
            file=sys.stderr,
        )
    return llm


def _run(llm, prompt, a, **extra) -> str:
    """Streams one answer to stdout; returns its text. Handles --timings and --sparse-trace."""
    trace = [] if a.sparse_trace else None
    trace_file = open(a.sparse_trace, "a") if a.sparse_trace else None
    text, n_dec, dec_s, t_first, dec_lines = [], 0, 0.0, None, []
    t0 = time.perf_counter()
    try:
        sampling, sparse = a.params
        for i, out in enumerate(
            llm.stream(
                prompt,
                sampling=sampling,
                sparse=sparse,
                speculative=a.speculative_params,
                timings=a.timings,
                trace=trace,
                **extra,
            )
        ):
            sys.stdout.write(out.text)
            sys.stdout.flush()
            text.append(out.text)
            if a.timings and out.timing:
                if "prefill_ms" in out.timing:
                    t_first = dict(out.timing, cached=out.cached_tokens or 0)
                else:
                    n_dec += 1
                    dec_s += out.timing["total"] / 1e3
                    tm = out.timing
                    split = "" if tm["attn"] is None else f" attn={tm['attn']:.2f} ms mlp={tm['mlp']:.2f} ms"
                    dec_lines.append(f"[DEC-SINGLE] tok={i} total={tm['total']:.2f} ms{split}")
                if out.speculative and out.speculative["drafted_tokens"]:
                    sp = out.speculative
                    dec_lines.append(
                        f"[SPECULATIVE] drafted {sp['drafted_tokens']} tokens, accepted {sp['accepted_tokens']} "
                        f"({sp['accepted_tokens'] / sp['drafted_tokens']:.0%})"
                    )
            if trace_file is not None and trace:
                for layer, heads in trace.pop():
                    for head, blocks, stages, mass in heads:
                        trace_file.write(
                            json.dumps(
                                {
                                    "token": i,
                                    "selector": sparse.label,
                                    "layer": layer,
                                    "head": head,
                                    "blocks": blocks,
                                    "stages": stages,
                                    "mass": round(mass, 6),
                                }
                            )
                            + "\n"
                        )
    finally:
        if trace_file is not None:
            trace_file.close()
    print()
    if dec_lines:  # after the answer, so the streamed text stays readable
        print("\n".join(dec_lines), file=sys.stderr)
    if a.timings and t_first:
        ps = llm.vision.patch_size if llm.vision is not None else 0
        for j, v in enumerate(t_first.get("vision", ())):
            _, h, w = v["grid"]
            print(
                f"[VISION] image {j + 1}: {w * ps}x{h * ps} px, {v['tokens']} tokens, {v['ms']:.1f} ms",
                file=sys.stderr,
            )
        n = t_first["prefill_tokens"]
        ms = t_first["prefill_ms"]
        cached = f" ({t_first['cached']} more from the prefix cache)" if t_first["cached"] else ""
        print(
            f"[TIMINGS] prefill {n} tokens in {ms:.1f} ms ({n / max(ms, 1e-9) * 1e3:.1f} tok/s){cached}; "
            f"decode {n_dec} tokens in {dec_s * 1e3:.1f} ms ({n_dec / max(dec_s, 1e-9):.1f} tok/s); "
            f"wall {time.perf_counter() - t0:.2f} s",
            file=sys.stderr,
        )
    return "".join(text)


def cmd_generate(a) -> None:
    a.params = _params(a)
    llm = _load(a)
    prompt = a.prompt
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    if not prompt:  # `sparrow generate` alone: a demo chat turn
        prompt, a.chat = DEMO_PROMPT, True
        print(f"> {prompt}", file=sys.stderr)
    extra = {}
    if a.image:  # images go before the text, as Qwen3-VL's examples put them
        prompt = [{"role": "user", "content": [{"type": "image", "image": p} for p in a.image] + [_text(prompt)]}]
        a.chat = True
    if a.chat:
        extra = dict(chat=True, system=a.system, chat_template_kwargs=_think_kwargs(a))
    _run(llm, prompt, a, **extra)
    if llm.prefix.disk is not None:  # the prompt's entry is on disk when the command returns
        llm.prefix.disk.flush()


def _text(s: str) -> dict:
    return {"type": "text", "text": s}


def _think_kwargs(a) -> dict:
    return {"enable_thinking": False} if getattr(a, "no_think", False) else {}


def _attention_words(sparse: SparseParams | None) -> str:
    if sparse is None:
        return "exact attention"
    frm = "" if sparse.from_context == 0 else " past the context where it pays"
    return f"sparse attention {sparse.label}, at most {sparse.k} blocks{frm}"


def cmd_chat(a) -> None:
    a.params = _params(a)
    llm = _load(a)
    messages = [{"role": "system", "content": a.system}] if a.system else []
    print(
        f"sparrow chat with {llm.name} ({_attention_words(a.params[1])}). "
        "/reset clears the conversation, /image PATH attaches an image to your next message, /exit or Ctrl-D quits.",
        file=sys.stderr,
    )
    images = []  # /image paths waiting for the next user message
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            messages = messages[:1] if a.system else []
            images = []
            continue
        if line.strip().startswith("/image"):
            path = line.strip()[len("/image") :].strip()
            if not path:
                print("usage: /image PATH", file=sys.stderr)
            elif not os.path.isfile(os.path.expanduser(path)):
                print(f"error: no such file: {path}", file=sys.stderr)
            else:
                images.append(os.path.expanduser(path))
                print(f"[{len(images)} image(s) attached to your next message]", file=sys.stderr)
            continue
        if not line.strip():
            continue
        content = line
        if images:
            content = [{"type": "image", "image": p} for p in images] + [_text(line)]
            images = []
        messages.append({"role": "user", "content": content})
        try:
            answer = _run(llm, messages, a, chat=True, chat_template_kwargs=_think_kwargs(a))
        except SparrowError as e:
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        except KeyboardInterrupt:
            messages.pop()
            print("\n[interrupted]", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": answer})


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def cmd_serve(a) -> None:
    from .server.app import check_api_key

    check_api_key(a.api_key)  # before anything starts, Ray replicas included
    check_draft_path(a)
    if a.ray:
        from .server.ray_serve import serve_ray

        return serve_ray(a)
    from .server.app import serve

    serve(a)


def cmd_compile(a) -> None:
    """Compiles (or loads from the disk cache) the kernels of every path a server with these
    settings may take; --all: for every KV storage and activations mode too."""
    from .engine.warmup import PATHS, SERVER_PATHS, warm

    llm = _load(a)
    kinds = KV_DTYPES if a.all else (a.kv_dtype,)
    modes = ("f32", "q8") if a.all else (llm.model.activations,)
    paths = tuple(a.paths.split(",")) if a.paths else SERVER_PATHS
    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise SparrowError(f"unknown path {bad[0]!r}: --paths takes {', '.join(PATHS)}")
    t0 = time.perf_counter()
    for mode in modes:
        llm = llm.with_activations(mode)
        for kv in kinds:

            def report(name, i, n, seconds, kv=kv, mode=mode):
                print(f"{name:<15} KV {kv:<5} activations {mode:<4} {seconds:6.1f} s  ({PATHS[name]})", flush=True)

            warm(llm.runner, llm.tokenizer, kv, paths, report)
    print(f"sparrow: kernels ready for {llm.name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


LAB = "sparrow_lab"  # the benchmarks live beside the engine package; the one place sparrow names them


def lab_module(name: str):
    """The benchmark `sparrow bench NAME` runs: sparrow_lab.bench.NAME, imported only now."""
    import importlib

    try:
        return importlib.import_module(f"{LAB}.bench.{name.replace('-', '_')}")
    except ModuleNotFoundError as e:
        if e.name != LAB:
            raise
        raise SparrowError(
            f"`sparrow bench` needs the {LAB} package, which is not importable here: "
            "install sparrow from its repository (pip install -e '.[lab]')"
        ) from None


def cmd_bench(a) -> None:
    if not {"-h", "--help"} & set(a.bench_args):
        _compile_notice()
    lab_module(a.bench).main(a.bench_args)


class _Version(argparse.Action):
    """--version: the line is read only when asked for (metadata look-ups cost ~25 ms a start)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())  # on stdout, as argparse's own version action
        parser.exit()


def version_line() -> str:
    """'sparrow X (numba Y, numpy Z, Python W)', read from the installed metadata (nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    def of(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "missing"

    return f"sparrow {__version__} (numba {of('numba')}, numpy {of('numpy')}, Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparrow", description=__doc__.splitlines()[0])
    p.add_argument("--version", action=_Version, help="show the versions of sparrow, numba, numpy and Python")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="complete a prompt (or chat with --chat)")
    g.add_argument(
        "--prompt", "-p", default=None, help="prompt text (default: stdin if piped, else a demo chat prompt)"
    )
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--no-think", action="store_true", help="Qwen3: enable_thinking=False in the chat template")
    g.add_argument(
        "--image", action="append", default=None, metavar="PATH", help="image file (repeatable; implies --chat)"
    )
    _model_args(g)
    _prompt_cache_args(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat")
    c.add_argument("--system", default=None)
    c.add_argument("--no-think", action="store_true", help="Qwen3: enable_thinking=False in the chat template")
    _model_args(c)
    _prompt_cache_args(c)
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)

    from .server.limits import BODY_TIMEOUT, HEADER_TIMEOUT
    from .vision.media import MAX_IMAGE_BYTES, MAX_PIXELS_PER_REQUEST

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (an empty key is refused at start)"
    )
    s.add_argument(
        "--metrics-public", action="store_true", help="answer /metrics without the API key (default: it needs it)"
    )
    s.add_argument("--no-web-ui", action="store_true", help="serve no chat page at / (the API only)")
    s.add_argument(
        "--allow-special-tokens-in-content",
        action="store_true",
        help="trusted clients only: special-token text in messages (<|im_end|>) becomes special tokens "
        "(default: it is encoded as text, so a user cannot forge a turn)",
    )
    s.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_TIMEOUT,
        metavar="S",
        help="close a connection whose request head has not arrived in S seconds (default %(default)g; 0: none)",
    )
    s.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT,
        metavar="S",
        help="answer 408 to a request whose body has not arrived in S seconds (default %(default)g; 0: none)",
    )
    s.add_argument("--max-batch", type=int, default=16, help="most sequences decoded together")
    s.add_argument(
        "--kv-budget",
        default=None,
        metavar="SIZE",
        help="memory for KV caches, e.g. 512M or 4G (default: half the memory available at start)",
    )
    s.add_argument("--max-queue", type=_positive_int, default=None, help="queued requests past which new ones get 503")
    s.add_argument("--request-timeout", type=float, default=None, metavar="S", help="fail requests running longer")
    s.add_argument("--drain-timeout", type=float, default=30.0, metavar="S", help="SIGTERM: grace for in-flight work")
    s.add_argument("--no-prefix-cache", action="store_true", help="never reuse KV between requests")
    _prompt_cache_args(s)
    _speculative_args(s, serve=True)
    s.add_argument(
        "--allowed-local-media-path", default=None, metavar="DIR", help="serve file:// image URLs from under DIR"
    )
    s.add_argument("--max-images-per-request", type=_positive_int, default=None, help="most images in one request")
    s.add_argument(
        "--max-image-file-size",
        default=None,
        metavar="SIZE",
        help=f"largest file:// image, e.g. 50M (default {MAX_IMAGE_BYTES // 2**20}M)",
    )
    s.add_argument(
        "--max-pixels-per-request",
        type=int,
        default=MAX_PIXELS_PER_REQUEST,
        metavar="N",
        help="most pixels of one request's images together, read from their headers before decoding "
        "(default %(default)d; 0: no limit)",
    )
    r = s.add_argument_group("Ray Serve (pip install 'sparrow[ray]'; README, Deploy)")
    r.add_argument("--ray", action="store_true", help="serve replicas of this server on Ray Serve")
    r.add_argument("--replicas", type=_positive_int, default=1, help="replicas (fixed count)")
    r.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas")
    r.add_argument("--max-replicas", type=_positive_int, default=None, help="autoscaling: most replicas")
    r.add_argument("--target-ongoing-requests", type=float, default=None, help="autoscaling: requests per replica")
    r.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs a replica declares (its thread count)")
    r.add_argument("--ray-address", default=None, help="join this Ray cluster ('auto': the local one); default: new")
    _model_args(s)
    s.set_defaults(func=cmd_serve)

    k = sub.add_parser("compile", help="compile the kernels now (for example in a container build)")
    k.add_argument("--all", action="store_true", help="for every KV storage and activations mode, not just these")
    k.add_argument("--paths", default=None, help="comma-separated: exact,batched,seed,v2,sparse-prefill (default all)")
    _model_args(k)
    k.set_defaults(func=cmd_compile)

    b = sub.add_parser(
        "bench",
        help="benchmarks: attention, speed, long-context, needle, fidelity, serve, activations, prompt-cache, "
        "speculative, rows, sparse-trace, memory",
    )
    b.add_argument(
        "bench",
        choices=[
            "attention",
            "speed",
            "long-context",
            "needle",
            "fidelity",
            "serve",
            "activations",
            "prompt-cache",
            "speculative",
            "rows",
            "sparse-trace",
            "memory",
        ],
    )
    b.add_argument(
        "bench_args", nargs=argparse.REMAINDER, help="options of that benchmark (see sparrow bench NAME --help)"
    )
    b.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except SparrowError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
