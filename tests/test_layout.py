"""Layout views, conversions, append, and every invalid-metadata rule."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nbattn  # noqa: F401
from nbattn import layout as L
from nbattn import reference as R

from brute import gather_pages, random_paged_batch

I32 = np.int32


def spec4():
    """The three-request example batch (page size 4, pool of 15 pages)."""
    rng = np.random.default_rng(0)
    return dict(
        q=rng.standard_normal((8, 4, 8)).astype(np.float32),
        cache=rng.standard_normal((15, 2, 4, 2, 8)).astype(np.float32),
        qo_indptr=np.array([0, 3, 4, 8], I32),
        indptr=np.array([0, 2, 3, 6], I32),
        indices=np.array([7, 2, 11, 3, 14, 6], I32),
        last=np.array([2, 2, 1], I32),
    )


def call(b, **over):
    a = dict(b, **over)
    return R.batch_prefill_paged(a["q"], a["cache"], a["qo_indptr"], a["indptr"], a["indices"], a["last"],
                                 causal=a.get("causal", True))


BAD = [
    # (what to change, argument the error must name, words of the rule)
    (dict(indptr=np.array([0, 2, 2, 5], I32), indices=np.array([7, 2, 3, 14, 6], I32)),
     "paged_kv_last_page_len", "no pages"),                                    # empty pages, non-zero length
    (dict(last=np.array([2, 0, 1], I32)), "paged_kv_last_page_len", "1..page_size"),
    (dict(last=np.array([2, 5, 1], I32)), "paged_kv_last_page_len", "1..page_size"),
    (dict(indices=np.array([7, 2, -1, 3, 14, 6], I32)), "paged_kv_indices", ">= 0"),
    (dict(indices=np.array([7, 2, 15, 3, 14, 6], I32)), "paged_kv_indices", "< num_pages"),
    (dict(indptr=np.array([0, 3, 2, 6], I32)), "paged_kv_indptr", "non-decreasing"),
    (dict(indptr=np.array([1, 2, 3, 6], I32)), "paged_kv_indptr", "start at 0"),
    (dict(indptr=np.array([0, 2, 3, 5], I32)), "paged_kv_indptr", "end at len(paged_kv_indices)"),
    (dict(indptr=np.array([0, 2, 3, 6], np.float64)), "paged_kv_indptr", "int32"),
    (dict(indptr=np.array([0, 2, 3, 2**33], np.int64)), "paged_kv_indptr", "do not fit in int32"),
    (dict(indices=np.array([7, 2, 11, 3, 14, 6], np.float32)), "paged_kv_indices", "int32"),
    (dict(last=np.array([2, 2, 1], bool)), "paged_kv_last_page_len", "int32"),
    (dict(qo_indptr=np.array([0, 3, 4, 8], np.float32)), "qo_indptr", "int32"),
    (dict(qo_indptr=np.array([0, 3, 6, 8], I32)), "qo_indptr", "qo length 3 > kv length 2"),
    (dict(qo_indptr=np.array([0, 4, 3, 8], I32)), "qo_indptr", "non-decreasing"),
    (dict(qo_indptr=np.array([0, 3, 4, 7], I32)), "qo_indptr", "must end at"),
    (dict(q=np.zeros((8, 3, 8), np.float32)), "num_qo_heads", "multiple of num_kv_heads"),
    (dict(q=np.zeros((8, 4, 6), np.float32)), "q", "head_dim"),
    (dict(q=np.zeros((8, 4, 8), np.float64)), "paged_kv_cache", "dtype must match"),
    (dict(cache=np.zeros((15, 3, 4, 2, 8), np.float32)), "paged_kv_cache", "shape"),
    (dict(last=np.array([2, 2], I32)), "paged_kv_last_page_len", "one entry per request"),
]


@pytest.mark.parametrize("change,arg,rule", BAD, ids=[f"{a}:{r}" for _, a, r in BAD])
def test_invalid_metadata_is_rejected_naming_the_argument(change, arg, rule):
    b = spec4()
    bad = dict(b, **change)
    before = {k: v.copy() for k, v in bad.items()}
    with pytest.raises(L.LayoutError) as e:
        call(bad)
    msg = str(e.value)
    assert msg.startswith(arg), msg
    assert rule in msg, msg
    for k, v in bad.items():  # nothing was modified
        np.testing.assert_array_equal(v, before[k])


def test_valid_spec4_batch_passes_and_device_mismatch_is_named():
    call(spec4())
    torch = pytest.importorskip("torch")
    b = spec4()

    class FakeCuda:  # stands for a tensor on another device
        def __init__(self, a):
            self.a, self.shape, self.dtype, self.device = a, a.shape, a.dtype, "cuda:0"

    with pytest.raises(L.LayoutError, match="one device"):
        L.check_same_device(q=torch.from_numpy(b["q"]), paged_kv_cache=FakeCuda(b["cache"]))


def test_append_rejects_before_writing():
    b = spec4()
    cache = b["cache"].copy()
    k = np.ones((2, 2, 8), np.float32)
    with pytest.raises(L.LayoutError, match="^positions"):
        R.append_paged_kv_cache(k, k, np.array([0, 2], I32), np.array([5, 9], I32), cache,
                                b["indptr"], b["indices"], b["last"])
    with pytest.raises(L.LayoutError, match="^batch_indices"):
        R.append_paged_kv_cache(k, k, np.array([0, 3], I32), np.array([5, 8], I32), cache,
                                b["indptr"], b["indices"], b["last"])
    with pytest.raises(L.LayoutError, match="^append_key"):
        R.append_paged_kv_cache(k[:, :1], k, np.array([0, 2], I32), np.array([5, 8], I32), cache,
                                b["indptr"], b["indices"], b["last"])
    np.testing.assert_array_equal(cache, b["cache"])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=4), st.sampled_from([1, 3, 4]),
       st.sampled_from(["NHD", "HND"]), st.integers(0, 2**31 - 1))
def test_appended_tokens_read_back(kv_lens, page_size, kv_layout, seed):
    rng = np.random.default_rng(seed)
    new = [int(rng.integers(0, l + 1)) for l in kv_lens]  # tokens appended at the end of each request
    b = random_paged_batch(rng, qo_lens=new, kv_lens=kv_lens, page_size=page_size, num_kv_heads=2,
                           group=1, head_dim=4, kv_layout=kv_layout)
    nnz = sum(new)
    append_indptr = np.concatenate([[0], np.cumsum(new)]).astype(I32)
    batch_indices, positions = L.get_batch_indices_positions(append_indptr, np.array(kv_lens), nnz)
    k = rng.standard_normal((nnz, 2, 4)).astype(np.float32)
    v = rng.standard_normal((nnz, 2, 4)).astype(np.float32)
    cache = b["cache"]
    untouched = cache.copy()
    R.append_paged_kv_cache(k, v, batch_indices, positions, cache, b["indptr"], b["indices"], b["last"],
                            kv_layout=kv_layout)
    written = np.zeros(cache.shape, bool)
    for i in range(nnz):
        r, t = int(batch_indices[i]), int(positions[i])
        assert t == kv_lens[r] - new[r] + (i - append_indptr[r])
        kk, vv = gather_pages(cache, b["indptr"], b["indices"], b["last"], r, kv_layout)
        np.testing.assert_array_equal(kk[t], k[i])
        np.testing.assert_array_equal(vv[t], v[i])
        page = b["indices"][b["indptr"][r] + t // page_size]
        if kv_layout == "NHD":
            written[page, :, t % page_size] = True
        else:
            written[page, :, :, t % page_size] = True
    np.testing.assert_array_equal(cache[~written], untouched[~written])  # nothing else moved


def test_page_table_bsr_round_trip_and_block_mask():
    b = spec4()
    pkv = L.PagedKV.validate(b["indptr"], b["indices"], b["last"], 4, 15)
    decode_q = np.arange(4, dtype=I32)  # one row per request
    bsr = L.page_table_to_bsr(decode_q, pkv, tile_q=1)
    assert bsr.block_shape == (1, 4) and bsr.shape == (3, 60)
    assert bsr.col_indices.tolist() == [7, 2, 11, 3, 14, 6]  # logical order kept
    mask = bsr.to_block_mask()
    assert mask.sum() == 6 and mask[2, [3, 14, 6]].all() and mask[0, [7, 2]].all()
    back = L.bsr_to_page_table(bsr, decode_q, pkv.kv_lens)
    for f in ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"):
        np.testing.assert_array_equal(getattr(back, f), getattr(pkv, f))
    again = L.BSR.from_block_mask(mask, (1, 4), (3, 60))
    np.testing.assert_array_equal(again.to_block_mask(), mask)
    assert again.col_indices.tolist() == [2, 7, 11, 3, 6, 14]  # a dense mask keeps no order
    with pytest.raises(L.LayoutError, match="^qo_indptr.*tile_q"):
        L.page_table_to_bsr(b["qo_indptr"], pkv, tile_q=2)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 12), st.integers(0, 12), st.integers(1, 5), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_bsr_mask_round_trip_arbitrary_blocks(m, n, br, bc, seed):
    rng = np.random.default_rng(seed)
    block = rng.random((-(-m // br), -(-n // bc))) < 0.4
    bsr = L.BSR.from_block_mask(block, (br, bc), (m, n))
    np.testing.assert_array_equal(bsr.to_block_mask(), block)
    elem = bsr.to_element_mask()
    assert elem.shape == (m, n)
    for i in range(m):
        for j in range(n):
            assert elem[i, j] == block[i // br, j // bc]


def test_bsr_validation_names_arguments():
    with pytest.raises(L.LayoutError, match="^block_shape"):
        L.BSR.validate(np.array([0], I32), np.zeros(0, I32), (0, 2), (0, 4))
    with pytest.raises(L.LayoutError, match="^col_indices"):
        L.BSR.validate(np.array([0, 1], I32), np.array([2], I32), (2, 2), (2, 4))
    with pytest.raises(L.LayoutError, match="^col_indices.*twice"):
        L.BSR.validate(np.array([0, 2], I32), np.array([1, 1], I32), (2, 2), (2, 4))
    with pytest.raises(L.LayoutError, match="^row_ptr"):
        L.BSR.validate(np.array([0, 1], I32), np.array([1], I32), (1, 2), (2, 4))


def test_cascade_decompose_builds_index_arrays_only():
    # four requests; 0-2 share two full pages, 3 stands alone
    ps = 2
    pages = [[5, 9, 1], [5, 9, 4, 7], [5, 9], [3, 8]]
    last = [1, 2, 2, 1]
    indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])]).astype(I32)
    pkv = L.PagedKV.validate(indptr, np.concatenate(pages).astype(I32), np.array(last, I32), ps, 10)
    qo = np.array([0, 1, 3, 4, 6], I32)
    shared, unique = L.cascade_decompose(qo, pkv)
    assert shared.qo_indptr.tolist() == [0, 4, 6]
    assert shared.paged_kv_indices.tolist() == [5, 9]
    assert shared.paged_kv_last_page_len.tolist() == [2, 0]
    assert unique.paged_kv_indices.tolist() == [1, 4, 7, 3, 8]
    assert unique.paged_kv_indptr.tolist() == [0, 1, 3, 3, 5]
    assert unique.paged_kv_last_page_len.tolist() == [1, 2, 0, 1]
    levels = L.validate_cascade([shared, unique], ps, 10, total_rows=6)
    total = levels[0][1].kv_lens[[0, 0, 0, 1]] + levels[1][1].kv_lens
    np.testing.assert_array_equal(total, pkv.kv_lens)
    with pytest.raises(L.LayoutError, match=r"^levels\[0\]\.qo_indptr.*union"):
        bad = L.CascadeLevel(np.array([0, 2, 6], I32), shared.paged_kv_indptr, shared.paged_kv_indices,
                             shared.paged_kv_last_page_len)
        L.validate_cascade([bad, unique], ps, 10)


def test_allocate_and_locate():
    rng = np.random.default_rng(2)
    pkv = L.PagedKV.allocate([5, 0, 8], 4, num_pages=10, rng=rng)
    assert pkv.kv_lens.tolist() == [5, 0, 8]
    assert pkv.paged_kv_last_page_len.tolist() == [1, 0, 4]
    assert len(set(pkv.paged_kv_indices.tolist())) == 4
    with pytest.raises(L.LayoutError, match="^t"):
        pkv.locate(0, 5)
    with pytest.raises(L.LayoutError, match="^num_pages"):
        L.PagedKV.allocate([9], 4, num_pages=2)
    assert L.as_int32("x", [1, 2]).dtype == np.int32


@pytest.mark.parametrize("last_len,ok", [((1 << 30) - 1, True), (1 << 30, False)])
def test_a_kv_length_past_int32_is_refused_by_every_page_table_check(last_len, ok):
    """Two pages of 2**30 slots hold 2**31 - 1 keys with 2**30 - 1 in the last page
    (the most an int32 KV length holds) and 2**31 with a full one.  The golden
    validate, the compiled check of the plain calls and a wrapper's plan() draw the
    line at the same place, and name paged_kv_indptr."""
    from nbattn.cuda.host import hostwork as HW
    import nbattn.cuda as C
    indptr, indices, last = np.array([0, 1, 3], I32), np.array([0, 1, 2], I32), np.array([1, last_len], I32)
    ps = 1 << 30
    assert HW.page_table_ok(indptr, indices, last, ps, 3) == ok
    ws = np.zeros(1 << 20, np.uint8)
    if ok:
        assert L.PagedKV.validate(indptr, indices, last, ps, 3).kv_lens[1] == 2**31 - 1
        C.BatchDecodeWithPagedKVCacheWrapper(ws, num_ctas=2).plan(indptr, indices, last, 2, 1, 8, ps)
        return
    for fn in (lambda: L.PagedKV.validate(indptr, indices, last, ps, 3),
               lambda: HW.page_table(indptr, indices, last, ps, 3),
               lambda: C.BatchDecodeWithPagedKVCacheWrapper(ws, num_ctas=2).plan(indptr, indices, last, 2, 1, 8, ps)):
        with pytest.raises(L.LayoutError, match=r"^paged_kv_indptr: request 1 holds 2147483648 keys; a KV length "
                                                r"must fit in int32"):
            fn()
