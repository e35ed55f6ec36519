"""nbattn.cuda merge kernels vs the golden merge operator (docs/concepts/state.md)."""
from __future__ import annotations

import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn import layout as L
from nbattn import reference as R
from nbattn import cuda as C
from numba import cuda


def states(rng, shape, dtype=np.float32, empty_frac=0.2):
    v = rng.standard_normal(shape + (8,)).astype(dtype)
    s = (rng.standard_normal(shape) * 20).astype(np.float32)
    s[rng.random(shape) < empty_frac] = -np.inf
    v[np.isneginf(s)] = 0
    return v, s


def test_worked_example():
    o, lse = C.merge_state(np.array([[1.0, 0.0]], np.float32), np.array([2.0], np.float32),
                           np.array([[0.0, 1.0]], np.float32), np.array([1.0], np.float32))
    np.testing.assert_allclose(o, [[2 / 3, 1 / 3]], rtol=1e-6)
    np.testing.assert_allclose(lse, [2 + np.log2(1.5)], rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_merge_state_matches_golden(dtype):
    rng = np.random.default_rng([21, np.dtype(dtype).itemsize])
    va, sa = states(rng, (5, 3), dtype)
    vb, sb = states(rng, (5, 3), dtype)
    sa[0, 0] = sb[0, 0] = -np.inf                       # two empty states
    va[0, 0] = vb[0, 0] = 0
    o, lse = C.merge_state(va, sa, vb, sb)
    ro, rlse = R.merge_state(va.astype(np.float32), sa, vb.astype(np.float32), sb)
    assert o.dtype == dtype and not np.isnan(o.astype(np.float32)).any()
    np.testing.assert_allclose(o.astype(np.float32), ro, atol=2e-3 if dtype == np.float16 else 1e-6)
    assert np.array_equal(np.isneginf(lse), np.isneginf(rlse))
    np.testing.assert_allclose(lse[np.isfinite(rlse)], rlse[np.isfinite(rlse)], rtol=1e-6)
    assert np.all(o[0, 0] == 0) and np.isneginf(lse[0, 0])


def test_merge_states_fold_order():
    rng = np.random.default_rng(22)
    v, s = states(rng, (4, 5, 2))
    v = v.reshape(4, 5, 2, 8)
    o, lse = C.merge_states(v, s)
    ro, rlse = R.merge_states(v, s)
    np.testing.assert_allclose(o, ro, atol=1e-6)
    fin = np.isfinite(rlse)
    np.testing.assert_allclose(lse[fin], rlse[fin], rtol=1e-6)
    assert np.array_equal(np.isneginf(lse), np.isneginf(rlse))


def test_merge_state_in_place_with_mask_host_and_device():
    rng = np.random.default_rng(23)
    v, s = states(rng, (6, 2))
    vo, so = states(rng, (6, 2))
    mask = np.array([True, False, True, True, False, True])
    rv, rs = v.copy(), s.copy()
    R.merge_state_in_place(rv, rs, vo, so, mask=mask)
    hv, hs = v.copy(), s.copy()
    C.merge_state_in_place(hv, hs, vo, so, mask=mask)
    np.testing.assert_allclose(hv, rv, atol=1e-6)
    np.testing.assert_allclose(hs[np.isfinite(rs)], rs[np.isfinite(rs)], rtol=1e-6)
    dv, ds = cuda.to_device(v), cuda.to_device(s)
    C.merge_state_in_place(dv, ds, cuda.to_device(vo), cuda.to_device(so), mask=mask)
    np.testing.assert_array_equal(dv.copy_to_host(), hv)
    np.testing.assert_array_equal(ds.copy_to_host(), hs)


def test_merge_of_split_halves_spec_example():
    # docs/concepts/state.md: scores [1,2,3,4], values [10,20,30,40]; halves merge to ~34.93
    s = np.array([1.0, 2.0, 3.0, 4.0])
    v = np.array([10.0, 20.0, 30.0, 40.0])

    def half(a, b):
        w = np.exp(s[a:b])
        return np.float32((w @ v[a:b]) / w.sum()), np.float32(np.log2(w.sum()))
    (oa, la), (ob, lb) = half(0, 2), half(2, 4)
    o, lse = C.merge_state(np.array([[oa]], np.float32), np.array([la], np.float32),
                           np.array([[ob]], np.float32), np.array([lb], np.float32))
    assert abs(float(o[0, 0]) - 34.93) < 0.01


def test_merge_errors_name_the_argument():
    v = np.zeros((3, 8), np.float32)
    s = np.zeros(3, np.float32)
    with pytest.raises(L.LayoutError, match="^v_b"):
        C.merge_state(v, s, v[:2], s[:2])
    with pytest.raises(L.LayoutError, match="^s_a"):
        C.merge_state(v, s.astype(np.float64), v, s)
    with pytest.raises(L.LayoutError, match="^v"):
        C.merge_states(v, s)
    with pytest.raises(L.LayoutError, match="^mask"):
        C.merge_state_in_place(v, s, v, s, mask=np.ones(2, bool))


@pytest.mark.parametrize("n_parts,head_dim,few", [(37, 8, False), (3, 12, False), (1, 8, False),
                                                  (32, 8, True), (9, 12, True), (1, 8, True),
                                                  (41, 8, True)])
def test_merge_partials_matches_fold_and_is_deterministic(n_parts, head_dim, few):
    """run_merge_partials (two passes: LSE tree, then weighted sums over partial
    streams; or, told at most 64 partials a merge, the one-round warp form)
    equals the golden left fold, keeps the empty-state rule, and gives bitwise
    the same output when run again."""
    from nbattn.cuda.merge import MergeMap, run_merge_partials
    from nbattn.cuda.tuning import MERGE
    tuning = MERGE.replace(few_form=few)
    rng = np.random.default_rng([24, n_parts, head_dim])
    rows, heads = 3, 2
    v, s = states(rng, (rows * n_parts, heads), empty_frac=0.3)
    v = np.concatenate([v] * (head_dim // 4), axis=-1)[..., :head_dim].copy()
    s[:n_parts] = -np.inf                                   # row 0: every partial empty
    v[:n_parts] = 0
    perm = rng.permutation(rows * n_parts).astype(np.int32)   # slots out of order
    slots = np.argsort(perm).astype(np.int32)
    po, pl = cuda.to_device(v[perm].copy()), cuda.to_device(s[perm].copy())
    mmap = MergeMap(*[cuda.to_device(np.asarray(x, np.int32))
                      for x in (np.arange(rows + 1) * n_parts, [2, 0, 1], slots)])
    outs = []
    for _ in range(2):
        o, lse = cuda.to_device(np.full((rows, heads, head_dim), np.nan, np.float32)), \
            cuda.to_device(np.full((rows, heads), np.nan, np.float32))
        run_merge_partials(po, pl, mmap, o, lse, code="f32", max_partials=n_parts if few else None,
                           tuning=tuning)
        outs.append((o.copy_to_host(), lse.copy_to_host()))
    ro, rlse = R.merge_states(v.reshape(rows, n_parts, heads, head_dim), s.reshape(rows, n_parts, heads))
    (o, lse), (o2, lse2) = outs
    assert np.array_equal(o, o2) and np.array_equal(lse, lse2)
    order = [2, 0, 1]                                        # merge m wrote row merge_row[m]
    np.testing.assert_allclose(o[order], ro, atol=2e-6)
    fin = np.isfinite(rlse)
    assert np.array_equal(np.isneginf(lse[order]), np.isneginf(rlse))
    np.testing.assert_allclose(lse[order][fin], rlse[fin], rtol=1e-6)
    assert np.all(o[2] == 0) and np.all(np.isneginf(lse[2]))


def test_merge_states_of_fancy_indexed_host_states():
    """``v[slots][None]``: NumPy gives the new axis stride 0 and still calls it
    contiguous; the device copy must flatten all the same (notebook 03's check)."""
    rng = np.random.default_rng(41)
    v = rng.standard_normal((9, 4, 16)).astype(np.float32)
    s = (rng.standard_normal((9, 4)) * 5).astype(np.float32)
    slots = np.array([5, 2, 7])
    got = C.merge_states(v[slots][None], s[slots][None])
    want = R.merge_states(v[slots][None].astype(np.float64), s[slots][None].astype(np.float64))
    np.testing.assert_allclose(np.asarray(got.o), want.o, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got.lse), want.lse, atol=1e-5, rtol=1e-5)


def test_host_copies_get_c_strides():
    from nbattn.cuda.host import arrays as A
    a = np.zeros((3, 4), np.float32)[[0, 2]][None]
    assert a.strides[0] == 0 and a.flags.c_contiguous
    assert A.c_strided(a).strides == (32, 16, 4)
    assert A._host_raw(a, "f32").strides == (32, 16, 4)
