"""The engines `sparrow bench speed` drives side by side: sparrow's runner and llama.cpp
(llama-cpp-python), each prefilling a prompt and decoding a fixed token feed, and one pass of
every decode mode over the contexts."""

import os
import statistics
import time
from contextlib import contextmanager

import numpy as np

from sparrow.engine.runner import PREFILL_CHUNK as CHUNK  # llama.cpp's n_batch matches sparrow's chunk
from sparrow_lab.bench.host import load_avg, machine_counters

# decode modes: (KV cache dtype, sparse top-k?, activations); the q8 ones with --activations q8
MODES = {
    "exact": ("f32", False, "f32"),
    "sparse": ("f32", True, "f32"),
    "f16": ("f16", False, "f32"),
    "sparse_f16": ("f16", True, "f32"),
    "int8": ("int8", False, "f32"),
    "sparse_int8": ("int8", True, "f32"),
    "q8_f16": ("f16", False, "q8"),
    "sparse_q8_f16": ("f16", True, "q8"),
}


SPLIT_STEPS = 4  # staged steps timed stage by stage after each fused measurement


class SparrowRunner:
    name = "sparrow"

    def __init__(self, path, threads, capacity, select="seed"):
        from sparrow.api import load
        from sparrow.models.activations import default_activations

        self.select = select  # the block selector of the sparse modes
        self.llm = load(path, threads=threads, activations="f32")
        # the mode a user of this file gets on this CPU, and why (the bench times both modes)
        self.default_activations = default_activations(self.llm.checkpoint.tensors)
        self.model = self.llm.model
        self._llms = {"f32": self.llm}  # activations mode -> the LLM whose model runs it (_llm)
        self.cache = self.model.new_cache(capacity, "f32")
        self.cache_q8 = None  # the q8 mode's prefill rows write here (prefill(act="q8"))
        self.capacity = capacity

    def prefill(self, tokens, start, act="f32"):
        """Prefills tokens at positions start.. (the cache is rewound to start first); act
        "q8" times the q8 mode's prefill into a cache of its own, so the decode rows keep
        starting from the exact one."""
        from sparrow.engine.runner import Slot

        if act == "q8" and self.cache_q8 is None:
            self.cache_q8 = self.model.new_cache(self.capacity, "f32")
        cache = self.cache_q8 if act == "q8" else self.cache
        cache.truncate(start)
        # positions below start are in the cache already; the slot only needs their count
        prompt = np.concatenate([np.zeros(start, np.int64), np.asarray(tokens, np.int64)])  # [start + T]
        t0 = time.perf_counter()
        self._llm(act).runner.prefill(Slot(prompt, cache))
        return time.perf_counter() - t0

    def _llm(self, act):
        """The LLM in activations mode act: the loaded one, or (q8) a model built from the same
        checkpoint once, with its weights prepared for that mode."""
        if act not in self._llms:
            self._llms[act] = self.llm.with_activations(act)
        return self._llms[act]

    def _copy(self, n, kv_dtype):
        if kv_dtype == "f32":
            return self.cache
        c = self.model.new_cache(self.capacity, kv_dtype)
        for i, src in enumerate(self.cache.layers):
            c.append(i, 0, src.k[:, :n].transpose(1, 0, 2), src.v[:, :n].transpose(1, 0, 2))  # [n, KVH, D]
            c.sparse[i].importance[:n] = self.cache.sparse[i].importance[:n]
        c.length = n
        if c.state_parts:  # a hybrid model's recurrent state at n (Qwen3.5)
            c.load_states({n: self.cache.live_state()}, n)
        return c

    @staticmethod
    def _rewind(cache, mark, start) -> None:
        cache.drop_draft(mark)
        cache.truncate(start)

    def decode(self, feed, start, mode="exact", sparse_k=32):
        """Per-token seconds of len(feed) decode steps after start (the path users get: the
        fused step where the model allows it), then the time split (ms) of SPLIT_STEPS more
        steps on the staged path, whose stages can be timed (the fused step is one call)."""
        from sparrow.engine.runner import Slot
        from sparrow.models.timing import timed
        from sparrow.params import SparseParams

        kv_dtype, sparse, act = MODES[mode]
        cache = self._copy(start, kv_dtype)
        sp = SparseParams(k=sparse_k, select=self.select) if sparse else None
        slot = Slot(np.zeros(start, np.int64), cache, sp)
        times, parts = [], []
        runner = self._llm(act).runner
        mark = cache.draft_mark()  # a recurrent state returns to start with its copy (K/V: truncate)
        for tok in feed:
            t0 = time.perf_counter()
            runner.decode([slot], [tok])
            times.append(time.perf_counter() - t0)
        self._rewind(cache, mark, start)
        for tok in feed[:SPLIT_STEPS]:
            with timed(self.model) as timer:
                self.llm.runner.decode([slot], [tok])
            parts.append((timer.total, timer.matmul, timer.attn, timer.total - timer.matmul - timer.attn))
        self._rewind(cache, mark, start)
        if cache is not self.cache:
            self.cache.truncate(start)
        # medians per component, like the per-token time (a one-off stall does not count)
        split = {
            k: statistics.median(p[j] for p in parts) * 1e3
            for j, k in enumerate(("staged_ms", "matmul_ms", "attention_ms", "other_ms"))
        }
        split["fused"] = self.model.fused_step() is not None
        kv = {
            "kv_bytes_per_token": cache.nbytes / cache.capacity,
            "probe_copy_bytes_per_token": cache.probe_nbytes / cache.capacity,
        }
        return times, split, kv

    def stream(self, ids, n_decode, sparse_k=None):
        """One request through LLM.stream, as users and the server meet decode: prefill of the
        prompt (from the prefix cache where LLM.stream's entry covers it), then n_decode tokens.
        Returns {"prefill_s", "ms" (median decode step), "end_ms" (from the last token to the
        stream's end), "loop_tok_s" (tokens after the first over the time from the first token to
        the end), "cached_tokens"} and what the machine did during the decode steps (minor page
        faults, involuntary context switches, CPU time stolen by the hypervisor), which tell an
        environmental slowdown from the engine's."""
        from sparrow.params import SamplingParams, SparseParams

        sp = SparseParams(k=sparse_k, select=self.select) if sparse_k else None
        params = SamplingParams(max_tokens=n_decode + 1, temperature=0.0, ignore_eos=True)
        times, first, cached, before, after = [], None, 0, None, None
        t0 = time.perf_counter()
        for out in self.llm.stream([int(t) for t in ids], sampling=params, sparse=sp):
            t1 = time.perf_counter()
            if first is None:
                first, cached, before = t1 - t0, out.cached_tokens or 0, machine_counters()
            else:
                times.append(t1 - t0)
                after = machine_counters()  # at the last token: not the prefix-cache insert that ends a stream
            t0 = time.perf_counter()
        end = time.perf_counter() - t0  # from the last token to the stream's end (LLM.stream's prefix-cache insert)
        return {
            "prefill_s": first,
            "ms": statistics.median(times) * 1e3,
            "end_ms": end * 1e3,
            "loop_tok_s": len(times) / (sum(times) + end),  # what a loop over the stream sees after its first token
            "cached_tokens": cached,
            "during_decode": {k: after[k] - before[k] for k in after},
        }


@contextmanager
def _extra_bufts(on: bool):
    """llama-cpp-python's Llama() takes its model parameters from llama_model_default_params()
    and has no argument for use_extra_bufts: with on False, the defaults it reads say False."""
    if on:
        yield
        return
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params

    def without():
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = without
    try:
        yield
    finally:
        lib.llama_model_default_params = default


class LlamaRunner:
    name = "llama.cpp"

    def __init__(self, path, threads, capacity, flash_attn=False, repack=True, draft_model=None):
        from llama_cpp import Llama

        # the bindings' defaults except the thread count (their default is cpu_count // 2 for
        # decode); n_batch 512 is their default too. flash attention only when asked for.
        # repack=False turns off ggml's CPU repack buffer (use_extra_bufts), which copies every
        # matrix it has interleaved kernels for (q4_0, q4_k, ...) into memory of its own at load:
        # without it llama.cpp reads the weights from its file mapping, as sparrow does.
        # draft_model: the bindings' speculation (llama_cpp.llama_speculative), which Llama.generate
        # uses; it needs every row's logits, and the bindings size their logits array by the
        # logits_all argument (not by the draft model), so it is passed as True.
        kw = {"flash_attn": True} if flash_attn else {}
        if draft_model is not None:
            kw["draft_model"] = draft_model
        with _extra_bufts(repack):
            self.llm = Llama(
                model_path=path,
                n_ctx=capacity,
                n_threads=threads,
                n_threads_batch=threads,
                n_batch=CHUNK,
                logits_all=draft_model is not None,
                verbose=False,
                **kw,
            )
        self.settings = self.describe(self.llm)

    @staticmethod
    def describe(llm) -> dict:
        """The context settings llama.cpp actually runs with (flash attention, KV types, batch)."""
        import gguf

        cp = llm.context_params

        def ggml(t):
            try:
                return gguf.GGMLQuantizationType(int(t)).name.lower()
            except ValueError:
                return str(int(t))

        fa = getattr(cp, "flash_attn_type", None)
        if fa is None:
            fa = str(getattr(cp, "flash_attn", "?"))
        else:
            fa = {-1: "auto", 0: "off", 1: "on"}.get(int(fa), str(fa))
        return {
            "flash_attn": fa,
            "type_k": ggml(cp.type_k),
            "type_v": ggml(cp.type_v),
            "n_batch": int(cp.n_batch),
            "n_ubatch": int(cp.n_ubatch),
            "n_threads": int(cp.n_threads),
            "n_threads_batch": int(cp.n_threads_batch),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "unset (OpenMP default)",
            "repack": bool(llm.model_params.use_extra_bufts),
        }

    def prefill(self, tokens, start):
        self.llm.n_tokens = start  # eval drops cache entries from n_tokens on
        t0 = time.perf_counter()
        self.llm.eval([int(t) for t in tokens])
        return time.perf_counter() - t0

    def decode(self, feed, start, mode="exact", sparse_k=32):
        # A recurrent model's memory (qwen35) cannot drop positions: the context is saved
        # before the timed steps and loaded back after them (outside the timing)
        saved = self.llm.save_state() if self._recurrent() else None
        self.llm.n_tokens = start
        times = []
        for tok in feed:
            t0 = time.perf_counter()
            self.llm.eval([int(tok)])
            times.append(time.perf_counter() - t0)
        if saved is not None:
            self.llm.load_state(saved)
        self.llm.n_tokens = start
        return times, None, None

    def _recurrent(self) -> bool:
        return self.llm.metadata.get("general.architecture") in ("qwen35", "qwen35moe")


def random_ids(rng, config, n) -> np.ndarray:
    """n random token ids, valid in small test vocabularies too."""
    top = min(40000, config.vocab_size)
    return rng.integers(min(100, top // 2), top, n)


def run_pass(runner, prompt, contexts, feed, modes, sparse_k, stream_rng=None):
    """One prefill of the prompt, decoding at each context; {C: measurements}. With stream_rng
    (sparrow only), each context also gets the STREAM_ROWS: a fresh random prompt of C tokens
    through LLM.stream, then the same prompt again (from the prefix cache), exact and sparse."""
    out, pos, pre, pre_q8 = {}, 0, 0.0, 0.0
    q8 = any(MODES[m][2] == "q8" for m in modes)
    for c in contexts:
        pre += runner.prefill(prompt[pos:c], pos)
        rec = {"prefill_s": pre, "load_prefill": load_avg()}
        if q8:
            pre_q8 += runner.prefill(prompt[pos:c], pos, "q8")
            rec["prefill_q8_s"] = pre_q8
        pos = c
        for mode in modes:
            times, split, kv = runner.decode(feed, c, mode, sparse_k)
            rec[mode] = {"ms": statistics.median(times) * 1e3, "split": split, "kv": kv, "load": load_avg()}
        if stream_rng is not None:
            for sparse in (False, True):
                ids = random_ids(stream_rng, runner.model.config, c)
                k = sparse_k if sparse else None
                name = "sparse" if sparse else "exact"
                rec[f"stream_{name}_fresh"] = runner.stream(ids, len(feed), k)
                rec[f"stream_{name}_cached"] = runner.stream(ids, len(feed), k)
        out[c] = rec
    return out
