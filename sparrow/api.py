"""The public Python API shared by the CLI, the server and users.

llm = sparrow.load()                      # default model; or a folder / .gguf path
ids = llm.tokenizer.encode("Hello")
logits = llm.logits(ids)                  # [len(ids), vocab] float32, exact attention
for piece in llm.generate("Hi!", max_tokens=32, sparse_attn=True):
    print(piece, end="")
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np

from .engine.generate import generate_step
from .engine.handle import ModelHandle
from .engine.runner import Runner
from .engine.sequence import Sequence, StepOutput
from .engine.speculative import check_supported, make_speculator
from .errors import SparrowError
from .kernels.runtime import set_threads
from .loaders import open_checkpoint
from .params import (
    QUANTIZE,
    SPARSE_OPTIONS,
    SPECULATIVE_OPTIONS,
    SamplingParams,
    SparseParams,
    SpeculativeParams,
    check_kv_dtype,
)
from .request import GenerationRequest, sampling_and_sparse, speculative_params
from .state.budget import KVPool, default_budget
from .state.prefix import PrefixCache, prefix_key
from .structured import Structured, ToolFormat, tool_format
from .tokenizer import SpecialText
from .vision.media import DEFAULT_MAX_IMAGES, MediaRules
from .vision.messages import expand_pads, has_images, split_images
from .vision.preprocess import preprocess


class LLM:
    def __init__(self, checkpoint, model, kv_dtype: str, threads: int, ctx: int, load_seconds: float):
        self.checkpoint = checkpoint
        self.model = model
        self.runner = Runner(model)  # every forward goes through it (chunked prefill, decode batches)
        self.tokenizer = checkpoint.tokenizer
        self.config = checkpoint.config
        self.name = checkpoint.name
        self.kv_dtype = kv_dtype
        self.threads = threads
        self.ctx = ctx
        self.load_seconds = load_seconds
        # stream() leaves each prompt's KV here for the next call that starts the same way (a chat's
        # next turn); one entry, the latest prompt, so a script looping over long prompts keeps at
        # most one prompt's KV alive between calls (llm.prefix.clear() drops it).
        self.prefix = PrefixCache(KVPool(default_budget()), self.runner.prefill_chunk, max_entries=1)
        self.vision = getattr(checkpoint, "vision", None)  # VisionConfig of an image model, else None
        self.activations_why = "asked for"  # why the model runs its activations mode (load)
        self.max_images = DEFAULT_MAX_IMAGES  # per prompt
        self.special_tokens_in_content = False  # True: chat content may write special tokens (trusted callers)
        self._drafts: dict[str, LLM] = {}  # speculative 'draft': path -> the draft model, loaded once

    def draft_llm(self, path: str) -> LLM:
        """The draft model at `path` for speculative decoding (loaded on first use with this
        model's threads and KV storage; it must share this model's tokenizer)."""
        from .engine.speculative import check_draft_model

        if path not in self._drafts:
            draft = load(path, kv_dtype=self.kv_dtype, threads=self.threads)
            check_draft_model(self, draft)
            self._drafts[path] = draft
        return self._drafts[path]

    @property
    def handle(self) -> ModelHandle:
        """This model as the engine takes it (engine/handle.py): its runner, tokenizer, context,
        KV storage, threads, and its draft models."""
        return ModelHandle(
            self.runner, self.tokenizer, self.ctx, self.kv_dtype, self.threads, lambda path: self.draft_llm(path).handle
        )

    def with_activations(self, mode: str) -> LLM:
        """This checkpoint as an LLM whose model runs activations mode `mode` (a model's mode is
        fixed when it is built: its weights are prepared for it); self when it already does.
        The memory-mapped stored weights are shared; the q8 mode's interleaved copies are not."""
        from .models import build_model

        _check_activations(mode)
        if mode == self.model.activations:
            return self
        t0 = time.perf_counter()
        model = build_model(self.checkpoint, quantize=self.model.quantize, activations=mode)
        return LLM(self.checkpoint, model, self.kv_dtype, self.threads, self.ctx, time.perf_counter() - t0)

    # ------------------------------------------------------------------ prompts
    def prompt_ids(self, prompt, **options) -> list[int]:
        """The prompt's token ids (prompt_and_images without the images, same options)."""
        return self.prompt_and_images(prompt, **options)[0]

    def prompt_and_images(
        self,
        prompt,
        *,
        chat: bool | None = None,
        system: str | None = None,
        chat_template_kwargs: dict | None = None,
        assistant_prefix: str = "",
        tools: list[dict] | None = None,
        media: MediaRules | None = None,
        special_tokens_in_content: bool | None = None,
    ) -> tuple[list[int], list]:
        """The one prompt builder (chat template + tools + images -> ids), shared by the CLI, the
        API and the server: (token ids with each image's pad expanded to its token count, the
        prompt's preprocessed images (vision.preprocess.PixelImage, in order)).

        A string is a raw completion prompt unless chat=True; a list is chat messages. tools:
        OpenAI tool objects for the chat template to render. User content may be a list of
        parts: {"type": "text", "text": ...}, {"type": "image_url", "image_url": {"url":
        "data:image/png;base64,..."}} and {"type": "image", "image": path | bytes | PIL.Image}.
        media: where images may come from and how much of them (vision.media.MediaRules; None:
        the defaults); the server passes its own, built once from its flags.

        Special-token text in the caller's strings (messages, system, tools, template kwargs,
        assistant_prefix) is encoded as text: special tokens come only from the chat template
        (tokenizer.SpecialText). special_tokens_in_content=True (None: this LLM's attribute of
        that name, False unless set) encodes it as the special tokens, for trusted callers."""
        tok = self.tokenizer
        if isinstance(prompt, str) and not chat:
            return tok.encode(prompt, add_special_tokens=True), []
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if special_tokens_in_content is None:
            special_tokens_in_content = self.special_tokens_in_content
        callers = (messages, system, tools, chat_template_kwargs, assistant_prefix)
        escaper = SpecialText(tok, () if special_tokens_in_content else callers, tok.chat_template)
        messages, system, tools, chat_template_kwargs, assistant_prefix = escaper.escape(callers)
        images = []
        if has_images(messages):
            m = media or MediaRules()
            messages, images = split_images(
                messages,
                self._image_placeholder(),
                m.max_images if m.max_images is not None else self.max_images,
                m.allowed_local_path,
                m.local_files,
                m.max_image_bytes,
                m.max_pixels,
            )
        if system is not None:
            messages = [{"role": "system", "content": system}] + [m for m in messages if m.get("role") != "system"]
        text = tok.apply_chat_template(
            messages, add_generation_prompt=True, tools=tools, **(chat_template_kwargs or {})
        )
        # The template already holds any bos it needs.
        ids = escaper.encode(text + assistant_prefix)
        if self.vision is None:
            return ids, []
        pixels = [preprocess(im, self.vision) for im in images]
        counts = [self.model.image_tokens(p.grid) for p in pixels]
        return expand_pads(ids, self.vision.image_token_id, counts), pixels

    def _image_placeholder(self) -> str | None:
        """The text a template writes for one image, or None for a text-only model."""
        vc = self.vision
        if vc is None:
            return None
        ids = (vc.vision_start_token_id, vc.image_token_id, vc.vision_end_token_id)
        toks = [self.tokenizer.id_to_token(i) for i in ids]
        if None in toks:
            raise SparrowError(f"the tokenizer lacks the vision tokens {ids}")
        return "".join(toks)

    # ------------------------------------------------------------------ forward
    def logits(
        self, token_ids, sparse: SparseParams | None = None, kv_dtype: str | None = None, **sparse_options
    ) -> np.ndarray:
        """One full forward over token_ids (a single chunk); float32 logits [len(token_ids), vocab].
        token_ids may also be chat messages (with image parts for an image model): the forward
        then runs over prompt_ids(messages).

        Attention is exact unless `sparse` (or the sparse_attn=True, sparse_k=... keywords) says
        otherwise."""
        from .models.decoder import Segment

        set_threads(self.threads)
        images = []
        if isinstance(token_ids, list) and token_ids and isinstance(token_ids[0], dict):
            token_ids, images = self.prompt_and_images(token_ids, chat=True)
        ids = np.asarray(token_ids, np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise SparrowError("token_ids must be a non-empty 1-D sequence")
        if len(ids) > self.ctx:
            raise SparrowError(f"{len(ids)} tokens exceed the context length {self.ctx}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise SparrowError(f"token id out of range [0, {self.config.vocab_size})")
        if set(sparse_options) - set(SPARSE_OPTIONS):
            raise SparrowError(f"logits() takes only sparse_* options, got {sorted(sparse_options)}")
        _, sparse = sampling_and_sparse(sparse_options, None, sparse)
        slot = self.runner.new_slot(ids, len(ids), check_kv_dtype(kv_dtype or self.kv_dtype), images=images)
        vision = slot.mm.segment(0, len(ids)) if slot.mm is not None else None
        return self.model.forward([Segment(ids, slot.cache, 0, sparse, vision=vision)], all_logits=True)

    def prompt_logprobs(
        self, prompt, top: int = 0, kv_dtype: str | None = None, sparse: SparseParams | None = None
    ) -> list[tuple[int, float | None, list | None]]:
        """Each prompt token's logprob given the tokens before it: [(token id, logprob, top
        alternatives [(id, logprob)] best first, or None when top is 0)], the first token's
        logprob None. prompt: token ids or a raw completion prompt (text). The prompt is
        prefilled as the server prefills it (the runner's chunks), with every position's logits,
        so these are the bits the server's completions `echo` + `logprobs` report."""
        from .engine.sampling import prompt_logprobs

        set_threads(self.threads)
        ids = np.asarray(self.prompt_ids(prompt) if isinstance(prompt, str) else prompt, np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise SparrowError("the prompt must be a non-empty text or 1-D list of token ids")
        if len(ids) > self.ctx:
            raise SparrowError(f"{len(ids)} tokens exceed the context length {self.ctx}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise SparrowError(f"token id out of range [0, {self.config.vocab_size})")
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise SparrowError(f"top must be an integer in [0, 20], got {top!r}")
        slot = self.runner.new_slot(ids, len(ids), check_kv_dtype(kv_dtype or self.kv_dtype), sparse)
        out = []
        while True:
            start, rows = slot.cache.length, []
            if self.runner.prefill_step(slot, rows=rows) is None:
                return out
            out += prompt_logprobs(ids, start, rows[0], top)

    # ------------------------------------------------------------------ generation
    def stream(
        self,
        prompt,
        *,
        sampling: SamplingParams | None = None,
        sparse: SparseParams | None = None,
        speculative: SpeculativeParams | None = None,
        kv_dtype: str | None = None,
        chat: bool | None = None,
        system: str | None = None,
        chat_template_kwargs: dict | None = None,
        assistant_prefix: str = "",
        timings: bool = False,
        trace: list | None = None,
        tools: list[dict] | None = None,
        tool_choice=None,
        response_format: dict | None = None,
        parallel_tool_calls: bool | None = None,
        **options,
    ) -> Iterator[StepOutput]:
        """Like generate() but yields StepOutput (token id, text delta, logprobs, finish reason).

        Settings come as objects (`sampling`, `sparse`) or as keyword conveniences: any
        SamplingParams field (max_tokens=256, temperature=0.0, top_p, top_k, min_p, the
        penalties, seed, stop, logprobs) and sparse_attn (True / "on", False / "off", or
        "auto": v3 on 4-bit key codes with top-p 0.95 from the context where it pays), sparse_k, sparse_block,
        sparse_probe, sparse_prefill, sparse_select, sparse_p, sparse_min_blocks (v3's top-p
        budget), sparse_key_bits (v3's key codes: 8 or 4), sparse_dense_layers (v2 / v3's exact
        first KV layers). trace: a list that receives, per decoded token, the sparse selections
        [(layer, [(head, blocks, stages, mass)])].

        speculative (or the keywords speculative="ngram" | "draft" | "sparse" | "mtp", spec_tokens=4,
        spec_ngram, draft_model=PATH, spec_sparse_k, spec_sparse_select, spec_adaptive):
        speculative decoding, which yields the same tokens and logits as without it; the last
        output's `speculative` counts the drafted and accepted tokens.

        tools, tool_choice, response_format, parallel_tool_calls: as in OpenAI's chat API (see
        chat() for the parsed answer); a forced tool call or a JSON response_format constrains the
        tokens to the grammar."""
        request = self.request(
            prompt,
            sampling=sampling,
            sparse=sparse,
            speculative=speculative,
            kv_dtype=kv_dtype,
            chat=chat,
            system=system,
            chat_template_kwargs=chat_template_kwargs,
            assistant_prefix=assistant_prefix,
            trace=trace is not None,
            tools=tools,
            tool_choice=tool_choice,
            response_format=response_format,
            parallel_tool_calls=parallel_tool_calls,
            **options,
        )
        yield from self.run(request, timings=timings, trace=trace)

    def request(
        self,
        prompt,
        *,
        sampling: SamplingParams | None = None,
        sparse: SparseParams | None = None,
        speculative: SpeculativeParams | str | None = None,
        kv_dtype: str | None = None,
        chat: bool | None = None,
        system: str | None = None,
        chat_template_kwargs: dict | None = None,
        assistant_prefix: str = "",
        trace: bool = False,
        tools: list[dict] | None = None,
        tool_choice=None,
        response_format: dict | None = None,
        parallel_tool_calls: bool | None = None,
        **options,
    ) -> GenerationRequest:
        """The GenerationRequest (sparrow/request.py) that stream() runs for these arguments:
        the prompt tokenized (with its images), each option parsed and checked once."""
        set_threads(self.threads)
        spec_options = {k: options.pop(k) for k in list(options) if k in SPECULATIVE_OPTIONS}
        speculative = speculative_params(speculative, spec_options)
        sampling, sparse = sampling_and_sparse(options, sampling, sparse)
        sampling.check_vocab(self.config.vocab_size)
        kv = check_kv_dtype(kv_dtype or self.kv_dtype)
        structured = Structured.parse(tools, tool_choice, response_format, parallel_tool_calls)
        ids, images = (
            (prompt, [])
            if _is_token_ids(prompt)
            else self.prompt_and_images(
                prompt,
                chat=chat,
                system=system,
                chat_template_kwargs=chat_template_kwargs,
                assistant_prefix=assistant_prefix,
                tools=structured.template_tools,
            )
        )
        constraint = structured.constraint(self.tokenizer, self.config.vocab_size, self.tool_format)
        return GenerationRequest(
            ids,
            sampling,
            sparse,
            speculative,
            kv,
            constraints=None if constraint is None else [constraint],
            images=images,
            trace=trace,
        )

    def run(self, request: GenerationRequest, *, timings: bool = False, trace: list | None = None):
        """Generates one answer to `request` in this thread, yielding StepOutputs; the prompt's
        KV stays in llm.prefix for the next call that starts the same way. trace: a list that
        receives, per decoded token, the sparse selections (request.trace must be set)."""
        set_threads(self.threads)
        if request.n != 1 or request.prompt_logprobs is not None or request.score_only:
            raise SparrowError("LLM.run generates one choice: n, prompt_logprobs and score_only are the server's")
        kv = check_kv_dtype(request.kv_dtype or self.kv_dtype)
        sparse, speculative = request.sparse, request.speculative
        seq = Sequence.create(
            self.runner,
            self.tokenizer,
            request.prompt_ids,
            request.sampling,
            self.ctx,
            kv,
            sparse,
            request.trace,
            request.constraints[0] if request.constraints else None,
            request.images,
        )
        check_supported(seq, speculative)
        spec = make_speculator(self.handle, self.runner, speculative, seq, kv) if speculative is not None else None
        key = prefix_key(kv, sparse, has_images=getattr(seq.slot, "mm", None) is not None)
        cached = self.prefix.seed(key, seq.slot) if key is not None else 0
        try:
            for out in generate_step(self.runner, seq, timings=timings, spec=spec):
                if cached is not None:
                    out.cached_tokens, cached = cached, None
                    if out.timing:
                        out.timing["prefill_tokens"] -= out.cached_tokens
                if trace is not None and seq.trace:
                    trace.append(list(seq.trace))
                    seq.trace.clear()
                yield out
        finally:  # also when the caller stops early
            if spec is not None:
                spec.release()
            if key is not None:
                self.prefix.insert(key, seq.slot.prompt, seq.slot.cache, seq.slot.snapshots)

    # ------------------------------------------------------------------ prompt cache files
    def save_prefix(
        self, prompt, path: str, *, kv_dtype: str | None = None, sparse: SparseParams | None = None, **prompt_options
    ) -> int:
        """Prefills prompt (token ids, text or chat messages, as stream() takes them; reusing
        whatever the prefix cache holds) and writes its KV to `path` (the disk cache's format,
        state/disk.py) for load_prefix, in this process or another. Only whole prefill
        chunks are kept, as in the prefix cache: those are what a later prompt reuses with the
        same bits. Returns how many positions the file holds."""
        from .state.disk import identity_for, write_entry

        kv = check_kv_dtype(kv_dtype or self.kv_dtype)
        ids = prompt if _is_token_ids(prompt) else self.prompt_ids(prompt, **prompt_options)
        ids = np.asarray(ids, np.int64)
        key = prefix_key(kv, sparse)
        chunk = self.runner.prefill_chunk
        if len(ids) < chunk:
            raise SparrowError(
                f"save_prefix: the prompt has {len(ids)} tokens; a saved prefix holds whole {chunk}-token chunks"
            )
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):  # before the prefill, which a bad path would waste
            raise SparrowError(f"save_prefix: no folder {folder}")
        for _ in self.stream(ids, max_tokens=1, temperature=0.0, kv_dtype=kv, sparse=sparse):
            pass
        hit = self.prefix.lookup(key, np.append(ids, -1))  # -1: never a token, so all of ids may match
        try:
            if hit.tokens < len(ids) - len(ids) % chunk:
                raise SparrowError("save_prefix: the prompt's KV did not stay in memory (see llm.prefix)")
            entry, n = hit.entry, hit.tokens
            meta = dict(identity_for(self.checkpoint, self.model, chunk), key=key, kv_dtype=kv)
            write_entry(path, meta, entry.tokens[:n], entry.cache, entry.snapshots)
        except OSError as e:
            raise SparrowError(f"save_prefix: cannot write {path} ({e.strerror or e})") from None
        finally:
            self.prefix.unpin(hit, False)
        return n

    def load_prefix(self, path: str) -> int:
        """Loads a file that save_prefix (or a --prompt-cache folder) wrote into the prefix
        cache, so the next prompt starting with its tokens skips their prefill. Returns how many
        positions it holds; SparrowError names why a file cannot be used (another model, KV
        dtype, sparrow version, or damage)."""
        from .state.disk import EntryError, identity_for, read_chunks, read_header

        try:
            f = read_header(path, identity_for(self.checkpoint, self.model, self.runner.prefill_chunk))
            kv = f.header["__metadata__"]["kv_dtype"]
            cache = self.model.new_cache(len(f.tokens), kv)
            snapshots = read_chunks(path, f, len(f.tokens), cache)
        except EntryError as e:
            raise SparrowError(f"{path}: {e}") from None
        if not self.prefix.pool.charge_new(cache):
            raise SparrowError(f"{path}: its KV does not fit in the prefix cache's budget")
        self.prefix.add(f.key, f.tokens, cache, snapshots)
        return len(f.tokens)

    @property
    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls (hermes or llama3_json), read from its chat template."""
        return tool_format(self.tokenizer.chat_template)

    def chat(
        self, messages, *, tools=None, tool_choice=None, response_format=None, parallel_tool_calls=None, **kwargs
    ) -> dict:
        """One whole chat answer, parsed: {"content", "tool_calls" (OpenAI shape, or None),
        "finish_reason"} ("tool_calls" when calls were made). Accepts the options of stream()."""
        structured = Structured.parse(tools, tool_choice, response_format, parallel_tool_calls)
        parser = structured.parser(self.tool_format)
        text, finish = [], None
        options = dict(tools=tools, tool_choice=tool_choice, response_format=response_format)
        for out in self.stream(messages, chat=True, parallel_tool_calls=parallel_tool_calls, **options, **kwargs):
            text.append(parser.push(out.text, out.finish_reason is not None)[0] if parser else out.text)
            finish = out.finish_reason
        calls = parser.calls if parser else []
        if calls and finish == "stop":
            finish = "tool_calls"
        content = "".join(text)
        return {
            "content": (content or None) if calls else content,
            "tool_calls": calls or None,
            "finish_reason": finish,
        }

    def generate(self, prompt, **kwargs) -> Iterator[str]:
        """Yields text pieces as they become final. Accepts the options of stream()."""
        for out in self.stream(prompt, **kwargs):
            if out.text:
                yield out.text


def _is_token_ids(prompt) -> bool:
    return (
        isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) > 0 and isinstance(prompt[0], (int, np.integer))
    )


def _check_activations(mode) -> None:
    from .kernels.linear import ACTIVATIONS

    if mode not in ACTIVATIONS:
        raise SparrowError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {mode!r}")


def load(
    path: str | None = None,
    kv_dtype: str = "f32",
    threads: int | None = None,
    quantize: str | None = None,
    ctx: int | None = None,
    progress: bool = False,
    activations: str | None = None,
    mmproj: str | None = None,
    prompt_cache: str | None = None,
    prompt_cache_size: int | str | None = None,
    rope_scaling: dict | None = None,
) -> LLM:
    """Loads a HF folder, a .gguf file, or (path None) the default SmolLM2-135M-Instruct GGUF.

    activations: "f32" (exact) or "q8", the faster mode: matvecs over block-quantised weights
    quantise activations to 8 bits as llama.cpp does (not exact; README, "Activations"). None
    (the default) takes the rule of models/activations.py: exact, unless exact decode of this
    model's weights would trail llama.cpp's by more than 10%; llm.activations_why says why.
    mmproj: llama.cpp's Qwen3-VL or Qwen3.5 vision projector GGUF, with its qwen3vl / qwen35 /
    qwen35moe text GGUF as path.
    prompt_cache: a folder where prompts' KV is kept across processes (state/disk.py):
    stream() reuses what an earlier run left there, bit-identically; prompt_cache_size bounds it
    (bytes, or a size such as "20G"; default 20 GiB), least recently used first out.
    rope_scaling: replaces the model's own, as if its config said so, e.g. YaRN past a Qwen3's
    native 32K: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768};
    {"rope_type": "default"} turns the model's scaling off. ctx still defaults to the model's
    max_position_embeddings (as in transformers and llama.cpp): pass ctx up to the scaled length."""
    from .config import check_rope_override
    from .models import build_model
    from .models.activations import default_activations

    # Settings are checked before the (slow) load, so a typo costs nothing.
    check_kv_dtype(kv_dtype)
    if activations is not None:
        _check_activations(activations)
    if quantize not in QUANTIZE:
        raise SparrowError(f"quantize must be 'q8_0' or None, got {quantize!r}")
    if ctx is not None and (isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 1):
        raise SparrowError(f"ctx must be a positive integer, got {ctx!r}")
    if rope_scaling is not None:
        check_rope_override(rope_scaling)
    threads = set_threads(threads)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads, user_api="blas")
    except ImportError:
        pass
    t0 = time.perf_counter()
    ckpt = open_checkpoint(os.path.expanduser(path) if path else None, os.path.expanduser(mmproj) if mmproj else None)
    ckpt.config = ckpt.config.with_rope_scaling(rope_scaling)
    why = "asked for"
    if activations is None:
        activations, why = default_activations(ckpt.tensors, quantize)
    model = build_model(ckpt, quantize=quantize, progress=progress, activations=activations)
    llm = LLM(ckpt, model, kv_dtype, threads, ctx or ckpt.config.max_position_embeddings, time.perf_counter() - t0)
    llm.activations_why = why
    if prompt_cache is not None:
        llm.prefix.disk = open_disk_cache(llm, prompt_cache, prompt_cache_size)
    return llm


def open_disk_cache(llm: LLM, folder: str, size: int | str | None = None, chunk: int | None = None):
    """The disk prefix cache in `folder` for llm's model (state/disk.py), for a runner
    whose prefill chunk is `chunk` (default llm.runner's)."""
    from .state.budget import parse_size
    from .state.disk import DEFAULT_SIZE, DiskCache, identity_for

    max_bytes = (
        DEFAULT_SIZE if size is None else parse_size(size, "prompt_cache_size") if isinstance(size, str) else int(size)
    )
    identity = identity_for(llm.checkpoint, llm.model, chunk or llm.runner.prefill_chunk)
    return DiskCache(folder, max_bytes, identity, llm.runner.model.new_cache)
