"""plan() of the decode wrapper with two ways of writing the staging image, alternated in
one process on a GPU: ``new`` (``hostwork.stage_arrays``, ``np.copyto`` per array) and
``old`` (the compiled element loop it replaced).  Batch 1, 64 and 1024, lengths 1..8191,
page 16; median of 200 calls, three rounds.

    PYTHONPATH=$PWD python3 benchmarks/plan_stage_ab.py
"""
import os
import sys

import numpy as np
from numba import njit

import nbattn  # noqa: F401  (compat before numba.cuda)
import nbattn.cuda as NC
import torch
from nbattn import layout as L
from nbattn.cuda.host import hostwork as HW

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import host_us  # noqa: E402


@njit(cache=False)
def old(host, offsets, arrays, gap):
    """The compiled writer before 2026-12-06 (one element loop per array)."""
    n = len(arrays)
    spans = np.empty((n, 2), np.int64)
    k = 0
    for i in range(n):
        a = arrays[i]
        first = offsets[i]
        last = first + a.shape[0]
        host[first:last] = a
        if last == first:
            continue
        if k > 0 and first - spans[k - 1, 1] <= gap:
            spans[k - 1, 1] = max(spans[k - 1, 1], last)
        else:
            spans[k, 0] = first
            spans[k, 1] = last
            k += 1
    return spans[:k]


def main():
    new = HW.stage_arrays
    rng = np.random.default_rng(5)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for batch in (1, 64, 1024):
        pkv = L.PagedKV.allocate(rng.integers(1, 8192, size=batch), 16, rng=rng)
        w = NC.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")

        def fn():
            w.plan(pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len, 32, 8, 128, 16)
        for rnd in range(3):
            for name, writer in (("new", new), ("old", old)):
                HW.stage_arrays = writer
                print(batch, rnd, name, round(host_us(fn), 1), flush=True)
    HW.stage_arrays = new


if __name__ == "__main__":
    main()
