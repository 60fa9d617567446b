"""A sequence's state: everything a sequence keeps between forwards, and who holds its memory.

What one sequence keeps (one object per sequence, made by `model.new_cache(capacity, kv_dtype)`):
- storage.py    K/V rows of each layer in one storage kind (LayerCache: F32Layer, F16Layer,
                Int8Layer), [KVH, capacity, D] per layer, what the attention kernels read.
- sparse.py     beside each layer, what block-sparse attention keeps (SparseState): the prefill
                importance of each position and the copies sparse decode reads instead of K
                (the seed's ProbeKeys, v2's BlockSummaries, v3's KeyCodes / KeyCodes4); and thin_snapshots,
                the rule that keeps a few prefill chunk boundaries to return to.
- cache.py      KVCache: all layers of one sequence (layers[i], sparse[i], length, capacity) and
                the per-sequence interface below, with K/V's defaults.
- recurrent.py  HybridCache (Qwen3.5): K/V for the full-attention layers plus a fixed-size
                recurrent state per Gated DeltaNet layer (conv, ssm), which cannot be cut back
                like K/V rows, so it keeps copies at the positions the engine may return to.

Who holds the memory (one of each per engine):
- budget.py     KVPool: every cache charged to one budget in 32-token pages, grown geometrically.
- manager.py    KVManager: admission, growth, preemption, hand-off to the prefix cache.
- prefix.py     PrefixCache: finished prompts' caches reused on prefill chunk boundaries.
- disk.py       DiskCache: the prefix cache's entries in safetensors files that outlive the process.

The per-sequence interface. A new kind of state subclasses KVCache (or keeps its own K/V part
as HybridCache does) and overrides what it needs; the engine never asks which kind it holds.
The model writes the state in its forward; everyone else calls only this:

  length, capacity, dtype            positions held, positions allocated, the KV storage kind
  the runner (engine/runner.py)
    checkpoint(chunk)                after each whole prefill chunk, at the current length: keep
                                     what returning here later needs (HybridCache: a copy of its
                                     state, thinned by thin_snapshots); K/V: nothing
    importance_snapshot()            [L, length] prefill importance, kept beside checkpoint()
    keeping_every_row()              context around a verification forward: the model keeps a
                                     copy after each row (keep_every_row; a draft model's cache
                                     sets it for good), so rollback may stop at any row
  speculative decoding (engine/speculative.py)
    draft_mark() / drop_draft(mark)  drafting on the sequence's own cache: what to return to and
                                     the return (K/V: None and nothing; the verification rewrites
                                     the drafted rows)
    rollback(n), truncate(n)         back to n positions after a verification / on the draft
                                     model's cache; refused (SparrowError) where no copy was kept
  the KV budget and manager (budget.py, manager.py)
    bytes_at(capacity, probe)        what a cache of `capacity` positions is charged, everything
                                     it may keep included (copies, snapshots, a state's copies)
    resize(capacity), nbytes, probe_nbytes, charged (the pool's record on the cache)
  the prefix cache (prefix.py)
    copy_prefix(src, n, importance)  positions 0..n-1 of another cache of the same kind, the
                                     state as it stood at n
    truncate(n), restore_importance(importance [L, n])
  the disk cache (disk.py)
    layers[i].k / v / k_scale / v_scale   the K/V rows a file holds, per chunk
    state_parts                      names of a fixed-size state's f32 arrays (() for K/V alone);
                                     each is chunk.{j}.{name} in the file, {name}_shape in its
                                     metadata, at the boundaries the importance is kept for
    states                           {boundary: arrays in state_parts order} kept by checkpoint()
    states_at(bounds), live_state(), load_states(states, n)
                                     copies for a file queued for writing, the live arrays (shape
                                     check), the copies read back with the one at n made live

Imports: this package sits below the models (tests/test_layers.py): it imports errors, params,
version and the kernels only; the engine hands the manager what it needs (new_sequence).
"""
