"""Attention kernels: decode and sparse prefill per KV head over selected blocks (decode), exact
causal prefill (prefill), their row kernels in vector IR (rows) and small f32 tiles (tile), and
block selection, the seed's and v2 (select)."""
