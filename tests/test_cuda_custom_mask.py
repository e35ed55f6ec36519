"""Runtime custom masks on the kernels (``custom_mask`` / ``packed_custom_mask``), simulator.

Expected values come from tests/brute.py's float64 key-by-key loop
(:func:`brute.dense_batch`, which takes each request's ``[Q, K]`` boolean block),
not from :mod:`nbattn.reference`.  Masks are drawn fresh: rows that keep every
key, rows that keep none (o = 0, LSE = -inf), and everything between.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nbattn  # noqa: F401  (simulator choice first)
from nbattn import cuda as C
from nbattn import reference as R
from nbattn.cuda.kernels import prefill_cc as CC
from nbattn.cuda.kernels.prefill_dispatch import make_spec
from nbattn.reference.custom_mask import mask_indptr
from nbattn.variants import Variant

from brute import dense_batch, fresh, gather_pages, indptr_of, random_paged_batch

TOL = 3e-5


def _masks(rng, qo_lens, kv_lens, keep=0.6):
    """Request blocks [Q_r, K_r]: random, with one row kept whole and one row empty where there is room."""
    out = []
    for q, k in zip(qo_lens, kv_lens):
        m = rng.random((q, k)) < keep
        if q >= 2:
            m[0] = True
            m[-1] = False
        out.append(m)
    return out


def _flat(masks):
    return np.concatenate([m.ravel() for m in masks] + [np.zeros(0, bool)])


def _packed(masks):
    return np.concatenate([np.packbits(m.ravel(), bitorder="little") for m in masks] + [np.zeros(0, np.uint8)])


def _check(o, lse, want):
    wo, wl = want
    o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    assert np.array_equal(np.isneginf(lse), np.isneginf(wl)), "rows that keep no key differ"
    assert np.all(o[np.isneginf(wl)] == 0)
    assert np.array_equal(np.isnan(lse), np.isnan(wl))
    ok = ~np.isnan(wl)
    np.testing.assert_allclose(o[ok], wo[ok], atol=TOL, rtol=TOL)
    fin = np.isfinite(wl)
    np.testing.assert_allclose(lse[fin], wl[fin], atol=TOL, rtol=TOL)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 24)), min_size=1, max_size=4),
       page_size=st.sampled_from([1, 3, 16]), group=st.sampled_from([1, 2, 4]),
       window=st.sampled_from([-1, 4]), packed=st.booleans(), seed=st.integers(0, 2 ** 31))
def test_paged_prefill_reads_the_mask(lens, page_size, group, window, packed, seed):
    rng = np.random.default_rng(seed)
    qo_lens = [q for q, _ in lens]
    kv_lens = [k for _, k in lens]
    b = random_paged_batch(rng, qo_lens=qo_lens, kv_lens=kv_lens, page_size=page_size, num_kv_heads=2,
                           group=group, head_dim=8, share_first_page=True)
    masks = _masks(rng, qo_lens, kv_lens)
    arg = dict(packed_custom_mask=_packed(masks)) if packed else dict(custom_mask=_flat(masks))
    o, lse = C.batch_prefill_paged(b["q"], b["cache"], b["qo_indptr"], b["indptr"], b["indices"], b["last"],
                                   return_lse=True, window_left=window, **arg)
    kvs = [gather_pages(b["cache"], b["indptr"], b["indices"], b["last"], r) for r in range(len(lens))]
    _check(o, lse, dense_batch(b["q"], [k for k, _ in kvs], [v for _, v in kvs], qo_lens, masks=masks,
                               window_left=window))


def test_ragged_prefill_packed_and_bool_forms_agree():
    rng, seed = fresh()
    qo_lens, kv_lens = [4, 0, 7, 1], [9, 3, 7, 12]
    q = rng.standard_normal((sum(qo_lens), 4, 16)).astype(np.float32)
    k = rng.standard_normal((sum(kv_lens), 2, 16)).astype(np.float32)
    v = rng.standard_normal((sum(kv_lens), 2, 16)).astype(np.float32)
    qo, kv = indptr_of(qo_lens), indptr_of(kv_lens)
    masks = _masks(rng, qo_lens, kv_lens)
    o1, l1 = C.batch_prefill_ragged(q, k, v, qo, kv, return_lse=True, custom_mask=_flat(masks))
    o2, l2 = C.batch_prefill_ragged(q, k, v, qo, kv, return_lse=True, packed_custom_mask=_packed(masks))
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)
    ks = [k[kv[r]:kv[r + 1]] for r in range(4)]
    vs = [v[kv[r]:kv[r + 1]] for r in range(4)]
    _check(o1, l1, dense_batch(q, ks, vs, qo_lens, masks=masks))


def test_single_prefill_takes_the_two_dimensional_mask():
    rng, seed = fresh()
    q = rng.standard_normal((5, 4, 8)).astype(np.float32)
    k = rng.standard_normal((11, 2, 8)).astype(np.float32)
    v = rng.standard_normal((11, 2, 8)).astype(np.float32)
    m = _masks(rng, [5], [11])[0]
    o, lse = C.single_prefill(q, k, v, return_lse=True, custom_mask=m)
    _check(o, lse, dense_batch(q, [k], [v], [5], masks=[m]))
    o2 = C.single_prefill(q, k, v, custom_mask=m.ravel())
    np.testing.assert_array_equal(o, o2)


def test_a_key_the_mask_hides_never_reaches_a_row_and_a_kept_one_poisons():
    """The NaN rule with a custom mask: key 2's V holds NaN; rows whose mask drops key 2
    are finite, rows that keep it are NaN."""
    rng, seed = fresh()
    q = rng.standard_normal((4, 2, 8)).astype(np.float32)
    k = rng.standard_normal((6, 1, 8)).astype(np.float32)
    v = rng.standard_normal((6, 1, 8)).astype(np.float32)
    v[2, 0, 3] = np.nan
    m = np.ones((4, 6), bool)
    m[[0, 2], 2] = False
    o, lse = C.single_prefill(q, k, v, return_lse=True, custom_mask=m)
    assert np.isfinite(lse[[0, 2]]).all() and np.isnan(lse[[1, 3]]).all()
    _check(o, lse, dense_batch(q, [k], [v], [4], masks=[m]))


def test_a_mask_never_builds_a_fast_prefill_tile():
    spec = make_spec("paged", "NHD", "f32", 16, 4, 2, Variant(), custom_mask=True)
    assert spec.custom_mask and not spec.tensor_cores and not CC.covers(spec)
    assert not make_spec("paged", "NHD", "f32", 16, 4, 2, Variant()).custom_mask


@pytest.mark.parametrize("case", ["short", "both", "causal", "dtype", "packed_short", "tensor_cores"])
def test_bad_masks_are_refused_before_any_kernel_runs(case):
    rng, seed = fresh()
    qo_lens, kv_lens = [2, 3], [4, 5]
    q = rng.standard_normal((5, 2, 8)).astype(np.float32)
    k = rng.standard_normal((9, 2, 8)).astype(np.float32)
    out = np.full((5, 2, 8), 7.0, np.float32)
    qo, kv = indptr_of(qo_lens), indptr_of(kv_lens)
    n = int(mask_indptr(qo_lens, kv_lens)[-1])
    good = np.ones(n, bool)
    kw, match = {
        "short": (dict(custom_mask=good[:-1]), "^custom_mask: must be 1-D of length"),
        "both": (dict(custom_mask=good, packed_custom_mask=np.packbits(good)), "^packed_custom_mask: give"),
        "causal": (dict(custom_mask=good, causal=True), "^custom_mask: causal=True cannot be combined"),
        "dtype": (dict(custom_mask=good.astype(np.int8)), "^custom_mask: must be bool"),
        "packed_short": (dict(packed_custom_mask=np.zeros(1, np.uint8)), "^packed_custom_mask: must be 1-D"),
        "tensor_cores": (dict(custom_mask=good, tensor_cores=True), "^tensor_cores: a custom mask"),
    }[case]
    with pytest.raises(ValueError, match=match):
        C.batch_prefill_ragged(q, k, k, qo, kv, out=out, **kw)
    assert np.all(out == 7.0)
    # the golden model refuses the same masks with the same words
    if case not in ("tensor_cores",):
        with pytest.raises(ValueError, match=match):
            R.batch_prefill_ragged(q, k, k, qo, kv, **kw)


def test_mask_arrays_pack_each_request_on_its_own():
    """The host's packing equals np.packbits per request (little-endian, padded to bytes), and
    rows[r] addresses bit (q_idx, kv_idx) of request r at q_idx = K - Q + i."""
    from nbattn.cuda.prefill import mask_arrays
    rng, seed = fresh()
    qo_lens, kv_lens = [3, 0, 5, 1, 2], [5, 4, 7, 1, 3]
    masks = _masks(rng, qo_lens, kv_lens)
    bits, rows = mask_arrays(_flat(masks), None, qo_lens, kv_lens, causal=False)
    np.testing.assert_array_equal(bits, _packed(masks))
    for r, (q, k) in enumerate(zip(qo_lens, kv_lens)):
        for i in range(q):
            for j in range(k):
                bit = rows[r, 0] + (k - q + i) * rows[r, 1] + j
                assert bool((bits[bit >> 3] >> (bit & 7)) & 1) == masks[r][i, j]
    assert mask_arrays(None, None, qo_lens, kv_lens, causal=True) is None


def test_prefill_wrapper_plans_a_mask_and_runs_it_again_after_replanning():
    """plan(custom_mask=...) then run(); a second plan with another mask (packed) and other
    lengths; a third without a mask: each run equals the float64 loop."""
    from numba import cuda
    rng, seed = fresh()
    w = C.BatchPrefillWithPagedKVCacheWrapper(cuda.device_array(8 << 20, np.uint8), "NHD", num_ctas=3)
    for qo_lens, kv_lens, form in (([3, 1, 4], [9, 30, 4], "bool"), ([2, 5], [17, 6], "packed"),
                                   ([2, 2], [5, 7], None)):
        b = random_paged_batch(rng, qo_lens=qo_lens, kv_lens=kv_lens, page_size=4, num_kv_heads=2, group=2,
                               head_dim=8, share_first_page=True)
        masks = _masks(rng, qo_lens, kv_lens)
        arg = {"bool": dict(custom_mask=_flat(masks)), "packed": dict(packed_custom_mask=_packed(masks)),
               None: {}}[form]
        w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], 4, 2, 8, 4, q_data_type=np.float32,
               kv_data_type=np.float32, chunk_limit=8, **arg)
        from nbattn.sched.plan import DIRECT
        assert np.any(w.last_plan.out_slot != DIRECT) or form is None   # split tiles: the partial launch reads it
        o, lse = w.run(b["q"], b["cache"], return_lse=True)
        kvs = [gather_pages(b["cache"], b["indptr"], b["indices"], b["last"], r) for r in range(len(qo_lens))]
        _check(o, lse, dense_batch(b["q"], [k for k, _ in kvs], [v for _, v in kvs], qo_lens,
                                   masks=masks if form else None))
    with pytest.raises(ValueError, match="^custom_mask: must be 1-D of length"):
        w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], 4, 2, 8, 4, custom_mask=np.ones(3, bool))
