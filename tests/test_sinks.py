"""Learnable attention sinks (GPT-OSS; FlashInfer's ``sinks``) in the golden model.

``sinks [num_qo_heads]``: one logit per query head that joins every row's
softmax normalizer and carries no value.  The golden model merges the state
``(o = 0, lse = sinks[h] * log2(e))`` once into each row's final state
(docs/concepts/sinks.md).

Expected values come from :func:`dense`, written for this file: float64, per
request and per (row, head) an explicitly built list of visible keys, one
dense softmax over their scores plus one extra column of logit ``sinks[h]``
whose value is the zero vector.  Every test draws fresh random inputs; the
seed is in each assertion message.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import nbattn  # noqa: F401  (compat first)
from nbattn import layout as L
from nbattn import reference as R
from brute import (assert_refused, VARIANT_SAMPLES, dense_batch, fresh, gather_pages as gather,  # noqa: E402
                   paged_batch, ragged_batch, shared_prefix_batch)


def dense(q, ks, vs, qo_lens, sinks, **kw):
    """The dense float64 batch attention with a sink column (``sinks`` None: none)."""
    return dense_batch(q, ks, vs, qo_lens, sinks=sinks, **kw)

LN2 = math.log(2.0)




# ---------------------------------------------------------------------------
# The independent brute force
# ---------------------------------------------------------------------------





# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------







def random_sinks(rng, hq, scale=2.0):
    return (rng.standard_normal(hq) * scale).astype(np.float32)


def lse_of(sinks):
    """The sink's base-2 LSE, float64: ``sinks[h] * log2(e)``."""
    return np.asarray(sinks, np.float64) / LN2


def close(got, want, seed, what, atol=1e-5, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol, rtol=rtol,
                               err_msg=f"{what} (seed={seed})")


def split(x, indptr):
    return [x[indptr[r]:indptr[r + 1]] for r in range(len(indptr) - 1)]


VARIANTS = {"none": {}, "causal": dict(causal=True), "window": dict(causal=True, window_left=2, sink_size=1),
            "window_only": dict(window_left=3), "sm_scale": dict(sm_scale=0.41)}


# ---------------------------------------------------------------------------
# Against the brute force
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_single_prefill(kv_layout, variant):
    rng, seed = fresh()
    nk = int(rng.integers(1, 15))
    nq = int(rng.integers(1, nk + 1))
    q, k, v, _, _ = ragged_batch(rng, [nq], [nk], hkv=2, group=4)
    sinks = random_sinks(rng, 8)
    kw = VARIANTS[variant]
    kk, vv = (k, v) if kv_layout == "NHD" else (k.transpose(1, 0, 2).copy(), v.transpose(1, 0, 2).copy())
    want_o, want_l = dense(q, [k], [v], [nq], sinks, **kw)
    for dt, tol in ((np.float64, 1e-12), (np.float32, 2e-5)):
        o, lse = R.single_prefill(q, kk, vv, kv_layout=kv_layout, return_lse=True, dtype=dt, sinks=sinks, **kw)
        close(o, want_o, seed, f"o {dt.__name__} {variant}", atol=tol, rtol=tol)
        close(lse, want_l, seed, f"lse {dt.__name__} {variant}", atol=tol, rtol=tol)


@pytest.mark.parametrize("variant", ["none", "window_only", "sm_scale"])
def test_single_decode(variant):
    rng, seed = fresh()
    nk = int(rng.integers(1, 20))
    q, k, v, _, _ = ragged_batch(rng, [1], [nk], hkv=1, group=4)
    sinks = random_sinks(rng, 4)
    want_o, want_l = dense(q, [k], [v], [1], sinks, **VARIANTS[variant])
    o, lse = R.single_decode(q[0], k, v, return_lse=True, dtype=np.float64, sinks=sinks, **VARIANTS[variant])
    close(o, want_o[0], seed, "o", atol=1e-12, rtol=1e-12)
    close(lse, want_l[0], seed, "lse", atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batch_prefill_ragged(variant):
    rng, seed = fresh()
    kw = VARIANTS[variant]
    if kw.get("causal"):
        qo_lens, kv_lens = [3, 0, 2, 5, 0, 1], [6, 4, 2, 9, 0, 7]
    else:
        qo_lens, kv_lens = [3, 0, 2, 5, 0, 1], [6, 4, 0, 9, 0, 7]   # request 2 has rows but no keys
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, qo_lens, kv_lens)
    sinks = random_sinks(rng, q.shape[1])
    want_o, want_l = dense(q, split(k, kv_indptr), split(v, kv_indptr), qo_lens, sinks, **kw)
    o, lse = R.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, return_lse=True, dtype=np.float64,
                                    sinks=sinks, **kw)
    close(o, want_o, seed, f"o {variant}", atol=1e-12, rtol=1e-12)
    close(lse, want_l, seed, f"lse {variant}", atol=1e-12, rtol=1e-12)
    o32, lse32 = R.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, return_lse=True, sinks=sinks, **kw)
    close(o32, want_o, seed, f"o float32 {variant}", atol=2e-5, rtol=2e-5)
    close(lse32, want_l, seed, f"lse float32 {variant}", atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 4, 5])
@pytest.mark.parametrize("variant", ["none", "causal", "window"])
def test_batch_prefill_paged(kv_layout, page_size, variant):
    rng, seed = fresh()
    qo_lens = [2, 0, 0, 3, 1]
    kv_lens = [7, 3, 0, 9, 11]            # an empty request; last pages not full for page_size 4 and 5
    q, cache, qo_indptr, indptr, indices, last = paged_batch(rng, qo_lens, kv_lens, page_size, kv_layout)
    sinks = random_sinks(rng, q.shape[1])
    kvs = [gather(cache, indptr, indices, last, r, kv_layout) for r in range(len(qo_lens))]
    kw = VARIANTS[variant]
    want_o, want_l = dense(q, [a for a, _ in kvs], [b for _, b in kvs], qo_lens, sinks, **kw)
    o, lse = R.batch_prefill_paged(q, cache, qo_indptr, indptr, indices, last, kv_layout=kv_layout,
                                   return_lse=True, dtype=np.float64, sinks=sinks, **kw)
    close(o, want_o, seed, "o", atol=1e-12, rtol=1e-12)
    close(lse, want_l, seed, "lse", atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_batch_decode_paged(kv_layout, page_size):
    rng, seed = fresh()
    kv_lens = [5, 0, 1, 10, 8]            # an empty request (no pages, last_page_len 0)
    q, cache, _, indptr, indices, last = paged_batch(rng, [1] * 5, kv_lens, page_size, kv_layout, group=4)
    sinks = random_sinks(rng, q.shape[1])
    kvs = [gather(cache, indptr, indices, last, r, kv_layout) for r in range(5)]
    want_o, want_l = dense(q, [a for a, _ in kvs], [b for _, b in kvs], [1] * 5, sinks, window_left=4)
    o, lse = R.batch_decode_paged(q, cache, indptr, indices, last, kv_layout=kv_layout, return_lse=True,
                                  dtype=np.float64, sinks=sinks, window_left=4)
    close(o, want_o, seed, "o", atol=1e-12, rtol=1e-12)
    close(lse, want_l, seed, "lse", atol=1e-12, rtol=1e-12)
    assert (o[1] == 0).all() and np.allclose(lse[1], lse_of(sinks), rtol=1e-12), \
        f"the empty request is the sink (seed={seed})"


def test_block_sparse():
    rng, seed = fresh()
    m, n, br, bc = 7, 11, 2, 3
    block = rng.random((4, 4)) < 0.5
    block[1] = False                      # block row 1: rows 2, 3 see no key
    bsr = L.BSR.from_block_mask(block, (br, bc), (m, n))
    elem = np.repeat(np.repeat(block, br, 0), bc, 1)[:m, :n]
    q, k, v, _, _ = ragged_batch(rng, [m], [n], hkv=1, group=3)
    sinks = random_sinks(rng, 3)
    want_o, want_l = dense(q, [k], [v], [m], sinks, masks=[elem])
    o, lse = R.block_sparse(q, k, v, bsr, return_lse=True, dtype=np.float64, sinks=sinks)
    close(o, want_o, seed, "o", atol=1e-12, rtol=1e-12)
    close(lse, want_l, seed, "lse", atol=1e-12, rtol=1e-12)
    assert (o[2:4] == 0).all() and np.allclose(lse[2:4], lse_of(sinks), rtol=1e-12), f"seed={seed}"


def test_a_row_that_sees_no_key_is_the_sink():
    """The empty state merged with the sink is the sink: o = 0, LSE = sinks[h] * log2(e)."""
    rng, seed = fresh()
    q, k, v, _, _ = ragged_batch(rng, [4], [6], hkv=2, group=2)
    sinks = random_sinks(rng, 4, scale=5.0)
    hide = dict(mask_mod=lambda b, h, qi, kj: qi + h < 6)   # row 3 (position 5), heads >= 1: nothing visible
    for dt in (np.float64, np.float32):
        o, lse = R.single_prefill(q, k, v, return_lse=True, dtype=dt, sinks=sinks, **hide)
        assert (o[3, 1:] == 0).all(), f"{dt.__name__} (seed={seed})"
        close(lse[3, 1:], lse_of(sinks[1:]), seed, f"{dt.__name__}", atol=0, rtol=1e-7)
        o0, lse0 = R.single_prefill(q, k, v, return_lse=True, dtype=dt, **hide)
        assert (o0[3, 1:] == 0).all() and np.isneginf(lse0[3, 1:]).all(), f"no sinks: empty (seed={seed})"
    o, lse = R.single_prefill(q[:2], k[:0], v[:0], return_lse=True, dtype=np.float64, sinks=sinks)
    assert (o == 0).all() and np.allclose(lse, np.broadcast_to(lse_of(sinks), (2, 4)), rtol=1e-15, atol=0), \
        f"no keys at all (seed={seed})"


def test_output_is_scaled_by_one_minus_the_sink_share():
    """``o = o_no_sink * (1 - w_sink)``, ``w_sink = 2^lse_sink / (2^lse + 2^lse_sink)``; the LSE includes the sink."""
    rng, seed = fresh()
    q, k, v, _, _ = ragged_batch(rng, [5], [9], hkv=1, group=4)
    sinks = random_sinks(rng, 4, scale=3.0)
    o0, l0 = R.single_prefill(q, k, v, return_lse=True, dtype=np.float64, causal=True)
    o1, l1 = R.single_prefill(q, k, v, return_lse=True, dtype=np.float64, causal=True, sinks=sinks)
    ls = lse_of(sinks)
    w_sink = 1.0 / (1.0 + np.exp2(l0 - ls))
    close(o1, o0 * (1 - w_sink)[..., None], seed, "o", atol=1e-13, rtol=1e-12)
    close(l1, np.logaddexp2(l0, ls), seed, "lse", atol=1e-13, rtol=1e-12)


@pytest.mark.parametrize("case", ["sink_dominates", "sink_negligible", "comparable", "mixed"])
@pytest.mark.parametrize("dt,tol", [(np.float64, 1e-9), (np.float32, 1e-4)])
def test_logits_and_sinks_of_plus_minus_1000(case, dt, tol):
    rng, seed = fresh()
    nq, nk, d = 4, 9, 8
    q = np.zeros((nq, 4, d), np.float32)
    q[:, :, 0] = 1000.0
    k = np.zeros((nk, 2, d), np.float32)
    k[:, :, 0] = rng.choice([-1.0, 1.0], (nk, 2)) + rng.uniform(-0.004, 0.004, (nk, 2))
    v = rng.standard_normal((nk, 2, d)).astype(np.float32)
    sinks = {"sink_dominates": np.full(4, 1000.0) + 5.0,
             "sink_negligible": np.full(4, -1000.0),
             "comparable": 1000.0 + rng.uniform(-4, 4, 4),
             "mixed": np.array([1000.0, -1000.0, 999.0, -999.5])}[case].astype(np.float32)
    want_o, want_l = dense(q, [k], [v], [nq], sinks, sm_scale=1.0)
    o, lse = R.single_prefill(q, k, v, sm_scale=1.0, return_lse=True, dtype=dt, sinks=sinks)
    assert np.isfinite(o).all() and np.isfinite(lse).all(), f"{case} (seed={seed})"
    close(o, want_o, seed, f"o {case}", atol=tol, rtol=tol)
    close(lse, want_l, seed, f"lse {case}", atol=tol, rtol=tol)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["K", "V"])
def test_nan_in_a_visible_key_poisons_the_row_and_a_hidden_key_does_not(bad, where):
    """With sinks as without: a visible key's non-finite K or V makes the (row, head) NaN,
    o and LSE (the sink cannot rescue it); a key the row cannot see leaves it finite."""
    rng, seed = fresh()
    nq, nk = 5, 8
    q, k, v, _, _ = ragged_batch(rng, [nq], [nk], hkv=2, group=2)
    j = int(rng.integers(nk - nq + 1, nk))           # seen by rows i with nk - nq + i >= j (causal)
    (k if where == "K" else v)[j, 1, int(rng.integers(0, 16))] = bad
    sinks = random_sinks(rng, 4)
    want_o, want_l = dense(q, [k], [v], [nq], sinks, causal=True)
    o, lse = R.single_prefill(q, k, v, causal=True, return_lse=True, dtype=np.float64, sinks=sinks)
    sees = np.arange(nq) + nk - nq >= j
    # kv head 1 serves query heads 2, 3: those (row, head) pairs that see key j are NaN
    assert np.isnan(o[sees][:, 2:]).all() and np.isnan(lse[sees][:, 2:]).all(), f"{where}={bad} (seed={seed})"
    assert np.isfinite(o[sees][:, :2]).all() and np.isfinite(lse[sees][:, :2]).all(), f"seed={seed}"
    assert np.isfinite(o[~sees]).all() and np.isfinite(lse[~sees]).all(), f"hidden {where}={bad} (seed={seed})"
    close(o[~sees], want_o[~sees], seed, "hidden rows", atol=1e-12, rtol=1e-12)
    close(lse[~sees], want_l[~sees], seed, "hidden rows", atol=1e-12, rtol=1e-12)
    close(o[sees][:, :2], want_o[sees][:, :2], seed, "other heads", atol=1e-12, rtol=1e-12)


def test_nan_q_row_stays_nan_and_a_nan_state_merged_with_the_sink_is_nan():
    rng, seed = fresh()
    q, k, v, _, _ = ragged_batch(rng, [3], [4], hkv=1, group=2)
    q[1, 0, 3] = np.nan
    o, lse = R.single_prefill(q, k, v, return_lse=True, sinks=random_sinks(rng, 2))
    assert np.isnan(o[1, 0]).all() and np.isnan(lse[1, 0]), f"seed={seed}"
    assert np.isfinite(o[[0, 2]]).all() and np.isfinite(o[1, 1]).all(), f"seed={seed}"


# ---------------------------------------------------------------------------
# The merge algebra: split KV, cascade
# ---------------------------------------------------------------------------

def test_merge_of_split_states_plus_the_sink_is_the_sink_on_the_unsplit_state():
    rng, seed = fresh()
    nq, nk = 3, int(rng.integers(8, 25))
    q, k, v, _, _ = ragged_batch(rng, [nq], [nk], hkv=2, group=3)
    sinks = random_sinks(rng, 6)
    cuts = np.unique(np.concatenate([[0, nk], rng.integers(0, nk, 3)])).astype(np.int32)
    cuts = np.insert(cuts, 1, cuts[1])                        # an empty chunk too
    kw = dict(causal=True, window_left=6, sink_size=1)
    _, _, (po, pl) = R.split_kv(q, k, v, cuts, return_lse=True, return_partials=True, dtype=np.float64, **kw)
    want_o, want_l = R.single_prefill(q, k, v, return_lse=True, dtype=np.float64, sinks=sinks, **kw)
    ls = np.broadcast_to(lse_of(sinks), (nq, 6))
    # the sink as one more state among the partials ...
    o_a, l_a = R.merge_states(np.concatenate([po, np.zeros_like(po[:, :1])], 1),
                              np.concatenate([pl, ls[:, None]], 1))
    close(o_a, want_o, seed, "o, one more state", atol=1e-13, rtol=1e-12)
    close(l_a, want_l, seed, "lse, one more state", atol=1e-13, rtol=1e-12)
    # ... or merged after them
    o_m, l_m = R.merge_states(po, pl)
    o_b, l_b = R.merge_state(o_m, l_m, np.zeros_like(o_m), ls.copy())
    close(o_b, want_o, seed, "o, merged after", atol=1e-13, rtol=1e-12)
    close(l_b, want_l, seed, "lse, merged after", atol=1e-13, rtol=1e-12)
    # against the brute force too
    dense_o, dense_l = dense(q, [k], [v], [nq], sinks, **kw)
    close(want_o, dense_o, seed, "o", atol=1e-12, rtol=1e-12)
    close(want_l, dense_l, seed, "lse", atol=1e-12, rtol=1e-12)


def _cascade_batch(rng, page_size):
    return shared_prefix_batch(rng, page_size, min_batch=2)[:5]


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_cascade_equals_flat_attention_with_sinks(page_size, causal):
    rng, seed = fresh()
    q, cache, qo_lens, qo_indptr, pkv = _cascade_batch(rng, page_size)
    levels = L.cascade_decompose(qo_indptr, pkv)
    sinks = random_sinks(rng, 4, scale=3.0)
    kw = dict(causal=causal, window_left=5, return_lse=True, dtype=np.float64, sinks=sinks)
    o_c, l_c = R.cascade(q, levels, cache, **kw)
    o_f, l_f = R.batch_prefill_paged(q, cache, qo_indptr, pkv.paged_kv_indptr, pkv.paged_kv_indices,
                                     pkv.paged_kv_last_page_len, **kw)
    close(o_c, o_f, seed, "o: cascade vs flat", atol=1e-12, rtol=1e-12)
    close(l_c, l_f, seed, "lse: cascade vs flat", atol=1e-12, rtol=1e-12)
    kvs = [gather(cache, pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len, r, "NHD")
           for r in range(len(qo_lens))]
    want_o, want_l = dense(q, [a for a, _ in kvs], [b for _, b in kvs], qo_lens, sinks, causal=causal,
                           window_left=5)
    close(o_c, want_o, seed, "o: cascade vs brute force", atol=1e-12, rtol=1e-12)
    close(l_c, want_l, seed, "lse: cascade vs brute force", atol=1e-12, rtol=1e-12)


def test_cascade_applies_the_sink_once_not_per_level():
    """Merging the sink into each level's state would count it once per level."""
    rng, seed = fresh()
    q, cache, qo_lens, qo_indptr, pkv = _cascade_batch(rng, 2)
    levels = L.cascade_decompose(qo_indptr, pkv)
    sinks = np.full(4, 2.0, np.float32)
    o, lse = R.cascade(q, levels, cache, return_lse=True, dtype=np.float64, sinks=sinks)
    o0, lse0 = R.cascade(q, levels, cache, return_lse=True, dtype=np.float64)
    close(lse, np.logaddexp2(lse0, lse_of(sinks[0])), seed, "one sink", atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------------------
# None is the old behaviour; other input kinds
# ---------------------------------------------------------------------------

NONE_VARIANTS = VARIANT_SAMPLES


@pytest.mark.parametrize("kw", NONE_VARIANTS, ids=range(len(NONE_VARIANTS)))
def test_none_is_the_same_bytes_as_not_passing_it(kw):
    rng, seed = fresh()
    qo_lens, kv_lens = [3, 0, 2], [5, 1, 6]
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, qo_lens, kv_lens)
    lse = {} if kw.get("use_sigmoid") else dict(return_lse=True)

    def same(a, b, what):
        a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
        assert len(a) == len(b) and all(x.tobytes() == y.tobytes() for x, y in zip(a, b)), \
            f"{what} {kw} (seed={seed})"

    for dt in (np.float32, np.float64):
        both = dict(lse, dtype=dt, **kw)
        same(R.single_prefill(q[:3], k[:5], v[:5], **both),
             R.single_prefill(q[:3], k[:5], v[:5], **both, sinks=None), "single_prefill")
        same(R.single_decode(q[0], k[:5], v[:5], **both),
             R.single_decode(q[0], k[:5], v[:5], **both, sinks=None), "single_decode")
        same(R.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, **both),
             R.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, **both, sinks=None), "ragged")
        pq, cache, pqo, indptr, indices, last = paged_batch(rng, qo_lens, kv_lens, 4, "NHD", group=2, d=16)
        same(R.batch_prefill_paged(pq, cache, pqo, indptr, indices, last, **both),
             R.batch_prefill_paged(pq, cache, pqo, indptr, indices, last, **both, sinks=None), "paged")
        same(R.batch_decode_paged(pq[:3], cache, indptr, indices, last, **both),
             R.batch_decode_paged(pq[:3], cache, indptr, indices, last, **both, sinks=None), "decode paged")
        bsr = L.BSR.from_block_mask(rng.random((2, 3)) < 0.6, (2, 2), (3, 5))
        same(R.block_sparse(q[:3], k[:5], v[:5], bsr, **both),
             R.block_sparse(q[:3], k[:5], v[:5], bsr, **both, sinks=None), "block_sparse")
        levels = L.cascade_decompose(pqo, L.PagedKV.validate(indptr, indices, last, 4, cache.shape[0]))
        same(R.cascade(pq, levels, cache, **both), R.cascade(pq, levels, cache, **both, sinks=None), "cascade")


def test_torch_sinks_and_torch_inputs():
    rng, seed = fresh()
    q, k, v, _, _ = ragged_batch(rng, [3], [6])
    sinks = random_sinks(rng, 4)
    want = R.single_prefill(q, k, v, sinks=sinks)
    got = R.single_prefill(*(torch.from_numpy(x) for x in (q, k, v)), sinks=torch.from_numpy(sinks))
    assert isinstance(got, torch.Tensor) and got.numpy().tobytes() == want.tobytes(), f"seed={seed}"
    bf = torch.from_numpy(sinks).to(torch.bfloat16)
    got = R.single_prefill(q, k, v, sinks=bf)
    want = R.single_prefill(q, k, v, sinks=bf.float().numpy())
    assert got.numpy().tobytes() == want.tobytes(), f"bf16 sinks read exactly (seed={seed})"
    got64 = R.single_prefill(q, k, v, sinks=sinks.astype(np.float64).tolist())
    assert got64.tobytes() == R.single_prefill(q, k, v, sinks=sinks.astype(np.float64)).tobytes(), f"seed={seed}"


def test_the_sink_logit_is_not_scaled():
    """``sm_scale`` scales the scores, never the sink logit (nor does the soft cap touch it)."""
    rng, seed = fresh()
    q, k, v, _, _ = ragged_batch(rng, [2], [5], hkv=1, group=2)
    sinks = np.array([1.5, -0.5], np.float32)
    for kw in (dict(sm_scale=0.1), dict(sm_scale=3.0), dict(logits_soft_cap=0.2)):
        o0, l0 = R.single_prefill(q, k, v, return_lse=True, dtype=np.float64, **kw)
        o1, l1 = R.single_prefill(q, k, v, return_lse=True, dtype=np.float64, sinks=sinks, **kw)
        close(l1, np.logaddexp2(l0, lse_of(sinks)), seed, f"{kw}", atol=1e-13, rtol=1e-12)


def test_split_kv_does_not_take_sinks():
    """split_kv returns partial states: a sink belongs to the merged result, not to a chunk."""
    from nbattn import cuda as C
    rng, seed = fresh()
    q, k, v, _, _ = ragged_batch(rng, [2], [4])
    for M in (R, C):
        with pytest.raises(TypeError, match="'sinks' .*split_kv.*'sink_size'"):
            M.split_kv(q, k, v, np.array([0, 2, 4], np.int32), sinks=np.zeros(4, np.float32))


# ---------------------------------------------------------------------------
# Validation: one case per rule; the message names the argument; nothing changes
# ---------------------------------------------------------------------------

def _case():
    rng = np.random.default_rng()
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, [2, 3], [4, 5])         # 4 query heads, 2 kv heads
    pq, cache, pqo, indptr, indices, last = paged_batch(rng, [2, 3], [4, 5], 4, "NHD", group=2, d=16)
    return dict(q=q, k=k, v=v, qo=qo_indptr, kv=kv_indptr, pq=pq, cache=cache, pqo=pqo, indptr=indptr,
                indices=indices, last=last, sinks=rng.standard_normal(4).astype(np.float32),
                out=np.full(q.shape, 7.0, np.float32))


def _with(d, **kw):
    s = d["sinks"].copy()
    for key, val in kw.items():
        s[int(key[1:])] = val
    return s


def _single(d, **kw):
    return R.single_prefill(d["q"], d["k"], d["v"], **kw)


def _ragged(d, **kw):
    return R.batch_prefill_ragged(d["q"], d["k"], d["v"], d["qo"], d["kv"], out=d["out"], **kw)


def _paged(d, **kw):
    return R.batch_prefill_paged(d["pq"], d["cache"], d["pqo"], d["indptr"], d["indices"], d["last"],
                                 out=d["out"], **kw)


def _decode(d, **kw):
    return R.batch_decode_paged(d["pq"][:2], d["cache"], d["indptr"], d["indices"], d["last"], **kw)


def _cascade(d, **kw):
    levels = L.cascade_decompose(d["pqo"], L.PagedKV.validate(d["indptr"], d["indices"], d["last"], 4,
                                                              d["cache"].shape[0]))
    return R.cascade(d["pq"], levels, d["cache"], **kw)


def _sparse(d, **kw):
    return R.block_sparse(d["q"][:2], d["k"][:4], d["v"][:4], L.BSR.from_block_mask(np.ones((1, 2), bool), (2, 2),
                                                                                   (2, 4)), **kw)


# (id, a phrase of the rule, call)
RULES = [
    ("sigmoid_single", "sigmoid", lambda d: _single(d, use_sigmoid=True, sinks=d["sinks"])),
    ("sigmoid_paged", "sigmoid", lambda d: _paged(d, use_sigmoid=True, sinks=d["sinks"])),
    ("sigmoid_cascade", "sigmoid", lambda d: _cascade(d, use_sigmoid=True, sinks=d["sinks"])),
    ("sigmoid_decode_single", "sigmoid", lambda d: R.single_decode(d["q"][0], d["k"], d["v"], use_sigmoid=True,
                                                                   sinks=d["sinks"])),
    ("shape_kv_heads", "[num_qo_heads] = [4], got (2,)", lambda d: _ragged(d, sinks=d["sinks"][:2])),
    ("shape_2d", "[num_qo_heads] = [4], got (1, 4)", lambda d: _paged(d, sinks=d["sinks"][None])),
    ("shape_scalar", "[num_qo_heads] = [4], got ()", lambda d: _single(d, sinks=np.float32(0.5))),
    ("shape_decode", "[num_qo_heads] = [4], got (5,)", lambda d: _decode(d, sinks=np.zeros(5, np.float32))),
    ("shape_sparse", "[num_qo_heads] = [4], got (8,)", lambda d: _sparse(d, sinks=np.zeros(8, np.float32))),
    ("dtype_int", "floating-point", lambda d: _single(d, sinks=np.arange(4))),
    ("dtype_bool", "floating-point", lambda d: _cascade(d, sinks=np.ones(4, bool))),
    ("dtype_fp8", "fp8", lambda d: _single(d, sinks=torch.zeros(4).to(torch.float8_e4m3fn))),
    ("nan", "must be finite, got nan at head 2", lambda d: _ragged(d, sinks=_with(d, h2=np.nan))),
    ("inf", "must be finite, got inf at head 0", lambda d: _paged(d, sinks=_with(d, h0=np.inf))),
    ("minus_inf", "must be finite, got -inf at head 3", lambda d: _decode(d, sinks=_with(d, h3=-np.inf))),
    ("nan_cascade", "must be finite", lambda d: _cascade(d, sinks=_with(d, h1=np.nan))),
    ("nan_sparse", "must be finite", lambda d: _sparse(d, sinks=_with(d, h1=np.nan))),
]


@pytest.mark.parametrize("name,rule,call", RULES, ids=[r[0] for r in RULES])
def test_rule(name, rule, call):
    assert_refused(call, _case(), "sinks", rule, name)


def test_torch_nan_sinks_are_rejected_and_unchanged():
    d = _case()
    s = torch.tensor([0.0, float("nan"), 1.0, 2.0])
    before = s.clone()
    with pytest.raises(ValueError, match=r"^sinks: must be finite, got nan at head 1"):
        _single(d, sinks=s)
    assert torch.equal(torch.isnan(s), torch.isnan(before)) and torch.equal(s.nan_to_num(), before.nan_to_num())
