"""Qwen3-VL's 3-axis (t, h, w) rope positions of a prompt with images (transformers'
get_rope_index for still images).

Text tokens share one running index on all three axes. An image whose pads start at running
index s gets t = s, h = s + row and w = s + col on its merged grid; the text after it goes
on from s + max(rows, cols). Generated tokens continue at cache position + rope delta.
"""

from __future__ import annotations

import numpy as np

from ..errors import SparrowError


def image_runs(ids: np.ndarray, image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive image pads in ids."""
    pad = np.asarray(ids) == image_token_id
    edges = np.flatnonzero(np.diff(np.concatenate([[0], pad.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def rope_positions(
    ids: np.ndarray, image_token_id: int, grids: list[tuple[int, int, int]], merge: int
) -> tuple[np.ndarray, int, list[tuple[int, int]]]:
    """-> (positions [3, P] int64, rope delta, each image's pad run). grids: each image's
    patch grid (t, h, w), in prompt order; each image needs one run of t*h*w/merge^2 pads."""
    runs = image_runs(ids, image_token_id)
    if len(runs) != len(grids):
        raise SparrowError(f"the prompt has {len(runs)} image placeholders but {len(grids)} images were given")
    pos = np.empty((3, len(ids)), np.int64)
    cur, prev = 0, 0
    for (a, b), (t, h, w) in zip(runs, grids):
        gh, gw = h // merge, w // merge
        if b - a != t * gh * gw:
            raise SparrowError(f"an image needs {t * gh * gw} image pad tokens, the prompt has {b - a} at position {a}")
        pos[:, prev:a] = np.arange(cur, cur + a - prev)  # text before the image
        cur += a - prev
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pos[0, a:b] = tt.reshape(-1) + cur
        pos[1, a:b] = hh.reshape(-1) + cur
        pos[2, a:b] = ww.reshape(-1) + cur
        cur += max(gh, gw)
        prev = b
    pos[:, prev:] = np.arange(cur, cur + len(ids) - prev)
    delta = int(pos.max()) + 1 - len(ids) if len(ids) else 0
    return pos, delta, runs
