"""The append kernel against the golden append, every input kind the tests can make here."""
import numpy as np
import pytest

import nbattn  # noqa: F401
from nbattn import cuda as C
from nbattn import layout as L
from nbattn import reference as R

from brute import gather_pages, random_paged_batch


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 3, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_append_matches_golden(kv_layout, page_size, dtype):
    rng = np.random.default_rng(page_size)
    kv_lens = [5, 0, 9, 2]
    new = [2, 0, 4, 2]                       # the last tokens of each request are the new ones
    b = random_paged_batch(rng, qo_lens=new, kv_lens=kv_lens, page_size=page_size, num_kv_heads=2,
                           group=1, head_dim=8, kv_layout=kv_layout, dtype=dtype)
    nnz = sum(new)
    append_indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    bi, pos = L.get_batch_indices_positions(append_indptr, np.array(kv_lens), nnz)
    k = rng.standard_normal((nnz, 2, 8)).astype(dtype)
    v = rng.standard_normal((nnz, 2, 8)).astype(dtype)
    golden, fast = b["cache"].copy(), b["cache"].copy()
    args = (bi, pos)
    meta = (b["indptr"], b["indices"], b["last"])
    R.append_paged_kv_cache(k, v, *args, golden, *meta, kv_layout=kv_layout)
    C.append_paged_kv_cache(k, v, *args, fast, *meta, kv_layout=kv_layout)
    np.testing.assert_array_equal(fast, golden)          # a copy of bits: exact
    for r in range(len(kv_lens)):                        # and the new tokens read back
        kk, vv = gather_pages(fast, b["indptr"], b["indices"], b["last"], r, kv_layout)
        rows = bi == r
        np.testing.assert_array_equal(kk[pos[rows]], k[rows])
        np.testing.assert_array_equal(vv[pos[rows]], v[rows])


def test_append_device_cache_in_place_and_errors_before_writing():
    from numba import cuda
    rng = np.random.default_rng(7)
    b = random_paged_batch(rng, qo_lens=[1, 1], kv_lens=[3, 4], page_size=2, num_kv_heads=1, group=1,
                           head_dim=4)
    k = rng.standard_normal((2, 1, 4)).astype(np.float32)
    dev = cuda.to_device(b["cache"])
    C.append_paged_kv_cache(cuda.to_device(k), cuda.to_device(k), np.array([0, 1], np.int32), np.array([2, 3], np.int32), dev,
                            b["indptr"], b["indices"], b["last"])
    golden = b["cache"].copy()
    R.append_paged_kv_cache(k, k, np.array([0, 1], np.int32), np.array([2, 3], np.int32), golden,
                            b["indptr"], b["indices"], b["last"])
    np.testing.assert_array_equal(dev.copy_to_host(), golden)
    before = b["cache"].copy()
    with pytest.raises(L.LayoutError, match="^positions"):
        C.append_paged_kv_cache(k, k, np.array([0, 1], np.int32), np.array([3, 3], np.int32), b["cache"],
                                b["indptr"], b["indices"], b["last"])
    with pytest.raises(L.LayoutError, match="^paged_kv_cache: dtype"):
        C.append_paged_kv_cache(k.astype(np.float16), k.astype(np.float16), np.array([0, 1], np.int32),
                                np.array([2, 3], np.int32), b["cache"], b["indptr"], b["indices"], b["last"])
    np.testing.assert_array_equal(b["cache"], before)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_single_decode_matches_golden(kv_layout):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    k = rng.standard_normal((11, 2, 16)).astype(np.float32)
    v = rng.standard_normal((11, 2, 16)).astype(np.float32)
    if kv_layout == "HND":
        k, v = np.ascontiguousarray(k.transpose(1, 0, 2)), np.ascontiguousarray(v.transpose(1, 0, 2))
    o, lse = C.single_decode(q, k, v, kv_layout=kv_layout, return_lse=True, logits_soft_cap=5.0)
    ro, rl = R.single_decode(q, k, v, kv_layout=kv_layout, return_lse=True, logits_soft_cap=5.0)
    assert o.shape == (4, 16) and lse.shape == (4,)
    np.testing.assert_allclose(o, ro, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(lse, rl, rtol=2e-5, atol=2e-5)
    with pytest.raises(L.LayoutError, match="^q"):
        C.single_decode(q[None], k, v, kv_layout=kv_layout)
