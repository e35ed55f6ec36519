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


@pytest.mark.parametrize("seed", range(20))
def test_query_rows_equal_the_numpy_rule(seed):
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 9))
    lens = rng.integers(0, 50, batch)
    lens[rng.random(batch) < 0.2] = 0                      # empty requests
    kv = lens + rng.integers(0, 3000, batch)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pos, req = HW.query_rows(indptr, kv.astype(np.int64))
    want_req = np.repeat(np.arange(batch), lens)
    want_pos = kv[want_req] - lens[want_req] + (np.arange(lens.sum()) - indptr[:-1][want_req])
    assert pos.dtype == np.int32 and req.dtype == np.int32
    np.testing.assert_array_equal(req, want_req)
    np.testing.assert_array_equal(pos, want_pos)


@pytest.mark.parametrize("seed", range(15))
def test_prefill_rows_equal_the_numpy_rule(seed):
    """The prefill wrapper's work rows against the NumPy statements it replaced."""
    from nbattn.sched import plan
    rng = np.random.default_rng(seed)
    batch, group, tq = int(rng.integers(1, 7)), int(rng.choice([1, 4])), 16
    qo = rng.integers(0, 40, batch)
    kv = qo + rng.integers(0, 300, batch)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(-(-kv // 16))]).astype(np.int32)
    C, grid = int(rng.integers(1, 6)), 8
    p = plan(qo, kv, C, tq, group=group, causal=True, chunk_limit=int(rng.integers(20, 200)))
    slot_rows = tq // group if tq % group == 0 else tq // group + 2
    final, part, fi, pi = HW.prefill_rows(p.request, p.qo_tile, p.kv_start, p.kv_end, p.out_slot, p.cta_indptr,
                                          grid, qo_indptr, kv_indptr, tq, group, slot_rows)
    r = p.request.astype(np.int64)
    row0 = p.qo_tile.astype(np.int64) * tq
    slot = p.out_slot.astype(np.int64)
    qo_start = qo_indptr[:-1].astype(np.int64)[r]
    out_row0 = np.where(slot == -1, qo_start, slot * slot_rows - row0 // group)
    rows = np.stack([qo_start, qo[r], row0, kv_indptr[:-1][r], np.zeros_like(r), p.kv_start, p.kv_end, out_row0],
                    axis=1)
    split = slot != -1
    cta = p.item_cta()
    np.testing.assert_array_equal(final, rows[~split])
    np.testing.assert_array_equal(part, rows[split])
    for got, keep in ((fi, ~split), (pi, split)):
        want = np.zeros(grid + 1, np.int64)
        want[1:C + 1] = np.bincount(cta[keep], minlength=C)
        np.testing.assert_array_equal(got, np.cumsum(want))
    assert final.dtype == part.dtype == np.int32
