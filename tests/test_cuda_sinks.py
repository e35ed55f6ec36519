"""Learnable sinks on the kernels (simulator): every attention form of
:mod:`nbattn.cuda` against the dense float64 brute force with a sink column
(``tests/brute.py``), fresh random inputs each run (the seed is in each message).

The kernels merge the sink state ``(0, sinks[h] * log2(e))`` once after the
attention (``nbattn.cuda.sinks``); these tests check the result, the empty and
NaN rows, a split decode, the cascade (the sink once, not per level), and that
a bad ``sinks`` is refused before any kernel runs.
"""
from __future__ import annotations

import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn import cuda as C
from nbattn import layout as L
from nbattn import reference as R
from brute import dense_batch, fresh, gather_pages as gather, paged_batch, ragged_batch

TOL = 3e-5
LN2 = np.log(2.0)


def sinks_for(rng, hq, scale=2.0):
    return (rng.standard_normal(hq) * scale).astype(np.float32)


def close(got, want, seed, what):
    got = np.asarray(got, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{what}: NaN places differ (seed={seed})"
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL, err_msg=f"{what} (seed={seed})")


def split(x, indptr):
    return [x[indptr[r]:indptr[r + 1]] for r in range(len(indptr) - 1)]


@pytest.mark.parametrize("kw", [{}, dict(causal=True), dict(causal=True, window_left=2, sink_size=1)],
                         ids=["none", "causal", "window"])
def test_single_prefill_and_ragged(kw):
    rng, seed = fresh()
    qo_lens, kv_lens = [3, 0, 2, 4], [5, 3, 2, 9]
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, qo_lens, kv_lens)
    sinks = sinks_for(rng, q.shape[1])
    want = dense_batch(q, split(k, kv_indptr), split(v, kv_indptr), qo_lens, sinks=sinks, **kw)
    o, lse = C.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, return_lse=True, sinks=sinks, **kw)
    close(o, want[0], seed, "ragged o")
    close(lse, want[1], seed, "ragged lse")
    q1, k1, v1 = q[5:9], k[10:19], v[10:19]                          # request 3 alone
    w1 = dense_batch(q1, [k1], [v1], [4], sinks=sinks, **kw)
    o1 = C.single_prefill(q1, k1, v1, sinks=sinks, **kw)              # o only, as asked
    close(o1, w1[0], seed, "single_prefill o")


@pytest.mark.parametrize("page_size", [1, 3])
def test_batch_prefill_paged(page_size):
    rng, seed = fresh()
    qo_lens, kv_lens = [2, 0, 3, 1], [7, 0, 9, 4]       # an empty request, last pages not full
    q, cache, qo_indptr, indptr, indices, last = paged_batch(rng, qo_lens, kv_lens, page_size, "NHD")
    sinks = sinks_for(rng, q.shape[1])
    kvs = [gather(cache, indptr, indices, last, r, "NHD") for r in range(4)]
    want = dense_batch(q, [a for a, _ in kvs], [b for _, b in kvs], qo_lens, sinks=sinks, causal=True)
    o, lse = C.batch_prefill_paged(q, cache, qo_indptr, indptr, indices, last, return_lse=True, sinks=sinks,
                                   causal=True)
    close(o, want[0], seed, "o")
    close(lse, want[1], seed, "lse")


def test_decode_and_the_empty_request_is_the_sink():
    rng, seed = fresh()
    kv_lens = [9, 0, 30, 5]
    q, cache, _, indptr, indices, last = paged_batch(rng, [1] * 4, kv_lens, 4, "HND", group=4)
    sinks = sinks_for(rng, q.shape[1])
    kvs = [gather(cache, indptr, indices, last, r, "HND") for r in range(4)]
    want = dense_batch(q, [a for a, _ in kvs], [b for _, b in kvs], [1] * 4, sinks=sinks, window_left=6)
    o, lse = C.batch_decode_paged(q, cache, indptr, indices, last, kv_layout="HND", return_lse=True,
                                  sinks=sinks, window_left=6)
    close(o, want[0], seed, "o")
    close(lse, want[1], seed, "lse")
    assert (np.asarray(o)[1] == 0).all() and np.allclose(lse[1], sinks / LN2, rtol=1e-6), \
        f"the empty request is the sink (seed={seed})"
    o, lse = C.single_decode(q[2], kvs[2][0], kvs[2][1], return_lse=True, sinks=sinks, window_left=6)
    close(o, want[0][2], seed, "single_decode o")
    close(lse, want[1][2], seed, "single_decode lse")


def test_block_sparse_and_a_row_with_no_block():
    rng, seed = fresh()
    m, n, br, bc = 6, 9, 2, 3
    block = rng.random((3, 3)) < 0.6
    block[1] = False                                                   # rows 2, 3 see nothing
    bsr = L.BSR.from_block_mask(block, (br, bc), (m, n))
    elem = np.repeat(np.repeat(block, br, 0), bc, 1)[:m, :n]
    q, k, v, _, _ = ragged_batch(rng, [m], [n], hkv=1, group=2)
    sinks = sinks_for(rng, 2)
    want = dense_batch(q, [k], [v], [m], sinks=sinks, masks=[elem])
    o, lse = C.block_sparse(q, k, v, bsr, return_lse=True, sinks=sinks)
    close(o, want[0], seed, "o")
    close(lse, want[1], seed, "lse")


def test_cascade_applies_the_sink_once():
    """Two levels (a shared prefix, then each request's own pages) with a sink equal the
    flat attention with the sink: the sink is merged after the levels, not per level."""
    rng, seed = fresh()
    ps, hkv, group, d = 2, 1, 2, 8
    prefix, suffix = 4, [3, 5]
    pool = 2 + (prefix // ps) + sum(-(-s // ps) for s in suffix)
    cache = rng.standard_normal((pool, 2, ps, hkv, d)).astype(np.float32)
    q = rng.standard_normal((2, hkv * group, d)).astype(np.float32)
    pre = np.arange(prefix // ps, dtype=np.int32)
    own, start = [], prefix // ps
    for s in suffix:
        n = -(-s // ps)
        own.append(np.arange(start, start + n, dtype=np.int32))
        start += n
    levels = [L.CascadeLevel(np.array([0, 2], np.int32), np.array([0, len(pre)], np.int32), pre,
                             np.array([ps], np.int32)),
              L.CascadeLevel(np.array([0, 1, 2], np.int32), np.array([0, len(own[0]), len(own[0]) + len(own[1])],
                                                                       np.int32),
                             np.concatenate(own), np.array([s - (len(o) - 1) * ps for s, o in zip(suffix, own)],
                                                           np.int32))]
    sinks = sinks_for(rng, hkv * group)
    ks, vs = [], []
    for r in range(2):
        pages = np.concatenate([pre, own[r]])
        k = cache[pages, 0].reshape(-1, hkv, d)[:prefix + suffix[r]]
        v = cache[pages, 1].reshape(-1, hkv, d)[:prefix + suffix[r]]
        ks.append(k)
        vs.append(v)
    want = dense_batch(q, ks, vs, [1, 1], sinks=sinks)
    o, lse = C.cascade(q, levels, cache, return_lse=True, sinks=sinks)
    close(o, want[0], seed, "o")
    close(lse, want[1], seed, "lse")


def test_nan_rows_stay_nan_and_hidden_nan_is_ignored():
    rng, seed = fresh()
    q, k, v, _, _ = ragged_batch(rng, [3], [6], hkv=1, group=2)
    q[0, 1, 0] = np.nan                          # row 0, head 1
    v[5, 0, 2] = np.nan                          # the last key: only the last row sees it (causal)
    sinks = sinks_for(rng, 2)
    want = dense_batch(q, [k], [v], [3], sinks=sinks, causal=True)
    o, lse = C.single_prefill(q, k, v, return_lse=True, sinks=sinks, causal=True)
    assert np.isnan(want[0][0, 1]).all() and np.isnan(want[0][2]).all() and np.isfinite(want[0][1]).all()
    close(o, want[0], seed, "o")
    close(lse, want[1], seed, "lse")


@pytest.mark.parametrize("bad,match", [(np.zeros(3, np.float32), r"shape \[num_qo_heads\]"),
                                       (np.array([0.0, np.inf, 0.0, 0.0], np.float32), "must be finite"),
                                       (np.zeros(4, np.int32), "floating-point")])
def test_bad_sinks_refused_before_any_kernel_and_nothing_changes(monkeypatch, bad, match):
    from nbattn.cuda import sinks as S
    rng, seed = fresh()
    q, k, v, _, _ = ragged_batch(rng, [2], [4])
    out = np.full_like(q, 7.0)
    ran = []
    monkeypatch.setattr(S, "sink_kernel", lambda *a, **kw: ran.append(1))
    before = [x.copy() for x in (q, k, v, bad)]
    with pytest.raises(ValueError, match=match):
        C.single_prefill(q, k, v, sinks=bad, out=out)
    assert (out == 7.0).all() and not ran
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(before, (q, k, v, bad)))
    with pytest.raises(ValueError, match="sigmoid"):
        C.single_prefill(q, k, v, sinks=np.zeros(4, np.float32), use_sigmoid=True)


def test_golden_and_kernel_agree_with_torch_inputs():
    torch = pytest.importorskip("torch")
    rng, seed = fresh()
    q, k, v, _, _ = ragged_batch(rng, [3], [7])
    sinks = torch.from_numpy(sinks_for(rng, q.shape[1]))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    go, gl = R.single_prefill(tq, tk, tv, return_lse=True, sinks=sinks, causal=True)
    ko, kl = C.single_prefill(q, k, v, return_lse=True, sinks=sinks, causal=True)
    close(ko, go.numpy().astype(np.float64), seed, "o")
    close(kl, gl.numpy().astype(np.float64), seed, "lse")


def _workspace():
    from numba import cuda
    return cuda.device_array(1 << 20, np.uint8)


def _with_sink_column(want_o, want_lse, sinks):
    """The golden result merged with the sink state, by hand: a second, independent
    statement of the sink (not nbattn.reference.sinks)."""
    s2 = np.asarray(sinks, np.float64) / LN2                         # the sink's base-2 LSE per head
    lse = np.asarray(want_lse, np.float64)
    lse_all = np.logaddexp2(lse, s2[None, :])
    keep = np.where(np.isneginf(lse), 0.0, np.exp2(lse - lse_all))   # the share the keys keep
    return np.asarray(want_o, np.float64) * keep[..., None], lse_all


def test_decode_wrapper_run_takes_sinks_on_split_and_empty_requests():
    from brute import random_paged_batch
    rng, seed = fresh()
    kv_lens = [40, 0, 7, 13]                                          # the long one is split (num_ctas=4)
    b = random_paged_batch(rng, qo_lens=[1] * 4, kv_lens=kv_lens, page_size=4, num_kv_heads=2, group=2,
                           head_dim=16, share_first_page=True)
    w = C.BatchDecodeWithPagedKVCacheWrapper(_workspace(), num_ctas=4)
    w.plan(b["indptr"], b["indices"], b["last"], 4, 2, 16, 4, q_data_type="float32", chunk_overhead=0.0,
           chunk_limit=None)
    assert w.last_plan.num_partials > 0, "the plan should split a request"
    sinks = sinks_for(rng, 4)
    want = _with_sink_column(*R.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"],
                                                   return_lse=True), sinks)
    o, lse = w.run(b["q"], b["cache"], return_lse=True, sinks=sinks)
    close(o, want[0], seed, "decode wrapper o")
    close(lse, want[1], seed, "decode wrapper lse")
    assert (np.asarray(o)[1] == 0).all(), f"the empty request is the sink (seed={seed})"
    o_only = w.run(b["q"], b["cache"], sinks=sinks)                   # o alone, as asked
    close(o_only, want[0], seed, "decode wrapper o only")
    plain = w.run(b["q"], b["cache"], return_lse=True)                # no sink: the plain result again
    gold = R.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], return_lse=True)
    close(plain[1], np.asarray(gold[1], np.float64), seed, "plain lse after a sinks run")


@pytest.mark.parametrize("causal", [False, True])
def test_prefill_wrapper_run_takes_sinks(causal):
    from brute import random_paged_batch
    rng, seed = fresh()
    b = random_paged_batch(rng, qo_lens=[6, 0, 3], kv_lens=[30, 5, 3], page_size=4, num_kv_heads=2, group=2,
                           head_dim=16)
    w = C.BatchPrefillWithPagedKVCacheWrapper(_workspace(), num_ctas=4)
    w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], 4, 2, 16, 4, causal=causal, q_data_type="float32")
    sinks = sinks_for(rng, 4)
    gold = R.batch_prefill_paged(b["q"], b["cache"], b["qo_indptr"], b["indptr"], b["indices"], b["last"],
                                 causal=causal, return_lse=True)
    want = _with_sink_column(*gold, sinks)
    o, lse = w.run(b["q"], b["cache"], return_lse=True, sinks=sinks)
    close(o, want[0], seed, "prefill wrapper o")
    close(lse, want[1], seed, "prefill wrapper lse")


@pytest.mark.parametrize("bad,match", [(np.zeros(3, np.float32), r"shape \[num_qo_heads\]"),
                                       (np.array([0.0, np.nan, 0.0, 0.0], np.float32), "must be finite")])
def test_wrappers_refuse_bad_sinks_before_any_launch(monkeypatch, bad, match):
    from brute import random_paged_batch
    from nbattn.cuda.host import driver
    rng, seed = fresh()
    b = random_paged_batch(rng, qo_lens=[1, 1], kv_lens=[9, 4], page_size=4, num_kv_heads=2, group=2, head_dim=16)
    w = C.BatchDecodeWithPagedKVCacheWrapper(_workspace(), num_ctas=4)
    w.plan(b["indptr"], b["indices"], b["last"], 4, 2, 16, 4, q_data_type="float32")
    launched = []
    monkeypatch.setattr(driver.BoundLaunch, "__call__", lambda *a, **kw: launched.append(1))
    out = np.full(b["q"].shape, 7.0, np.float32)
    with pytest.raises(ValueError, match=match) as e:
        w.run(b["q"], b["cache"], out=out, sinks=bad)
    assert str(e.value).startswith("sinks:") and not launched and (out == 7.0).all(), f"seed={seed}"
    with pytest.raises(RuntimeError, match="plan"):
        C.BatchDecodeWithPagedKVCacheWrapper(_workspace(), num_ctas=4).run(b["q"], b["cache"], sinks=np.zeros(4))
