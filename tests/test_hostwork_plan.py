"""The compiled host work of plan(): staging with joined copies, the "split" plan's
chunks and the KV lengths, each against a plain NumPy statement of the same rule."""
from __future__ import annotations

import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn import layout as L
from nbattn.cuda.host import hostwork as HW


@pytest.mark.parametrize("seed", range(30))
def test_stage_arrays_writes_every_array_and_joins_close_spans(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    sizes = rng.integers(0, 40, n)
    gaps = rng.integers(0, 60, n)
    offsets, off = [], 0
    for s, g in zip(sizes, gaps):
        off += int(g)
        offsets.append(off)
        off += int(s)
    arrays = tuple(rng.integers(-99, 99, int(s)).astype(np.int32) for s in sizes)
    host = np.full(off + 8, 12345, np.int32)
    gap = int(rng.integers(0, 50))
    spans = HW.stage_arrays(host, np.array(offsets, np.int64), arrays, gap)
    want = np.full_like(host, 12345)
    for o, a in zip(offsets, arrays):
        want[o:o + a.size] = a
    np.testing.assert_array_equal(host, want)
    # the spans cover every written word, do not overlap, and are split exactly where a gap exceeds `gap`
    ranges = [(o, o + a.size) for o, a in zip(offsets, arrays) if a.size]
    joined: list = []
    for a, b in ranges:
        if joined and a - joined[-1][1] <= gap:
            joined[-1][1] = b
        else:
            joined.append([a, b])
    assert spans == joined


@pytest.mark.parametrize("seed", range(20))
def test_split_plan_equals_the_numpy_rule(seed):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 5000, int(rng.integers(1, 9)))
    lens[rng.random(lens.size) < 0.2] = 0
    splits = int(rng.integers(1, 17))
    request, start, end, largest = HW.split_plan(lens.astype(np.int32), splits)
    chunk = np.maximum(16, -(-(-(-lens // splits)) // 16) * 16)
    j = np.tile(np.arange(splits), lens.size)
    r = np.repeat(np.arange(lens.size), splits)
    want_start = np.minimum(j * chunk[r], lens[r])
    np.testing.assert_array_equal(request, r)
    np.testing.assert_array_equal(start, want_start)
    np.testing.assert_array_equal(end, np.minimum(want_start + chunk[r], lens[r]))
    assert largest == int(chunk.max(initial=16))
    # every key of every request is in exactly one chunk
    for q in range(lens.size):
        covered = np.zeros(lens[q], int)
        for a, b in zip(start[request == q], end[request == q]):
            covered[a:b] += 1
        assert np.all(covered == 1)


@pytest.mark.parametrize("seed", range(10))
def test_kv_lengths_equals_the_layout_rule(seed):
    rng = np.random.default_rng(seed)
    page = int(rng.integers(1, 17))
    lens = rng.integers(0, 300, int(rng.integers(0, 12)))
    pkv = L.PagedKV.allocate(lens, page, rng=rng)
    np.testing.assert_array_equal(
        HW.kv_lengths(pkv.paged_kv_indptr, pkv.paged_kv_last_page_len, page),
        L.kv_lengths(pkv.paged_kv_indptr, pkv.paged_kv_last_page_len, page))
