"""The prefix cache on disk: prompts' KV that outlives the process, so a long document is
prefilled once and reused after a restart, by another process, or by another replica sharing
the folder, with the same bits as a fresh prefill.

What a file holds: one prefix-cache entry (prefix.Entry), i.e. the KV of a prompt's first
B positions, B a multiple of the prefill chunk, and the sparse prefill importance as it stood at
the chunk boundaries b <= B the prefix cache keeps snapshots of (sparse.thin_snapshots: the
newest and those at powers of two chunks). Those boundaries can be reused, exactly as in memory. The copies
sparse decode derives from K (the seed's probe keys, v2's block summaries) are not stored:
they are rebuilt from the loaded K on first use, with the same bits.

The format is safetensors (a little-endian u64 header length, a JSON header, then the raw
tensors), so numpy can map it and any safetensors reader can inspect it:
    tokens            I64 [B]
    chunk.{j}.k       [L, KVH, c, D] positions j*c..(j+1)*c-1 of every layer's K (c = chunk;
    chunk.{j}.v       same            F32, F16 or I8 as the KV dtype stores them)
    chunk.{j}.k_scale F32 [L, KVH, c] (int8 KV only), chunk.{j}.v_scale likewise
    chunk.{j}.importance F32 [L, (j+1)*c]: the prefill importance when the prefill stood at (j+1)*c,
                      for the boundaries listed in the metadata's `snapshots`
    chunk.{j}.{name}  F32 {name}_shape for each of the cache's state_parts (KVCache: none; a
                      hybrid model's HybridCache, Qwen3.5: conv and ssm): its fixed-size state at
                      (j+1)*c, at the same boundaries; the metadata's {name}_shape ("2,3,6144")
                      says that the file has it
Its `__metadata__` names what the bits depend on: the format, sparrow's version and a hash of
its sources, the model (model_identity), the CPU architecture, the chunk size, and the entry's
prefix-cache key (KV dtype, sparse prefill settings, input salt). A file that differs in any of
them is someone else's: it is left alone. CRC-32s cover the header, the tokens and each chunk's
tensors separately, so a hit on the first chunks reads and checks only those; a file that
fails a check is logged in one line and the prompt is prefilled as if it were absent.

Safety: files are written to a temporary name and renamed, so readers (other processes too)
never see half an entry and a kill mid-write leaves only a temporary file, removed by the next
process on this host once its writer is gone. The folder is created user-only (0700), files
0600. Eviction is least recently used (a hit touches the file's mtime) over the folder's
whole size.

Writes happen on a background thread: an entry is queued when the prefix cache takes it (the
arrays are held until written; the positions it covers are never rewritten, see
prefix.py) and written off the engine thread, which keeps streaming. So do the engine's reads
(read_async): the KV manager (manager.py) finds a hit at admission, a reader thread fills the
cache the request will own, and the request is admitted when the read is done while the
running streams keep stepping (reading a 16K-token prompt's file on the engine thread stalled
every stream for seconds). The Python API's lookups (LLM.stream, load_prefix) read in place.
"""

from __future__ import annotations

import atexit
import errno
import functools
import hashlib
import json
import logging
import os
import platform
import queue
import socket
import struct
import threading
import uuid
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from ..errors import SparrowError
from ..version import __version__
from .prefix import common_prefix

log = logging.getLogger("sparrow.prompt_cache")

FORMAT = "sparrow-prompt-cache/2"  # 2: importance only at the kept boundaries
SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
DEFAULT_SIZE = 20 * 1024**3  # bytes: --prompt-cache-size's default
_NO_CRC = "00000000"
_ST_DTYPES = {"F32": np.float32, "F16": np.uint16, "I8": np.int8, "I64": np.int64}
_STORAGE_ST = {"f32": "F32", "f16": "F16", "int8": "I8"}


# ---------------------------------------------------------------------------------- identity
@functools.cache
def _code_hash() -> str:
    """A hash of sparrow's Python sources: any change to a kernel or model file may change bits."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                h.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
                with open(path, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()[:16]


def sparrow_version() -> str:
    """The release and a hash of the sources."""
    return f"{__version__}+{_code_hash()}"


def _file_digest(path: str, h) -> None:
    """Feeds a weights file's size and its first and last MiB into h: cheap, and it tells apart
    files that share a name, metadata and size."""
    size = os.path.getsize(path)
    h.update(f"{os.path.basename(path)}:{size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))


def model_identity(checkpoint, model) -> str:
    """What a prompt's KV bits depend on besides the tokens and the prefix-cache key: the
    weights (their files and tensor metadata), the config, and how the model runs them
    (activations mode, quantisation)."""
    h = hashlib.sha256()
    for name in sorted(checkpoint.tensors):
        t = checkpoint.tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:{t.ggml_type}\n".encode())
    h.update(repr(checkpoint.config).encode())
    h.update(f"activations={getattr(model, 'activations', None)};quantize={getattr(model, 'quantize', None)}".encode())
    path = checkpoint.path
    files = (
        sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if os.path.isdir(path)
        else [path]
    )
    for f in files:
        _file_digest(f, h)
    return h.hexdigest()[:32]


# ---------------------------------------------------------------------------------- the files
@dataclass
class FileEntry:
    """An entry file of this model, as the index knows it."""

    name: str  # file name inside the folder
    key: str  # repr of the prefix-cache key
    tokens: np.ndarray  # [B] int64
    header: dict  # the parsed safetensors header
    data_start: int  # offset of the data region

    @functools.cached_property
    def bounds(self) -> set[int]:
        """The boundaries a hit may reuse: those whose importance the file holds (parsed once:
        every lookup reads them)."""
        return _bounds(self.header["__metadata__"])


class EntryError(Exception):
    """A file that cannot be used; the message is the one-line reason that is logged."""


class ReadStopped(Exception):
    """A read given up part-way (PendingRead.stop): the file is fine, nobody wants it now."""


@dataclass(eq=False)
class PendingRead:
    """A read on DiskCache's reader thread: positions 0..n-1 of `entry` into `cache`.
    `snapshots` is load's answer (None: the file is gone or damaged) once `done` is set;
    `stop` gives it up between chunks."""

    entry: FileEntry
    n: int
    cache: object
    snapshots: dict | None = None
    done: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)


def _crc_arrays(arrays, crc=0) -> int:
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1), crc)
    return crc


def _hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def _dump_header(header: dict) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def _chunk_parts(cache, j: int, c: int, snapshot) -> list[tuple[str, str, list]]:
    """(name suffix, safetensors dtype, per-row source arrays in C order) of chunk j: the rows
    are [layer][head] slices of the cache, so no [L, KVH, c, D] copy is made; snapshot is the
    importance at the chunk's end, or None where none is kept."""
    lo, hi = j * c, (j + 1) * c
    layers = cache.layers
    st = _STORAGE_ST[cache.dtype]
    parts = [
        ("k", st, [lc.k[h, lo:hi] for lc in layers for h in range(lc.n_kv_heads)]),
        ("v", st, [lc.v[h, lo:hi] for lc in layers for h in range(lc.n_kv_heads)]),
    ]
    if layers[0].scaled:
        parts.append(("k_scale", "F32", [lc.k_scale[h, lo:hi] for lc in layers for h in range(lc.n_kv_heads)]))
        parts.append(("v_scale", "F32", [lc.v_scale[h, lo:hi] for lc in layers for h in range(lc.n_kv_heads)]))
    if snapshot is not None:
        parts.append(("importance", "F32", [np.ascontiguousarray(snapshot, np.float32)]))
    state = cache.states.get(hi)  # a fixed-size state's copy at the chunk's end (KVCache.state_parts)
    if state is not None:
        parts += [(name, "F32", [a]) for name, a in zip(cache.state_parts, state)]
    return parts


def _bounds(meta: dict) -> set[int]:
    """The boundaries whose importance the file holds."""
    try:
        return {int(b) for b in meta["snapshots"].split(",") if b}
    except (KeyError, ValueError, AttributeError):
        raise EntryError("malformed snapshots list") from None


def _shapes(meta: dict, j: int, bounds: set[int], state_parts: tuple = ()) -> dict:
    """Expected shapes of chunk j's tensors, from the header's dimensions and its snapshot
    boundaries (_bounds); state_parts: the names of the reading cache's fixed-size state."""
    L, H, D, c = (int(meta[k]) for k in ("layers", "kv_heads", "head_dim", "chunk"))
    out = {"k": [L, H, c, D], "v": [L, H, c, D]}
    if (j + 1) * c in bounds:
        out["importance"] = [L, (j + 1) * c]
    if meta["kv_dtype"] == "int8":
        out["k_scale"] = out["v_scale"] = [L, H, c]
    for name in state_parts:
        if f"{name}_shape" in meta and (j + 1) * c in bounds:
            out[name] = [int(d) for d in meta[f"{name}_shape"].split(",")]
    return out


def write_entry(path: str, meta: dict, tokens: np.ndarray, cache, snapshots: dict) -> int:
    """Writes one entry (tokens [B], cache holding >= B positions, snapshots b -> [L, b] at some
    chunk boundaries b <= B, B among them) to `path` atomically: a temporary file in the same
    folder, fsync, rename. Returns its size."""
    c = int(meta["chunk"])
    B = len(tokens)
    bounds = {b for b in snapshots if b <= B and b % c == 0}
    meta = dict(meta, snapshots=",".join(map(str, sorted(bounds))))
    if cache.states:  # e.g. conv_shape, ssm_shape: the file holds a fixed-size state's parts
        first = next(iter(cache.states.values()))
        meta.update({f"{name}_shape": ",".join(map(str, a.shape)) for name, a in zip(cache.state_parts, first)})
    tokens = np.ascontiguousarray(tokens, np.int64)
    tensors = {"tokens": {"dtype": "I64", "shape": [B], "data_offsets": [0, tokens.nbytes]}}
    sources, crcs, offset = [[tokens]], [], tokens.nbytes
    for j in range(B // c):
        crc, shapes = 0, _shapes(meta, j, bounds, cache.state_parts)
        for part, dtype, rows in _chunk_parts(cache, j, c, snapshots.get((j + 1) * c)):
            shape = shapes[part]
            nbytes = int(np.prod(shape)) * np.dtype(_ST_DTYPES[dtype]).itemsize
            if sum(r.nbytes for r in rows) != nbytes:
                raise SparrowError(f"prompt cache: chunk {j} {part} holds the wrong number of bytes")
            tensors[f"chunk.{j}.{part}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            crc = _crc_arrays(rows, crc)
            sources.append(rows)
        crcs.append(_hex(crc))
    meta = dict(meta, tokens=str(B), tokens_crc=_hex(_crc_arrays([tokens])), chunk_crcs=",".join(crcs))
    header = dict(tensors, __metadata__=dict(meta, header_crc=_NO_CRC))
    header["__metadata__"]["header_crc"] = _hex(zlib.crc32(_dump_header(header)))
    blob = _dump_header(header)
    blob += b" " * (-len(blob) % 8)
    folder = os.path.dirname(path) or "."
    tmp = os.path.join(folder, f"{TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for rows in sources:
                for r in rows:
                    f.write(memoryview(np.ascontiguousarray(r)).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return 8 + len(blob) + offset


def read_header(path: str, expect: dict) -> FileEntry:
    """The header and tokens of an entry file, checked (CRCs, dimensions, and every field of
    `expect`); EntryError names what is wrong."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) != 8:
                raise EntryError("truncated header")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 64 << 20):
                raise EntryError("header length past the end of the file")
            blob = f.read(n)
            try:
                header = json.loads(blob.rstrip(b" "))
                meta = header["__metadata__"]
                stored = meta["header_crc"]
                meta["header_crc"] = _NO_CRC
                ok = _hex(zlib.crc32(_dump_header(header))) == stored
                meta["header_crc"] = stored
            except (ValueError, KeyError, TypeError) as e:
                raise EntryError(f"unreadable header ({type(e).__name__})") from None
            if not ok:
                raise EntryError("header checksum mismatch")
            for k, v in expect.items():
                if meta.get(k) != v:
                    raise EntryError(f"made for another {k} ({meta.get(k)!r}, this process has {v!r})")
            t = header["tokens"]
            B = int(meta["tokens"])
            if t != {"dtype": "I64", "shape": [B], "data_offsets": [0, 8 * B]}:
                raise EntryError("malformed tokens entry")
            last = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
            if 8 + n + last != size:
                raise EntryError(f"size {size} bytes, the header describes {8 + n + last}")
            bounds = _bounds(meta)
            c = int(meta["chunk"])
            if B not in bounds or any(b % c or not 0 < b <= B for b in bounds):
                raise EntryError("malformed snapshots list")
            tokens = np.frombuffer(f.read(8 * B), np.int64)
            if len(tokens) != B or _hex(zlib.crc32(tokens.view(np.uint8))) != meta["tokens_crc"]:
                raise EntryError("tokens checksum mismatch")
    except OSError as e:
        raise EntryError(f"cannot read it ({e.strerror or e})") from None
    return FileEntry(os.path.basename(path), meta["key"], tokens, header, 8 + n)


def read_chunks(path: str, entry: FileEntry, n: int, cache, stop: threading.Event | None = None) -> dict:
    """Reads positions 0..n-1 (n one of the file's snapshot boundaries) of `entry` into `cache`
    (capacity >= n, same dimensions and KV dtype), checking each chunk's CRC; returns the
    importance snapshots {b: [L, b]} for b <= n. EntryError when a chunk is damaged or the file
    changed; ReadStopped when `stop` is set before a chunk."""
    meta, header = entry.header["__metadata__"], entry.header
    c = int(meta["chunk"])
    crcs = meta["chunk_crcs"].split(",")
    snapshots, states = {}, {}
    try:
        with open(path, "rb") as f:
            for j in range(n // c):
                if stop is not None and stop.is_set():
                    raise ReadStopped
                crc = 0
                shapes = _shapes(meta, j, entry.bounds, cache.state_parts)
                for part in ("k", "v", "k_scale", "v_scale", "importance", *cache.state_parts):
                    if part not in shapes:
                        continue
                    t = header.get(f"chunk.{j}.{part}")
                    if t is None or t["shape"] != shapes[part]:
                        raise EntryError(f"chunk {j}: malformed {part} entry")
                    a = np.empty(t["shape"], _ST_DTYPES[t["dtype"]])
                    lo, hi = t["data_offsets"]
                    f.seek(entry.data_start + lo)
                    if hi - lo != a.nbytes or f.readinto(memoryview(a).cast("B")) != a.nbytes:
                        raise EntryError(f"chunk {j}: truncated")
                    crc = zlib.crc32(a.view(np.uint8).reshape(-1), crc)
                    if part == "importance":
                        snapshots[(j + 1) * c] = a
                        continue
                    if part in cache.state_parts:
                        states.setdefault((j + 1) * c, []).append(a)
                        continue
                    for lc, rows in zip(cache.layers, a):  # rows [KVH, c, ...]
                        getattr(lc, part)[:, j * c : (j + 1) * c] = rows
                if _hex(crc) != crcs[j]:
                    raise EntryError(f"chunk {j}: checksum mismatch")
    except OSError as e:
        raise EntryError(f"cannot read it ({e.strerror or e})") from None
    if cache.state_parts:
        if n not in states or any(a.shape != b.shape for a, b in zip(states[n], cache.live_state())):
            raise EntryError(f"no {'/'.join(cache.state_parts)} state of this model's shape at {n}")
        cache.load_states({b: tuple(st) for b, st in states.items()}, n)
    cache.length = n
    return snapshots


def entry_name(key: str, tokens: np.ndarray, identity: dict) -> str:
    h = hashlib.sha256(_dump_header(identity) + key.encode() + b"\0" + np.ascontiguousarray(tokens, np.int64).tobytes())
    return h.hexdigest()[:40] + SUFFIX


# ---------------------------------------------------------------------------------- the folder
def prepare_folder(folder: str) -> str:
    """The folder's absolute path, created user-only (0700) if missing; SparrowError if it
    cannot be used."""
    folder = os.path.abspath(os.path.expanduser(folder))
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as e:
        raise SparrowError(f"--prompt-cache {folder}: cannot create the folder ({e.strerror})") from None
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise SparrowError(f"--prompt-cache {folder}: not a writable folder")
    return folder


class DiskCache:
    """The entry files in one folder that belong to this model and this process's settings.

    identity: the metadata fields an entry must match (identity_for); new_cache(capacity,
    kv_dtype) makes a KVCache."""

    def __init__(self, folder: str, max_bytes: int, identity: dict, new_cache):
        folder = prepare_folder(folder)
        if max_bytes < 1:
            raise SparrowError(f"--prompt-cache-size must be positive, got {max_bytes}")
        self.folder, self.max_bytes = folder, int(max_bytes)
        self.identity = identity
        self.new_cache = new_cache
        self.stats = {"hits": 0, "hit_tokens": 0, "writes": 0, "write_bytes": 0, "rejected": 0, "evicted": 0}
        self._index: dict[str, FileEntry] = {}  # ours, by file name
        self._skip: dict[str, tuple] = {}  # name -> (size, mtime) of files not ours or damaged
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()  # PendingRead, for the reader thread
        self._reader: threading.Thread | None = None
        self._writer = threading.Thread(target=self._write_loop, name="sparrow-prompt-cache", daemon=True)
        self._writer.start()
        # The writer is a daemon thread; an entry queued just before exit is written first.
        atexit.register(self.flush)
        self._remove_stale_temporaries()

    # ------------------------------------------------------------------ index
    def _path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def scan(self) -> None:
        """Brings the index up to date with the folder (other processes add and evict files)."""
        try:
            names = {n for n in os.listdir(self.folder) if n.endswith(SUFFIX)}
        except OSError as e:
            log.warning("prompt cache %s: cannot list it (%s)", self.folder, e.strerror)
            return
        with self._lock:
            for n in list(self._index):
                if n not in names:
                    del self._index[n]
            for n in names - self._index.keys():
                try:
                    st = os.stat(self._path(n))
                except OSError:
                    continue
                if self._skip.get(n) == (st.st_size, st.st_mtime_ns):
                    continue
                try:
                    self._index[n] = read_header(self._path(n), self.identity)
                    self._skip.pop(n, None)
                except EntryError as e:
                    self._skip[n] = (st.st_size, st.st_mtime_ns)
                    if "made for another" in str(e):
                        log.debug("prompt cache: %s is not this model's: %s", n, e)
                    else:
                        self.stats["rejected"] += 1
                        log.warning("prompt cache: ignoring %s: %s", n, e)

    def best(self, key: str, prompt: np.ndarray, chunk: int, at_least: int = 0) -> tuple[FileEntry | None, int]:
        """The file sharing the longest reusable prefix with prompt (one of its snapshot
        boundaries, leaving at least one prompt token to run), if it is longer than at_least."""
        self.scan()
        best, n_best = None, at_least
        with self._lock:
            for e in self._index.values():
                if e.key != key:
                    continue
                n = min(common_prefix(e.tokens, prompt), len(prompt) - 1)
                n = max((b for b in e.bounds if b <= n), default=0)
                if n > n_best:
                    best, n_best = e, n
        return best, (n_best if best is not None else 0)

    def load(self, entry: FileEntry, n: int, cache, stop: threading.Event | None = None) -> dict | None:
        """Reads positions 0..n-1 of entry into cache (capacity >= n) and returns its
        importance snapshots, or None if the file is gone or damaged (logged) or `stop` was set."""
        path = self._path(entry.name)
        try:
            if entry.header["__metadata__"].get("kv_dtype") != cache.dtype:
                raise EntryError(f"holds {entry.header['__metadata__'].get('kv_dtype')} KV, not {cache.dtype}")
            snapshots = read_chunks(path, entry, n, cache, stop)
        except ReadStopped:
            return None
        except EntryError as e:
            self.stats["rejected"] += 1
            log.warning("prompt cache: ignoring %s: %s", entry.name, e)
            with self._lock:
                self._index.pop(entry.name, None)
                try:
                    st = os.stat(path)
                    self._skip[entry.name] = (st.st_size, st.st_mtime_ns)
                except OSError:
                    pass
            return None
        try:
            os.utime(path)  # least recently used is by mtime
        except OSError:
            pass
        with self._lock:  # the reader thread's loads and the engine thread's
            self.stats["hits"] += 1
            self.stats["hit_tokens"] += n
        return snapshots

    def read_async(self, entry: FileEntry, n: int, cache) -> PendingRead:
        """Queues load(entry, n, cache) for the reader thread (started on first use)."""
        read = PendingRead(entry, n, cache)
        with self._lock:
            if self._reader is None:
                self._reader = threading.Thread(target=self._read_loop, name="sparrow-prompt-cache-reader", daemon=True)
                self._reader.start()
        self._reads.put(read)
        return read

    def _read_loop(self) -> None:
        while True:
            read = self._reads.get()
            try:
                if not read.stop.is_set():
                    read.snapshots = self.load(read.entry, read.n, read.cache, read.stop)
            except Exception:  # an unexpected failure costs only the prefill the file would have saved
                log.exception("prompt cache: reading %s failed", read.entry.name)
                read.snapshots = None
            finally:
                read.done.set()

    # ------------------------------------------------------------------ writing
    def save(self, key: str, tokens: np.ndarray, cache, snapshots: dict) -> None:
        """Queues an entry for writing unless a file of this key already covers its tokens."""
        tokens = np.asarray(tokens, np.int64).copy()
        if len(tokens) % self.chunk or len(tokens) not in snapshots:
            log.debug("prompt cache: an entry without its last boundary's importance is not saved")
            return
        snaps = {b: v for b, v in snapshots.items() if b <= len(tokens) and b % self.chunk == 0}
        # The layers as they are now: a later resize moves the cache into new arrays, and these
        # keep the positions this entry covers (nothing rewrites them; prefix.py).
        # A fixed-size state's copies at the boundaries: a later turn advances the live one in place.
        frozen = SimpleNamespace(
            layers=list(cache.layers), dtype=cache.dtype, state_parts=cache.state_parts, states=cache.states_at(snaps)
        )
        self._queue.put((key, tokens, frozen, snaps))

    @property
    def chunk(self) -> int:
        return int(self.identity["chunk"])

    def _covered(self, key: str, tokens: np.ndarray) -> FileEntry | None:
        with self._lock:
            for e in self._index.values():
                if e.key == key and len(e.tokens) >= len(tokens) and common_prefix(e.tokens, tokens) == len(tokens):
                    return e
        return None

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                self._write(*item)
            except Exception:  # a failed write costs only a future prefill
                log.exception("prompt cache: writing an entry failed")
            finally:
                self._queue.task_done()

    def _write(self, key, tokens, cache, snapshots) -> None:
        self.scan()
        held = self._covered(key, tokens)
        if held is not None:
            try:
                os.utime(self._path(held.name))
            except OSError:
                pass
            return
        meta = dict(self.identity, key=key, kv_dtype=cache.dtype)
        name = entry_name(key, tokens, self.identity)
        try:
            size = write_entry(self._path(name), meta, tokens, cache, snapshots)
        except OSError as e:
            why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
            log.warning("prompt cache: not saving a %d-token prompt: %s", len(tokens), why)
            return
        self.stats["writes"] += 1
        self.stats["write_bytes"] += size
        self.scan()
        with self._lock:  # entries the new one covers are superseded
            gone = [
                e.name
                for e in self._index.values()
                if e.name != name
                and e.key == key
                and len(e.tokens) < len(tokens)
                and common_prefix(e.tokens, tokens) == len(e.tokens)
            ]
        for n in gone:
            self._unlink(n)
        self.evict()

    def flush(self) -> None:
        """Waits until every queued entry is written."""
        self._queue.join()

    # ------------------------------------------------------------------ eviction
    def _unlink(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except OSError:
            pass  # another process evicted it first
        with self._lock:
            self._index.pop(name, None)

    def evict(self) -> None:
        """Deletes the least recently used entry files (any model's) until the folder fits."""
        files = []
        for n in os.listdir(self.folder):
            if n.endswith(SUFFIX):
                try:
                    st = os.stat(self._path(n))
                except OSError:
                    continue
                files.append((st.st_mtime_ns, st.st_size, n))
        total = sum(s for _, s, _ in files)
        for _, size, n in sorted(files):
            if total <= self.max_bytes:
                break
            self._unlink(n)
            self.stats["evicted"] += 1
            total -= size

    def clear(self) -> int:
        """Deletes every entry file of this model; returns how many."""
        self.flush()
        self.scan()
        with self._lock:
            names = list(self._index)
        for n in names:
            self._unlink(n)
        return len(names)

    def metrics(self) -> dict:
        """The counters /metrics shows (engine.py publishes them with the KV figures)."""
        s = self.stats
        return {
            "disk_hits": s["hits"],
            "disk_hit_tokens": s["hit_tokens"],
            "disk_writes": s["writes"],
            "disk_write_bytes": s["write_bytes"],
            "disk_rejected": s["rejected"],
            "disk_evictions": s["evicted"],
        }

    def _remove_stale_temporaries(self) -> None:
        """Temporary files this host's dead processes left (a kill mid-write)."""
        host = socket.gethostname()
        for n in os.listdir(self.folder):
            if not n.startswith(f"{TMP_PREFIX}{host}-"):
                continue
            try:
                pid = int(n[len(TMP_PREFIX) + len(host) + 1 :].split("-")[0])
                os.kill(pid, 0)
            except ProcessLookupError:
                try:
                    os.unlink(self._path(n))
                except OSError:
                    pass
            except (ValueError, OSError):
                continue


def identity_for(llm_checkpoint, model, chunk: int) -> dict[str, str]:
    """The metadata an entry of this model must carry (DiskCache's identity), as the strings a
    safetensors header holds."""
    c = model.config
    identity = {
        "format": FORMAT,
        "sparrow": sparrow_version(),
        "model": model_identity(llm_checkpoint, model),
        "machine": platform.machine(),
        "chunk": chunk,
        "layers": len(c.full_attention_layers),  # the layers with K/V
        "kv_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
    }
    return {k: str(v) for k, v in identity.items()}
