"""llama.cpp's side of `sparrow bench speed --shape qwen3-vl-2b --compare llama-cpp`: the same
text GGUF, mmproj and image through llama-cpp-python's libmtmd bindings (mtmd_cpp), as its
MTMDChatHandler drives them: the image encoded by mtmd_encode_chunk, the whole prompt
evaluated by mtmd_helper_eval_chunks (which encodes the image again), then single-token
decode steps at the M-RoPE position mtmd reports."""

from __future__ import annotations

import ctypes
import time

import numpy as np


def run(text: str, mmproj: str, image, prompt_text: str, threads: int, decode: int, rounds: int) -> list[dict]:
    """One dict per round: vision_ms, image_tokens, prompt_tokens, prefill_tok_s (the prompt's
    eval less the image's encode time), prompt_s (image encode + prompt eval), decode_tok_s."""
    import llama_cpp
    import llama_cpp.mtmd_cpp as M

    llm = llama_cpp.Llama(model_path=text, n_ctx=8192, n_threads=threads, n_batch=512, verbose=False)
    p = M.mtmd_context_params_default()
    p.use_gpu = False
    p.n_threads = threads
    p.print_timings = False
    ctx = M.mtmd_init_from_file(mmproj.encode(), llm.model, p)
    if not ctx:
        raise RuntimeError("llama.cpp's mtmd could not load the mmproj")
    rgb = np.ascontiguousarray(np.asarray(image.convert("RGB"), np.uint8))
    buf = (ctypes.c_uint8 * rgb.size).from_buffer_copy(rgb.tobytes())
    bmp = M.mtmd_bitmap_init(rgb.shape[1], rgb.shape[0], buf)
    marker = M.mtmd_default_marker().decode()
    prompt = prompt_text.replace("<image>", marker).encode()
    rows = []
    try:
        for r in range(rounds + 1):  # round 0 warms up
            llm.reset()
            llm._ctx.kv_cache_clear()
            chunks = M.mtmd_input_chunks_init()
            txt = M.mtmd_input_text()
            txt.text, txt.text_len, txt.add_special, txt.parse_special = prompt, len(prompt), False, True
            arr = (M.mtmd_bitmap_p_ctypes * 1)(bmp)
            if M.mtmd_tokenize(ctx, chunks, ctypes.byref(txt), arr, 1) != 0:
                raise RuntimeError("mtmd_tokenize failed")
            n_tokens = M.mtmd_helper_get_n_tokens(chunks)
            image_tokens, vision_ms = 0, 0.0
            for i in range(M.mtmd_input_chunks_size(chunks)):
                ch = M.mtmd_input_chunks_get(chunks, i)
                if M.mtmd_input_chunk_get_type(ch) == 1:  # MTMD_INPUT_CHUNK_TYPE_IMAGE
                    image_tokens = M.mtmd_input_chunk_get_n_tokens(ch)
                    t0 = time.perf_counter()
                    M.mtmd_encode_chunk(ctx, ch)
                    vision_ms = (time.perf_counter() - t0) * 1e3
            n_past = llama_cpp.llama_pos(0)
            t0 = time.perf_counter()
            rc = M.mtmd_helper_eval_chunks(ctx, llm._ctx.ctx, chunks, 0, 0, 512, True, ctypes.byref(n_past))
            prefill_s = time.perf_counter() - t0
            M.mtmd_input_chunks_free(chunks)
            if rc != 0:
                raise RuntimeError(f"mtmd_helper_eval_chunks failed ({rc})")
            llm.n_tokens = n_past.value  # M-RoPE: the next position, fewer than the tokens
            t0 = time.perf_counter()
            for i in range(decode):
                llm.eval([1000 + i])
            dec_s = time.perf_counter() - t0
            if r:
                rows.append(
                    {
                        "vision_ms": vision_ms,
                        "image_tokens": image_tokens,
                        "prompt_tokens": n_tokens,
                        # its prompt eval encodes the image again: that time (as measured just
                        # before) is taken out, so prefill compares with sparrow's text side
                        "prefill_tok_s": n_tokens / max(prefill_s - vision_ms / 1e3, 1e-9),
                        "prompt_s": prefill_s,
                        "decode_tok_s": decode / dec_s,
                    }
                )
    finally:
        M.mtmd_bitmap_free(bmp)
        M.mtmd_free(ctx)
        llm.close()
    return rows
