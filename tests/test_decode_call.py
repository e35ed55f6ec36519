"""The plain batch_decode_paged on the launch layer (device inputs), in the simulator:
bound launches reused across calls with other lengths, batch sizes, scales and
variants must still give the golden model's answer, and the call's Python work
must not grow with the batch."""
from __future__ import annotations

import numpy as np
import pytest

import nbattn  # noqa: F401
from nbattn import reference as R
from nbattn.cuda import decode_call as DC
from nbattn.cuda import batch_decode_paged
from numba import cuda

from brute import random_paged_batch


def _batch(rng, lens, dtype=np.float16, group=2):
    b = random_paged_batch(rng, qo_lens=[1] * len(lens), kv_lens=lens, page_size=4, num_kv_heads=2,
                           group=group, head_dim=16, share_first_page=True)
    b["q"], b["cache"] = b["q"].astype(dtype), b["cache"].astype(dtype)
    return b


def _run(b, **kw):
    sig = kw.get("use_sigmoid", False)
    res = batch_decode_paged(cuda.to_device(b["q"]), cuda.to_device(b["cache"]), b["indptr"], b["indices"],
                             b["last"], return_lse=not sig, **kw)
    o, lse = (res, None) if sig else res
    o = o.copy_to_host()
    return o.view(b["q"].dtype) if o.dtype != b["q"].dtype else o, None if sig else lse.copy_to_host()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_device_inputs_match_golden_across_calls(dtype):
    rng = np.random.default_rng([71, np.dtype(dtype).itemsize])
    cases = [([0, 37, 5, 90], {}), ([300], {}),                     # unsplit, then split + merge
             ([12, 1], dict(sm_scale=0.2)),                          # same kernel, another scale
             ([250, 3, 0], dict(window_left=6, sink_size=1, logits_soft_cap=4.0)),
             ([41], dict(pos_encoding_mode="ALIBI")), ([200, 7], dict(use_sigmoid=True, sigmoid_bias=-1.0))]
    for lens, kw in cases:
        b = _batch(rng, lens, dtype)
        o, lse = _run(b, **kw)
        ro = R.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"],
                                  return_lse=lse is not None, dtype=np.float64, **kw)
        if lse is not None:
            ro, rlse = ro
            assert np.array_equal(np.isneginf(lse), np.isneginf(rlse))
            fin = np.isfinite(rlse)
            np.testing.assert_allclose(lse[fin], rlse[fin], atol=1e-3, rtol=1e-3)
        tol = 4e-3 if dtype == np.float16 else 1e-4
        np.testing.assert_allclose(o.astype(np.float64), ro, atol=tol * (1 + np.abs(ro).max()), rtol=tol)


def test_decode_work_equals_the_rule_and_the_loop():
    """hostwork.decode_work against decode.choose_chunk + decode.split_work (the loop):
    the same chunk, the same work list and reduction map (a sliding window's first
    visible key included), the page table copied, every
    array at its 16-byte aligned offset; a buffer too short is left untouched."""
    from nbattn import layout as L
    from nbattn.cuda.host import hostwork as HW
    from nbattn.cuda.decode import split_work
    from nbattn.cuda.decode_problem import first_visible
    rng = np.random.default_rng(72)
    for trial in range(300):
        ps = int(rng.choice([1, 4, 16]))
        lens = rng.integers(0, 400, size=int(rng.integers(1, 30)))
        lens[rng.random(lens.size) < 0.2] = 0                               # empty requests
        pkv = L.PagedKV.allocate(lens, ps, rng=rng)
        ctas, slots = int(rng.integers(1, 80)), int(rng.integers(1, 120))
        grain, floor = int(rng.choice([1, 16, 32])), int(rng.choice([1, 16, 64]))
        edge = int(rng.choice([-1, int(rng.integers(0, 300))]))            # a sliding window, or none
        first = first_visible(lens, edge, grain)
        assert (first % grain == 0).all() and (first <= np.maximum(lens - 1 - max(edge, 0), 0)).all()
        longest = int((lens - first).max())
        chunk = None                                           # decode.choose_chunk's arithmetic
        if ctas < slots and longest > 0:
            c = max(floor, -(-longest // max(1, slots // ctas)))
            c = -(-c // grain) * grain
            chunk = None if c >= longest else c
        want = split_work(lens, chunk, first)
        tables = (pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len)
        short = np.full(8, 7, np.int32)
        info = HW.decode_work(*tables, ps, ctas, slots, grain, floor, edge, short)
        if info[0] > short.size:
            assert (short == 7).all()
        buf = np.full(int(info[0]) + int(rng.integers(0, 9)), -99, np.int32)
        info = HW.decode_work(*tables, ps, ctas, slots, grain, floor, edge, buf)
        assert info[5] == (chunk or 0)
        offs, lens_out = info[6:17], info[17:28]
        got = [buf[o:o + n] for o, n in zip(offs, lens_out)]
        assert all(o % 4 == 0 for o in offs)
        for x, y in zip(tables + want[:-1], got):
            np.testing.assert_array_equal(x, y)
        assert info[1] == want[1].size and info[2] == want[-1] and info[3] == want[6].size
        assert info[4] == (int(np.diff(want[5]).max()) if want[6].size else 0)


def test_page_table_ok_agrees_with_validate():
    """hostwork.page_table_ok is True exactly where PagedKV.validate accepts, over
    random tables with one rule broken at a time (or none), and page_table_check
    returns the table's largest page id exactly then."""
    from nbattn import layout as L
    from nbattn.cuda.host import hostwork as HW
    rng = np.random.default_rng(75)
    for trial in range(400):
        ps = int(rng.choice([1, 4, 16]))
        lens = rng.integers(0, 60, size=int(rng.integers(0, 8)))
        pkv = L.PagedKV.allocate(lens, ps, num_pages=int(-(-lens // ps).sum()) + 3, rng=rng)
        indptr, indices = pkv.paged_kv_indptr.copy(), pkv.paged_kv_indices.copy()
        last, num_pages = pkv.paged_kv_last_page_len.copy(), pkv.num_pages
        fault = int(rng.integers(0, 10))
        if fault == 1 and indptr.size:
            indptr[0] = 1
        elif fault == 2 and indptr.size > 2:
            indptr[1], indptr[2] = indptr[2], max(indptr[1] - 1, 0)
        elif fault == 3:
            indptr = np.append(indptr, indptr[-1] + 1).astype(np.int32)
        elif fault == 4 and indices.size:
            indices[rng.integers(indices.size)] = rng.choice([-1, num_pages, num_pages + 5])
        elif fault == 5 and last.size:
            last[rng.integers(last.size)] = rng.choice([0, ps + 1, -2, 3])
        elif fault == 6:
            last = np.append(last, 1).astype(np.int32)
        elif fault == 7:
            indptr = np.zeros(0, np.int32)
        elif fault == 8:        # pages of 2**30 slots: a request of 3 pages or more passes int32
            ps = 1 << 30
        try:
            L.PagedKV.validate(indptr, indices, last, ps, num_pages)
            ok = True
        except L.LayoutError:
            ok = False
        assert HW.page_table_ok(indptr, indices, last, ps, num_pages) == ok, (fault, indptr, indices, last)
        # page_table_check: the largest page id of a valid table (-1 without pages), -2 otherwise
        top = HW.page_table_check(indptr, indices, last, ps, num_pages)
        assert top == ((int(indices.max()) if indices.size else -1) if ok else -2), (fault, top)


@pytest.mark.skipif(not __import__("nbattn").simulator_enabled(), reason="counts the simulator's Python calls; on a GPU numba's allocator adds calls of its own")
def test_python_work_does_not_grow_with_the_batch(monkeypatch):
    import sys
    from nbattn.cuda.host import driver as _driver
    monkeypatch.setattr(_driver.BoundLaunch, "__call__", lambda self, stream=0: None)
    rng = np.random.default_rng(73)
    counts = []
    for n in (3, 60):
        b = _batch(rng, list(rng.integers(1, 12, size=n)))
        q, cache = cuda.to_device(b["q"]), cuda.to_device(b["cache"])
        batch_decode_paged(q, cache, b["indptr"], b["indices"], b["last"])         # binds
        calls = []

        def prof(frame, event, arg):
            # dataclass __eq__ runs where a cache lookup meets an equal, not identical, key: a
            # constant number of times, not once per request
            if event == "call" and frame.f_code.co_name != "__eq__":
                calls.append(frame.f_code.co_name)
        sys.setprofile(prof)
        try:
            batch_decode_paged(q, cache, b["indptr"], b["indices"], b["last"])
        finally:
            sys.setprofile(None)
        counts.append(len(calls))
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("form", ["decode", "prefill"])
def test_threads_calling_at_once_each_get_their_own_answer(form, monkeypatch):
    """Plain calls share their bound launches and staging ring across threads.  A
    pause between patching a launch and launching it (widened here on purpose)
    must not let another thread's pointers in: each call, made from its own
    thread with its own inputs of one call shape, must match the golden model."""
    import threading
    import time
    from nbattn.cuda.host import driver as _driver
    from nbattn.cuda import prefill as P
    launch = _driver.BoundLaunch.__call__

    def slow_launch(self, stream=0):
        time.sleep(0.02)                                 # another thread may run here
        return launch(self, stream)

    monkeypatch.setattr(_driver.BoundLaunch, "__call__", slow_launch)
    rng = np.random.default_rng(74)
    if form == "decode":
        batches = [_batch(rng, [9, 14], np.float32) for _ in range(4)]
        run = lambda b: _run(b)[0]                                          # noqa: E731
        gold = lambda b: R.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"],  # noqa: E731
                                              b["last"], dtype=np.float64)
    else:
        batches = [{x: rng.standard_normal(s).astype(np.float32) for x, s in
                    (("q", (5, 4, 16)), ("k", (9, 2, 16)), ("v", (9, 2, 16)))} for _ in range(4)]
        run = lambda b: np.asarray(P.single_prefill(b["q"], b["k"], b["v"], causal=True))  # noqa: E731
        gold = lambda b: R.single_prefill(b["q"], b["k"], b["v"], causal=True, dtype=np.float64)  # noqa: E731
    run(batches[0])                                      # bind once, outside the threads
    got: dict = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, run(batches[i]))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, b in enumerate(batches):
        np.testing.assert_allclose(got[i].astype(np.float64), gold(b), atol=1e-4, rtol=1e-4)


def test_a_repeated_signature_skips_the_checks_but_never_the_page_table(monkeypatch):
    """A call whose inputs look as an earlier call's did reuses its checks' decisions
    (one _checked_call for many calls), yet every call's page table is checked: a bad
    page id or a batch that no longer matches q is refused with the rule's message
    before any launch, and other variants or scales on the same shapes get their own answers."""
    from nbattn import layout as L
    from nbattn.cuda.host import driver as D
    checked, launches = [], []
    real_checked, real_call = DC._checked_call, D.BoundLaunch.__call__
    monkeypatch.setattr(DC, "_checked_call", lambda *a, **k: checked.append(1) or real_checked(*a, **k))
    monkeypatch.setattr(D.BoundLaunch, "__call__", lambda self, s=0: launches.append(1) or real_call(self, s))
    DC._CALLS.clear()
    rng = np.random.default_rng(20261204)
    P, page, hk, group, d = 96, 4, 2, 2, 16
    cache_h = rng.standard_normal((P, 2, page, hk, d)).astype(np.float16)
    cache = cuda.to_device(cache_h)                   # one cache for every call, as a server has

    def table(lens):
        n = [-(-x // page) for x in lens]
        ids = rng.choice(P, sum(n), replace=False).astype(np.int32)
        last = np.array([x - page * (k - 1) if k else 0 for x, k in zip(lens, n)], np.int32)
        return np.concatenate([[0], np.cumsum(n)]).astype(np.int32), ids, last

    for kw in ({}, {}, dict(sm_scale=0.3), {}, dict(logits_soft_cap=3.0)):
        indptr, ids, last = table(list(rng.integers(0, 120, 3)))
        qh = rng.standard_normal((3, hk * group, d)).astype(np.float16)
        o, lse = batch_decode_paged(cuda.to_device(qh), cache, indptr, ids, last, return_lse=True, **kw)
        ro, rlse = R.batch_decode_paged(qh, cache_h, indptr, ids, last, return_lse=True, dtype=np.float64, **kw)
        o = o.copy_to_host().view(np.float16).astype(np.float64)
        np.testing.assert_allclose(o, ro, atol=4e-3 * (1 + np.abs(ro).max()), rtol=4e-3)
        assert np.array_equal(np.isneginf(lse.copy_to_host()), np.isneginf(rlse))
    assert len(checked) == 3            # {}, sm_scale and soft cap: the repeats skip the checks
    q = cuda.to_device(qh)
    b = dict(zip(("indptr", "indices", "last"), table([9, 30, 4])))
    batch_decode_paged(q, cache, b["indptr"], b["indices"], b["last"])
    n_checked, n_launches = len(checked), len(launches)
    bad = b["indices"].copy()
    bad[-1] = P                                        # one page past the cache
    with pytest.raises(L.LayoutError) as got:
        batch_decode_paged(q, cache, b["indptr"], bad, b["last"])
    with pytest.raises(L.LayoutError) as want:
        L.PagedKV.validate(b["indptr"], bad, b["last"], page, P)
    assert str(got.value) == str(want.value) and "paged_kv_indices" in str(got.value)
    with pytest.raises(L.LayoutError, match="q: has 3 rows"):         # four requests for q's three rows
        batch_decode_paged(q, cache, *table([5, 6, 7, 8]))
    assert len(launches) == n_launches and len(checked) == n_checked
