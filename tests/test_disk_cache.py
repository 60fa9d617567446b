"""The prompt cache on disk (engine/disk_cache.py): a prompt's KV written by one process is
reused after a restart and by other processes with the same tokens, logits bits and prefill
importance as a fresh prefill; damaged, truncated, foreign and half-written files are never
used; the folder stays within its size, user-only.

Engine tests cut prompts into 16-token chunks (as test_prefix_cache does) so that short prompts
cover several boundaries on the default model."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import textwrap
from dataclasses import replace

import httpx
import numpy as np
import pytest
from test_fuzz_files import tiny_gguf  # noqa: F401 - the fixture, shared
from test_kv_budget import Recording
from test_prefix_cache import _submit_one

import sparrow
from sparrow.api import open_disk_cache
from sparrow.engine.engine import Engine
from sparrow.errors import SparrowError
from sparrow.params import SamplingParams, SparseParams
from sparrow.state import disk as dc
from sparrow.state.cache import KVCache

CHUNK = 16
IDENTITY = {"format": dc.FORMAT, "sparrow": "test", "model": "m", "machine": "x", "chunk": CHUNK}


# ---------------------------------------------------------------------- files, no model needed
def _entry(kind: str, n: int = 48, seed: int = 0, layers: int = 2, heads: int = 2, dim: int = 8):
    """(identity, tokens [n], a filled cache, snapshots) as a finished request leaves them."""
    rng = np.random.default_rng(seed)
    cache = KVCache(layers, heads, dim, n + 5, kind)
    for i in range(layers):
        cache.append(i, 0, rng.standard_normal((n, heads, dim)), rng.standard_normal((n, heads, dim)))
    cache.length = n
    snaps = {b: rng.random((layers, b), dtype=np.float32) for b in range(CHUNK, n + 1, CHUNK)}
    ident = {**IDENTITY, "layers": layers, "kv_heads": heads, "head_dim": dim}
    return {k: str(v) for k, v in ident.items()}, rng.integers(0, 1000, n), cache, snaps


def _write(folder, kind="f32", n=48, key="('k', None, None)", **kw):
    ident, tokens, cache, snaps = _entry(kind, n, **kw)
    path = os.path.join(folder, dc.entry_name(key, tokens, ident))
    dc.write_entry(path, dict(ident, key=key, kv_dtype=kind), tokens, cache, snaps)
    return path, ident, tokens, cache, snaps


@pytest.mark.parametrize("kind", ["f32", "f16", "int8"])
def test_an_entry_file_reads_back_bit_for_bit_and_is_safetensors(tmp_path, kind):
    from safetensors.numpy import load_file

    path, ident, tokens, cache, snaps = _write(tmp_path, kind)
    f = dc.read_header(path, ident)
    assert f.tokens.tolist() == tokens.tolist()
    for n in (16, 48):  # any boundary of it, reading only its chunks
        out = KVCache(2, 2, 8, n, kind)
        got = dc.read_chunks(path, f, n, out)
        assert out.length == n and sorted(got) == list(range(CHUNK, n + 1, CHUNK))
        for b, imp in got.items():
            assert imp.tobytes() == snaps[b].tobytes()
        for a, b in zip(out.layers, cache.layers):
            assert a.k[:, :n].tobytes() == b.k[:, :n].tobytes() and a.v[:, :n].tobytes() == b.v[:, :n].tobytes()
            if kind == "int8":
                assert a.k_scale[:, :n].tobytes() == b.k_scale[:, :n].tobytes()
                assert a.v_scale[:, :n].tobytes() == b.v_scale[:, :n].tobytes()
    tensors = load_file(path)  # any safetensors reader maps it
    assert tensors["chunk.2.k"].shape == (2, 2, CHUNK, 8) and tensors["chunk.1.importance"].shape == (2, 32)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_damaged_and_truncated_files_are_refused_with_a_reason(tmp_path):
    path, ident, *_ = _write(tmp_path, "f16")
    (hlen,) = struct.unpack("<Q", open(path, "rb").read(8))
    data = 8 + hlen
    size = os.path.getsize(path)
    header = json.loads(open(path, "rb").read(data)[8:])
    chunk2 = header["chunk.2.v"]["data_offsets"][0]

    def reason(mutate):
        p = tmp_path / "copy.safetensors"
        p.write_bytes(open(path, "rb").read())
        mutate(str(p))
        with pytest.raises(dc.EntryError) as e:
            f = dc.read_header(str(p), ident)
            dc.read_chunks(str(p), f, 48, KVCache(2, 2, 8, 48, "f16"))
        return str(e.value)

    assert "header" in reason(lambda p: _flip(p, 8 + hlen // 2))
    assert "tokens" in reason(lambda p: _flip(p, data + 3))
    assert "chunk 2" in reason(lambda p: _flip(p, data + chunk2 + 5))
    assert "size" in reason(lambda p: os.truncate(p, size - 1))
    assert "header" in reason(lambda p: os.truncate(p, 20))
    # chunk CRCs are separate: a hit on the first two chunks does not need the damaged third
    p = tmp_path / "partial.safetensors"
    p.write_bytes(open(path, "rb").read())
    _flip(str(p), data + chunk2 + 5)
    out = KVCache(2, 2, 8, 32, "f16")
    assert sorted(dc.read_chunks(str(p), dc.read_header(str(p), ident), 32, out)) == [16, 32]


@pytest.mark.parametrize("field", ["sparrow", "model", "machine", "chunk", "format"])
def test_files_of_another_model_or_version_are_left_alone(tmp_path, field):
    path, ident, tokens, *_ = _write(tmp_path, "f32")
    other = dict(ident, **{field: "other"})
    with pytest.raises(dc.EntryError, match=f"another {field}"):
        dc.read_header(path, other)
    disk = dc.DiskCache(str(tmp_path), 1 << 30, other, lambda n, kind: KVCache(2, 2, 8, n, kind))
    assert disk.best("('k', None, None)", np.r_[tokens, 1], CHUNK) == (None, 0)
    assert disk.clear() == 0 and os.path.exists(path)  # someone else's: never deleted


def test_lru_eviction_keeps_the_folder_within_its_size(tmp_path):
    disk = dc.DiskCache(str(tmp_path), 1, {k: v for k, v in _entry("f32")[0].items()}, None)
    paths = [_write(tmp_path, "f32", seed=s)[0] for s in range(3)]
    size = os.path.getsize(paths[0])
    for i, p in enumerate(paths):
        os.utime(p, ns=(10**18 + i, 10**18 + i))
    os.utime(paths[0], ns=(2 * 10**18, 2 * 10**18))  # a hit made the oldest the most recently used
    disk.max_bytes = 2 * size
    disk.evict()
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (paths[0], paths[2]))
    assert disk.stats["evicted"] == 1


def test_a_full_disk_costs_only_the_entry(tmp_path, monkeypatch, caplog):
    ident, tokens, cache, snaps = _entry("f32")
    disk = dc.DiskCache(str(tmp_path / "c"), 1 << 30, ident, None)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dc, "write_entry", full)
    disk.save("k", tokens, cache, snaps)
    disk.flush()
    assert "the disk is full" in caplog.text and os.listdir(tmp_path / "c") == []
    assert stat.S_IMODE(os.stat(tmp_path / "c").st_mode) == 0o700


def test_a_kill_during_a_write_leaves_no_entry_and_the_next_process_cleans_up(tmp_path):
    """The writer is killed after its data is written and before the rename (fsync never
    returns): readers see no entry, and the next DiskCache on this host removes the remains."""
    script = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_disk_cache import _write
        os.fsync = lambda fd: (print("writing", flush=True), time.sleep(600))
        _write({str(tmp_path)!r}, "int8")
        """
    )
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "writing"
        names = os.listdir(tmp_path)
        assert len(names) == 1 and names[0].startswith(dc.TMP_PREFIX)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    ident = _entry("int8")[0]
    disk = dc.DiskCache(str(tmp_path), 1 << 30, ident, None)
    assert os.listdir(tmp_path) == [] and disk.best("('k', None, None)", np.arange(100), CHUNK) == (None, 0)


# ---------------------------------------------------------------------- the default model
@pytest.fixture(scope="module")
def llm(default_llm):
    return default_llm


def _disk(llm, folder):
    """A DiskCache for the engine tests' 16-token chunks (a new one: as after a restart)."""
    return dc.DiskCache(str(folder), 1 << 30, dc.identity_for(llm.checkpoint, llm.model, CHUNK), llm.model.new_cache)


CASES = [
    ("f32", None),
    ("f16", SparseParams(k=2, block=16)),
    ("int8", SparseParams(k=2, block=16, select="v2", dense_layers=0)),
    ("f32", SparseParams(k=2, block=16, prefill=True)),
]


@pytest.mark.parametrize("kv,sparse", CASES, ids=["f32-exact", "f16-seed", "int8-v2", "f32-sparse-prefill"])
def test_after_a_restart_the_disk_gives_the_fresh_prefill_bits(llm, tmp_path, kv, sparse):
    rng = np.random.default_rng(7)
    first = rng.integers(100, 40000, 90).tolist()
    second = first[:70] + rng.integers(100, 40000, 21).tolist()
    params = SamplingParams(max_tokens=5, temperature=0.7, seed=2, ignore_eos=True, logprobs=0)

    def run(ids, disk):
        runner = Recording(llm.model, CHUNK)
        engine = Engine(llm.handle, runner=runner, kv_budget=1 << 28, disk_cache=disk)
        engine.submit = _with_dtype(engine.submit, kv)
        engine.start(warmup=False)
        try:
            (out,), cached = _submit_one(engine, ids, params, sparse)
        finally:
            engine.stop()
        if disk is not None:
            disk.flush()
        return out, cached, runner

    run(first, _disk(llm, tmp_path))  # writes the first prompt's 5 chunks
    assert len(os.listdir(tmp_path)) == 1
    disk = _disk(llm, tmp_path)
    out, cached, runner = run(second, disk)  # a new process's cache: memory empty, 4 chunks on disk
    assert cached == 64 and disk.stats["hits"] == 1
    fresh, fresh_cached, off = run(second, None)
    assert fresh_cached == 0 and out == fresh
    rows = {k: v for k, v in runner.logits.items() if k[0] == tuple(second)}
    assert rows and rows.keys() == {k for k in off.logits if k[0] == tuple(second)}
    assert all(rows[k].tobytes() == off.logits[k].tobytes() for k in rows)
    assert runner.importance[tuple(second)].tobytes() == off.importance[tuple(second)].tobytes()


def _with_dtype(submit, kv):
    return lambda request, emit: submit(replace(request, kv_dtype=kv), emit)


def test_two_processes_share_one_folder(llm, tmp_path):
    """Another process writes a long prompt's KV through sparrow.load(prompt_cache=...); this
    one, opening the same folder, starts from it and answers with the same tokens and logprobs."""
    words = " ".join(f"item{i} is {i * 7 % 13}" for i in range(400))
    ids = llm.tokenizer.encode(words)[:600]
    script = textwrap.dedent(
        f"""
        import json, sparrow
        llm = sparrow.load(prompt_cache={str(tmp_path)!r})
        outs = list(llm.stream({ids!r}, max_tokens=4, temperature=0.0, logprobs=2))
        print(json.dumps([[o.token_id, o.logprob, o.cached_tokens] for o in outs]))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.splitlines()[-1])
    assert theirs[0][2] == 0 and len(os.listdir(tmp_path)) == 1  # written at exit
    llm.prefix.clear()
    llm.prefix.disk = open_disk_cache(llm, str(tmp_path))
    try:
        ours = list(llm.stream(ids, max_tokens=4, temperature=0.0, logprobs=2))
    finally:
        llm.prefix.disk = None
        llm.prefix.clear()
    assert ours[0].cached_tokens == 512
    assert [[o.token_id, o.logprob] for o in ours] == [t[:2] for t in theirs]


def test_save_prefix_and_load_prefix(llm, tmp_path):
    ids = np.random.default_rng(4).integers(100, 40000, 530).tolist()
    path = str(tmp_path / "doc.safetensors")
    llm.prefix.clear()
    assert llm.save_prefix(ids, path) == 512
    llm.prefix.clear()
    with pytest.raises(SparrowError, match="512-token chunks"):
        llm.save_prefix(ids[:100], str(tmp_path / "short.safetensors"))
    with pytest.raises(SparrowError, match="no folder"):
        llm.save_prefix(ids, str(tmp_path / "missing" / "doc.safetensors"))
    (tmp_path / "a-folder.safetensors").mkdir()  # the rename onto a folder fails: one line, no traceback
    with pytest.raises(SparrowError, match="cannot write"):
        llm.save_prefix(ids, str(tmp_path / "a-folder.safetensors"))
    assert llm.load_prefix(path) == 512
    kw = dict(max_tokens=3, temperature=0.0, logprobs=2)
    loaded = list(llm.stream(ids + [42], **kw))
    llm.prefix.clear()
    fresh = list(llm.stream(ids + [42], **kw))
    assert loaded[0].cached_tokens == 512 and fresh[0].cached_tokens == 0
    assert [(o.token_id, o.logprob, o.top_logprobs) for o in loaded] == [
        (o.token_id, o.logprob, o.top_logprobs) for o in fresh
    ]
    with pytest.raises(SparrowError, match="cannot read it"):
        llm.load_prefix(str(tmp_path / "missing.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"not json")
    with pytest.raises(SparrowError, match="header"):
        llm.load_prefix(str(tmp_path / "junk.safetensors"))
    llm.prefix.clear()


# ---------------------------------------------------------------------- the server
def test_server_save_restart_reuse_and_clear(tmp_path, tiny_gguf, default_llm, monkeypatch):  # noqa: F811
    from inprocess_server import serving

    folder = tmp_path / "cache"
    (tmp_path / "tiny.gguf").write_bytes(tiny_gguf)
    llm = sparrow.load(str(tmp_path / "tiny.gguf"))
    ids = list(range(3, 43))  # 40 tokens: 2 whole 16-token chunks
    body = {"prompt": ids + [50, 51], "max_tokens": 3, "temperature": 0.0}

    def state():
        from sparrow.engine.runner import Runner
        from sparrow.server.app import ServerState

        return ServerState(prompt_cache=str(folder), runner=Runner(llm.model, CHUNK))

    with serving(state(), llm) as base:
        r = httpx.post(base + "/v1/cache/save", json={"prompt": ids}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json() == {"object": "cache.save", "prompt_tokens": 40, "saved_tokens": 32}
        assert len(os.listdir(folder)) == 1
        chat = {"messages": [{"role": "user", "content": "the heat " * 12}], "kv_dtype": "int8"}
        r = httpx.post(base + "/v1/cache/save", json=chat, timeout=120)  # a conversation, its own KV dtype
        assert r.status_code == 200 and r.json()["saved_tokens"] >= 16, r.text
        assert len(os.listdir(folder)) == 2
        with monkeypatch.context() as m:  # a write that fails is not reported as saved
            m.setattr(dc, "write_entry", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
            r = httpx.post(base + "/v1/cache/save", json={"prompt": list(range(100, 140))}, timeout=120)
            assert r.status_code == 200 and r.json()["saved_tokens"] == 0, r.text
    with serving(state(), llm) as base:  # a restart: memory empty, the file on disk
        r = httpx.post(base + "/v1/completions", json=body, timeout=120).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        metrics = httpx.get(base + "/metrics").text
        assert "sparrow_prompt_cache_disk_hits_total 1" in metrics
        other = _disk(default_llm, folder)  # another model opening the folder: nothing there is its
        assert other.best("('f32', None, None)", np.array(body["prompt"]), CHUNK) == (None, 0)
        cleared = httpx.delete(base + "/v1/cache", timeout=60).json()
        assert cleared["object"] == "cache.cleared" and cleared["files"] == 2 and os.listdir(folder) == []
    from sparrow.engine.runner import Runner
    from sparrow.server.app import ServerState

    with serving(ServerState(runner=Runner(llm.model, CHUNK)), llm) as base:
        plain = httpx.post(base + "/v1/completions", json=body, timeout=120).json()
        assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert plain["choices"][0]["text"] == r["choices"][0]["text"]
        err = httpx.post(base + "/v1/cache/save", json={"prompt": ids}, timeout=60)
        assert err.status_code == 400 and "--prompt-cache" in err.json()["error"]["message"]
    with pytest.raises(SparrowError, match="no-prefix-cache"):
        ServerState(prompt_cache=str(folder), prefix_cache=False)


def test_generate_starts_a_later_run_from_the_folder(tmp_path, capsys):
    """`sparrow generate --prompt-cache DIR`: the second run of a long prompt prefills only the
    tail and prints the same text."""
    from sparrow.cli import main

    prompt = " ".join(f"item{i} is {i * 7 % 13}" for i in range(200))
    argv = ["generate", "-p", prompt, "-n", "4", "--timings", "--prompt-cache", str(tmp_path)]
    runs = []
    for _ in range(2):
        main(argv)
        runs.append(capsys.readouterr())
    assert "more from the prefix cache" not in runs[0].err
    assert "(1024 more from the prefix cache)" in runs[1].err, runs[1].err  # 1,335 prompt tokens
    assert runs[0].out == runs[1].out and runs[0].out.strip()


def test_bad_folder_and_size_are_one_line_errors(llm, tmp_path):
    from sparrow.server.app import ServerState

    afile = tmp_path / "a-file"
    afile.write_text("x")
    with pytest.raises(SparrowError, match="cannot create the folder|not a writable folder"):
        ServerState(prompt_cache=str(afile / "cache"))  # at start, before any model loads
    with pytest.raises(SparrowError, match="prompt_cache_size must be a size"):
        open_disk_cache(llm, str(tmp_path / "c"), "lots")
    with pytest.raises(SparrowError, match="must be positive"):
        open_disk_cache(llm, str(tmp_path / "c"), 0)
