"""Runtime custom masks (tree / speculative decoding) in the golden model.

``custom_mask`` (bool, request r's row-major ``[qo_len[r], kv_len[r]]`` blocks
flattened and concatenated) or ``packed_custom_mask`` (the same bits, each
request's block packed little-endian on its own) on ``single_prefill``,
``batch_prefill_ragged`` and ``batch_prefill_paged``; ``packbits`` and
``segment_packbits`` (docs/concepts/custom_mask.md).

Expected values come from :func:`dense`, written for this file: float64, per
request an explicitly built boolean ``[heads, Q, K]`` mask (custom mask, window
with sinks, ``mask_mod``), one dense softmax per row over the kept keys only.
Every test draws fresh random inputs; the seed is in each assertion message.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn import reference as R
from nbattn.variants import Variant
from brute import (VARIANT_SAMPLES, assert_refused, dense_batch, fresh, gather_pages as gather, indptr_of,  # noqa: E402
                   paged_batch, ragged_batch)


def dense(q, ks, vs, qo_lens, masks, **kw):
    """The dense float64 batch attention with a custom mask per request."""
    return dense_batch(q, ks, vs, qo_lens, masks=masks, **kw)

LN2 = math.log(2.0)




# ---------------------------------------------------------------------------
# The independent brute force
# ---------------------------------------------------------------------------





# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------



def random_masks(rng, qo_lens, kv_lens, p=0.6):
    return [rng.random((int(a), int(b))) < p for a, b in zip(qo_lens, kv_lens)]


def flat(masks):
    return np.concatenate([m.ravel() for m in masks]) if masks else np.zeros(0, bool)


def packed(masks):
    return np.concatenate([np.packbits(m.ravel(), bitorder="little") for m in masks]).astype(np.uint8)






def tree_mask(prefix, parents):
    """Draft token t sees the prefix, itself and its ancestors (``parents[t] = -1``: a root)."""
    m = np.zeros((len(parents), prefix + len(parents)), bool)
    m[:, :prefix] = True
    for t in range(len(parents)):
        a = t
        while a != -1:
            m[t, prefix + a] = True
            a = parents[a]
    return m


def random_tree(rng, n):
    return [-1] + [int(rng.integers(-1, t)) for t in range(1, n)]


def close(got, want, seed, what, atol=1e-5, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol, rtol=rtol,
                               err_msg=f"{what} (seed={seed})")


# ---------------------------------------------------------------------------
# Against the brute force
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["2d", "flat", "packed"])
def test_single_prefill(kv_layout, form):
    rng, seed = fresh()
    nq, nk = int(rng.integers(1, 9)), int(rng.integers(1, 15))
    q, k, v, _, _ = ragged_batch(rng, [nq], [nk], hkv=2, group=4)
    m = rng.random((nq, nk)) < 0.5
    arg = {"2d": dict(custom_mask=m), "flat": dict(custom_mask=m.ravel()),
           "packed": dict(packed_custom_mask=np.packbits(m.ravel(), bitorder="little"))}[form]
    kk, vv = (k, v) if kv_layout == "NHD" else (k.transpose(1, 0, 2).copy(), v.transpose(1, 0, 2).copy())
    want_o, want_l = dense(q, [k], [v], [nq], [m])
    for dt, tol in ((np.float64, 1e-12), (np.float32, 2e-5)):
        o, lse = R.single_prefill(q, kk, vv, kv_layout=kv_layout, return_lse=True, dtype=dt, **arg)
        close(o, want_o, seed, f"o {dt.__name__}", atol=tol, rtol=tol)
        close(lse, want_l, seed, f"lse {dt.__name__}", atol=tol, rtol=tol)


@pytest.mark.parametrize("extra", ["none", "window_sinks", "mask_mod", "sm_scale"])
def test_batch_prefill_ragged(extra):
    rng, seed = fresh()
    qo_lens = [3, 0, 2, 5, 0, 1]          # empty requests, and a request with rows but no keys
    kv_lens = [6, 4, 0, 9, 0, 7]
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, qo_lens, kv_lens)
    masks = random_masks(rng, qo_lens, kv_lens)
    kw = {"none": {}, "window_sinks": dict(window_left=2, sink_size=1),
          "mask_mod": dict(mask_mod=lambda b, h, qi, kj: (kj + h + b) % 3 != 0),
          "sm_scale": dict(sm_scale=0.37)}[extra]
    ks = [k[kv_indptr[r]:kv_indptr[r + 1]] for r in range(len(qo_lens))]
    vs = [v[kv_indptr[r]:kv_indptr[r + 1]] for r in range(len(qo_lens))]
    want_o, want_l = dense(q, ks, vs, qo_lens, masks, **kw)
    for arg in (dict(custom_mask=flat(masks)), dict(packed_custom_mask=packed(masks))):
        o, lse = R.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, return_lse=True, dtype=np.float64,
                                        **arg, **kw)
        close(o, want_o, seed, f"o {list(arg)}", atol=1e-12, rtol=1e-12)
        close(lse, want_l, seed, f"lse {list(arg)}", atol=1e-12, rtol=1e-12)
    assert (lse[qo_indptr[2]:qo_indptr[3]] == -np.inf).all(), f"a request with no keys is empty (seed={seed})"


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 4, 5])
def test_batch_prefill_paged(kv_layout, page_size):
    rng, seed = fresh()
    qo_lens = [2, 0, 4, 3, 1]
    kv_lens = [7, 3, 0, 9, 11]            # last pages not full for page_size 4 and 5
    q, cache, qo_indptr, indptr, indices, last = paged_batch(rng, qo_lens, kv_lens, page_size, kv_layout)
    masks = random_masks(rng, qo_lens, kv_lens, p=0.5)
    kvs = [gather(cache, indptr, indices, last, r, kv_layout) for r in range(len(qo_lens))]
    want_o, want_l = dense(q, [a for a, _ in kvs], [b for _, b in kvs], qo_lens, masks, window_left=5, sink_size=2)
    for arg in (dict(custom_mask=flat(masks)), dict(packed_custom_mask=packed(masks))):
        o, lse = R.batch_prefill_paged(q, cache, qo_indptr, indptr, indices, last, kv_layout=kv_layout,
                                       return_lse=True, dtype=np.float64, window_left=5, sink_size=2, **arg)
        close(o, want_o, seed, f"o {list(arg)}", atol=1e-12, rtol=1e-12)
        close(lse, want_l, seed, f"lse {list(arg)}", atol=1e-12, rtol=1e-12)
        o32 = R.batch_prefill_paged(q, cache, qo_indptr, indptr, indices, last, kv_layout=kv_layout,
                                    window_left=5, sink_size=2, **arg)
        close(o32, want_o, seed, f"o float32 {list(arg)}", atol=2e-5, rtol=2e-5)


def test_tree_mask_speculative_decoding():
    """Each request verifies a random draft tree after its prefix (paged cache)."""
    rng, seed = fresh()
    prefixes, sizes = [5, 0, 9], [4, 3, 6]
    trees = [random_tree(rng, n) for n in sizes]
    masks = [tree_mask(p, t) for p, t in zip(prefixes, trees)]
    kv_lens = [p + n for p, n in zip(prefixes, sizes)]
    q, cache, qo_indptr, indptr, indices, last = paged_batch(rng, sizes, kv_lens, 4, "NHD")
    kvs = [gather(cache, indptr, indices, last, r, "NHD") for r in range(3)]
    want_o, want_l = dense(q, [a for a, _ in kvs], [b for _, b in kvs], sizes, masks)
    o, lse = R.batch_prefill_paged(q, cache, qo_indptr, indptr, indices, last, custom_mask=flat(masks),
                                   return_lse=True, dtype=np.float64)
    close(o, want_o, seed, f"o, trees {trees}", atol=1e-12, rtol=1e-12)
    close(lse, want_l, seed, f"lse, trees {trees}", atol=1e-12, rtol=1e-12)
    # a draft token's row is plain attention over the prefix and its root-to-token path
    for r, (p, tree) in enumerate(zip(prefixes, trees)):
        k, v = kvs[r]
        for t in range(len(tree)):
            path = np.flatnonzero(masks[r][t])
            row = qo_indptr[r] + t
            o1 = R.single_prefill(q[row:row + 1], k[path], v[path], dtype=np.float64)
            close(o[row:row + 1], o1, seed, f"request {r} token {t}, tree {tree}", atol=1e-12, rtol=1e-12)


def test_chain_tree_is_causal():
    """A tree that is one chain is the causal mask: the same bits, so the same bytes."""
    rng, seed = fresh()
    prefix, n = int(rng.integers(0, 8)), int(rng.integers(1, 7))
    m = tree_mask(prefix, [t - 1 for t in range(n)])
    q, k, v, _, _ = ragged_batch(rng, [n], [prefix + n])
    a = R.single_prefill(q, k, v, custom_mask=m, return_lse=True)
    b = R.single_prefill(q, k, v, causal=True, return_lse=True)
    for x, y, what in zip(a, b, ("o", "lse")):
        assert x.tobytes() == y.tobytes(), f"{what} (seed={seed})"


def test_row_with_no_kept_key_is_empty():
    rng, seed = fresh()
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, [4, 3], [6, 5])
    masks = random_masks(rng, [4, 3], [6, 5])
    masks[0][1] = False                   # request 0, row 1 keeps nothing
    masks[1][:] = False                   # request 1 keeps nothing at all
    masks[0][0] = True
    masks[0][[2, 3], 0] = True            # rows 2 and 3 keep at least key 0 (a random row may keep none)
    for arg in (dict(custom_mask=flat(masks)), dict(packed_custom_mask=packed(masks))):
        o, lse = R.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, return_lse=True, **arg)
        for row in [1, 4, 5, 6]:
            assert (o[row] == 0).all() and (lse[row] == -np.inf).all(), f"row {row} {list(arg)} (seed={seed})"
        assert np.isfinite(lse[[0, 2, 3]]).all(), f"{list(arg)} (seed={seed})"
        want_o, want_l = dense(q, [k[:6], k[6:]], [v[:6], v[6:]], [4, 3], masks)
        close(o, want_o, seed, f"o {list(arg)}")
        close(lse, want_l, seed, f"lse {list(arg)}")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["V", "K"])
def test_masked_out_key_never_reaches_a_row(bad, where):
    """A non-finite K or V of a key the custom mask hides leaves the row as if the key
    were absent; a row that keeps the key is NaN (the NaN rule, docs/bad_input.md)."""
    rng, seed = fresh()
    nq, nk, j = 4, 7, int(rng.integers(0, 7))
    q, k, v, _, _ = ragged_batch(rng, [nq], [nk])
    (v if where == "V" else k)[j, 1, int(rng.integers(0, 16))] = bad
    m = rng.random((nq, nk)) < 0.7
    m[:2, j] = False                      # rows 0, 1 cannot see key j
    m[2:, j] = True                       # rows 2, 3 can
    m[:2, (j + 1) % nk] = True            # and every row keeps some other key
    keep = np.delete(np.arange(nk), j)
    hidden_o, hidden_l = dense(q[:2], [k[keep]], [v[keep]], [2], [m[:2][:, keep]])
    for arg in (dict(custom_mask=m), dict(packed_custom_mask=np.packbits(m.ravel(), bitorder="little"))):
        o, lse = R.single_prefill(q, k, v, return_lse=True, dtype=np.float64, **arg)
        assert np.isfinite(o[:2]).all() and np.isfinite(lse[:2]).all(), f"{where}={bad} (seed={seed})"
        close(o[:2], hidden_o, seed, f"hidden key, {where}={bad}", atol=1e-12, rtol=1e-12)
        close(lse[:2], hidden_l, seed, f"hidden key, {where}={bad}", atol=1e-12, rtol=1e-12)
        # GQA: kv head 1 serves query heads 2, 3; those rows are NaN, heads 0, 1 are not
        assert np.isnan(o[2:, 2:]).all() and np.isnan(lse[2:, 2:]).all(), f"{where}={bad} (seed={seed})"
        assert np.isfinite(o[2:, :2]).all() and np.isfinite(lse[2:, :2]).all(), f"{where}={bad} (seed={seed})"


@pytest.mark.parametrize("dt,tol", [(np.float64, 1e-9), (np.float32, 1e-4)])
def test_logits_of_plus_minus_1000(dt, tol):
    rng, seed = fresh()
    nq, nk, d = 5, 9, 8
    q = np.zeros((nq, 2, d), np.float32)
    q[:, :, 0] = 1000.0
    k = np.zeros((nk, 1, d), np.float32)
    k[:, 0, 0] = rng.choice([-1.0, 1.0], nk) + rng.uniform(-0.004, 0.004, nk)
    v = rng.standard_normal((nk, 1, d)).astype(np.float32)
    m = rng.random((nq, nk)) < 0.5
    m[0] = k[:, 0, 0] < 0                 # row 0 keeps only the -1000 logits
    m[1] = k[:, 0, 0] > 0                 # row 1 only the +1000 ones
    m[2, :] = False
    m[2, int(np.argmax(k[:, 0, 0]))] = True
    want_o, want_l = dense(q, [k], [v], [nq], [m], sm_scale=1.0)
    o, lse = R.single_prefill(q, k, v, custom_mask=m, sm_scale=1.0, return_lse=True, dtype=dt)
    assert np.isfinite(o).all(), f"seed={seed}"
    close(o, want_o, seed, "o", atol=tol, rtol=tol)
    close(lse, want_l, seed, "lse", atol=tol, rtol=tol)


def test_packed_equals_unpacked_bitwise():
    rng, seed = fresh()
    qo_lens, kv_lens = [3, 0, 5, 2], [4, 2, 7, 0]
    masks = random_masks(rng, qo_lens, kv_lens)
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, qo_lens, kv_lens)
    a = R.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, custom_mask=flat(masks), return_lse=True)
    p, _ = R.segment_packbits(flat(masks), indptr_of([a * b for a, b in zip(qo_lens, kv_lens)]), bitorder="little")
    b = R.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, packed_custom_mask=p, return_lse=True)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b)), f"ragged (seed={seed})"
    pq, cache, pqo, indptr, indices, last = paged_batch(rng, qo_lens, kv_lens, 3, "HND")
    a = R.batch_prefill_paged(pq, cache, pqo, indptr, indices, last, kv_layout="HND", custom_mask=flat(masks))
    b = R.batch_prefill_paged(pq, cache, pqo, indptr, indices, last, kv_layout="HND", packed_custom_mask=p)
    assert a.tobytes() == b.tobytes(), f"paged (seed={seed})"
    m = masks[2]
    a = R.single_prefill(q[3:8], k[6:13], v[6:13], custom_mask=m)
    b = R.single_prefill(q[3:8], k[6:13], v[6:13], packed_custom_mask=R.packbits(m.ravel(), bitorder="little"))
    assert a.tobytes() == b.tobytes(), f"single (seed={seed})"


def test_all_true_mask_is_no_mask():
    rng, seed = fresh()
    qo_lens, kv_lens = [3, 4], [5, 8]
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, qo_lens, kv_lens)
    ones = np.ones(3 * 5 + 4 * 8, bool)
    for kw in ({}, dict(window_left=3), dict(logits_soft_cap=5.0)):
        a = R.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, return_lse=True, **kw)
        b = R.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, return_lse=True, custom_mask=ones, **kw)
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b)), f"{kw} (seed={seed})"


def test_torch_mask():
    torch = pytest.importorskip("torch")
    rng, seed = fresh()
    q, k, v, _, _ = ragged_batch(rng, [3], [6])
    m = rng.random((3, 6)) < 0.5
    want = R.single_prefill(q, k, v, custom_mask=m)
    got = R.single_prefill(*(torch.from_numpy(x) for x in (q, k, v)), custom_mask=torch.from_numpy(m))
    assert isinstance(got, torch.Tensor) and got.numpy().tobytes() == want.tobytes(), f"seed={seed}"
    got = R.single_prefill(q, k, v, packed_custom_mask=R.packbits(torch.from_numpy(m.ravel()), bitorder="little"))
    assert got.numpy().tobytes() == want.tobytes(), f"seed={seed}"


# ---------------------------------------------------------------------------
# None is the old behaviour
# ---------------------------------------------------------------------------

VARIANTS = VARIANT_SAMPLES


@pytest.mark.parametrize("kw", VARIANTS, ids=range(len(VARIANTS)))
def test_none_is_the_same_bytes_as_not_passing_it(kw):
    rng, seed = fresh()
    qo_lens, kv_lens = [3, 0, 2], [5, 1, 6]
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, qo_lens, kv_lens)
    lse = {} if kw.get("use_sigmoid") else dict(return_lse=True)
    none = dict(custom_mask=None, packed_custom_mask=None)

    def same(a, b, what):
        a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b)), f"{what} {kw} (seed={seed})"

    same(R.single_prefill(q[:3], k[:5], v[:5], **lse, **kw),
         R.single_prefill(q[:3], k[:5], v[:5], **lse, **kw, **none), "single_prefill")
    same(R.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, **lse, **kw),
         R.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, **lse, **kw, **none), "ragged")
    pq, cache, pqo, indptr, indices, last = paged_batch(rng, qo_lens, kv_lens, 4, "NHD")
    same(R.batch_prefill_paged(pq, cache, pqo, indptr, indices, last, **lse, **kw),
         R.batch_prefill_paged(pq, cache, pqo, indptr, indices, last, **lse, **kw, **none), "paged")


# ---------------------------------------------------------------------------
# packbits / segment_packbits
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("bitorder", ["little", "big"])
def test_packbits_is_numpys(bitorder):
    rng, seed = fresh()
    for n in [0, 1, 7, 8, 9, 16, int(rng.integers(17, 200))]:
        x = rng.random(n) < 0.5
        got = R.packbits(x, bitorder=bitorder)
        assert got.dtype == np.uint8 and got.shape == ((n + 7) // 8,), f"n={n} (seed={seed})"
        assert np.array_equal(got, np.packbits(x, bitorder=bitorder)), f"n={n} (seed={seed})"
    x = rng.random(13) < 0.5
    assert np.array_equal(R.packbits(x), np.packbits(x, bitorder="big")), f"default is big, as FlashInfer's (seed={seed})"


@pytest.mark.parametrize("bitorder", ["little", "big"])
def test_segment_packbits_is_numpy_per_segment(bitorder):
    rng, seed = fresh()
    lens = [0, 1, 8, 0, 9, int(rng.integers(0, 40)), 15, 0]
    indptr = indptr_of(lens)
    x = rng.random(int(indptr[-1])) < 0.5
    got, new = R.segment_packbits(x, indptr, bitorder=bitorder)
    assert new.dtype == np.int32 and np.array_equal(np.diff(new), [(n + 7) // 8 for n in lens]), f"seed={seed}"
    assert new[0] == 0 and got.dtype == np.uint8 and got.shape == (int(new[-1]),), f"seed={seed}"
    for i in range(len(lens)):
        want = np.packbits(x[indptr[i]:indptr[i + 1]], bitorder=bitorder)
        assert np.array_equal(got[new[i]:new[i + 1]], want), f"segment {i}, lens {lens} (seed={seed})"
    # segments of 4, 3 and 4 bits, little- and big-endian (the default)
    bits = np.array([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1], bool)
    y, ptr = R.segment_packbits(bits, [0, 4, 7, 11], bitorder="little")
    assert y.tolist() == [0b1101, 0b100, 0b1011] and ptr.tolist() == [0, 1, 2, 3]
    y, ptr = R.segment_packbits(bits, [0, 4, 7, 11])
    assert y.tolist() == [0b10110000, 0b100000, 0b11010000] and ptr.tolist() == [0, 1, 2, 3]


def test_segment_packbits_gives_the_packed_custom_mask():
    """``segment_packbits`` over ``qk_indptr`` is the layout ``packed_custom_mask`` reads."""
    rng, seed = fresh()
    qo_lens, kv_lens = [2, 3, 0, 1], [3, 5, 4, 9]
    masks = random_masks(rng, qo_lens, kv_lens)
    p, new = R.segment_packbits(flat(masks), indptr_of([a * b for a, b in zip(qo_lens, kv_lens)]), bitorder="little")
    assert np.array_equal(p, packed(masks)), f"seed={seed}"


# ---------------------------------------------------------------------------
# Validation: one case per rule; the message names the argument; nothing changes
# ---------------------------------------------------------------------------

def _case():
    rng = np.random.default_rng()
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, [2, 3], [4, 5])      # mask length 8 + 15 = 23
    pq, cache, pqo, indptr, indices, last = paged_batch(rng, [2, 3], [4, 5], 4, "NHD")
    return dict(q=q, k=k, v=v, qo=qo_indptr, kv=kv_indptr, pq=pq, cache=cache, pqo=pqo, indptr=indptr,
                indices=indices, last=last, m23=rng.random(23) < 0.5, m8=rng.random((2, 4)) < 0.5,
                out=np.full(q.shape, 7.0, np.float32))


def _ragged(d, **kw):
    return R.batch_prefill_ragged(d["q"], d["k"], d["v"], d["qo"], d["kv"], out=d["out"], **kw)


def _paged(d, **kw):
    return R.batch_prefill_paged(d["pq"], d["cache"], d["pqo"], d["indptr"], d["indices"], d["last"],
                                 out=d["out"], **kw)


def _single(d, **kw):
    return R.single_prefill(d["q"][:2], d["k"][:4], d["v"][:4], **kw)


# (id, argument the message starts with, a phrase of the rule, call)
RULES = [
    ("mask_dtype_uint8", "custom_mask", "must be bool", lambda d: _ragged(d, custom_mask=d["m23"].astype(np.uint8))),
    ("mask_dtype_int_single", "custom_mask", "must be bool", lambda d: _single(d, custom_mask=d["m8"].astype(int))),
    ("mask_length_ragged", "custom_mask", "sum(qo_len[i] * kv_len[i]) = 23",
     lambda d: _ragged(d, custom_mask=d["m23"][:22])),
    ("mask_length_paged", "custom_mask", "sum(qo_len[i] * kv_len[i]) = 23",
     lambda d: _paged(d, custom_mask=d["m23"][:-1])),
    ("mask_2d_batch", "custom_mask", "1-D of length", lambda d: _ragged(d, custom_mask=d["m23"][:22].reshape(2, 11))),
    ("mask_shape_single", "custom_mask", "[qo_len, kv_len] = [2, 4]", lambda d: _single(d, custom_mask=d["m8"].T)),
    ("mask_length_single", "custom_mask", "qo_len * kv_len = 8", lambda d: _single(d, custom_mask=d["m23"][:9])),
    ("packed_dtype", "packed_custom_mask", "must be uint8",
     lambda d: _ragged(d, packed_custom_mask=np.packbits(d["m23"]).astype(np.int8))),
    ("packed_length_ragged", "packed_custom_mask", "sum(ceil(qo_len[i] * kv_len[i] / 8)) = 3",      # 1 + 2 bytes
     lambda d: _ragged(d, packed_custom_mask=np.zeros(4, np.uint8))),
    ("packed_length_paged", "packed_custom_mask", "sum(ceil(qo_len[i] * kv_len[i] / 8)) = 3",
     lambda d: _paged(d, packed_custom_mask=np.zeros(2, np.uint8))),
    ("packed_length_single", "packed_custom_mask", "ceil(qo_len * kv_len / 8) = 1",
     lambda d: _single(d, packed_custom_mask=np.zeros(2, np.uint8))),
    ("both", "packed_custom_mask", "not both", lambda d: _ragged(
        d, custom_mask=d["m23"], packed_custom_mask=np.packbits(d["m23"], bitorder="little"))),
    ("causal_ragged", "custom_mask", "causal=True", lambda d: _ragged(d, custom_mask=d["m23"], causal=True)),
    ("causal_paged", "custom_mask", "causal=True", lambda d: _paged(d, custom_mask=d["m23"], causal=True)),
    ("causal_variant_single", "custom_mask", "causal=True",
     lambda d: _single(d, custom_mask=d["m8"], variant=Variant(causal=True))),
    ("causal_packed", "packed_custom_mask", "causal=True",
     lambda d: _paged(d, packed_custom_mask=np.zeros(3, np.uint8), causal=True)),
    ("packbits_2d", "x", "1-D", lambda d: R.packbits(d["m8"])),
    ("packbits_float", "x", "bool", lambda d: R.packbits(d["m23"].astype(np.float32))),
    ("packbits_bitorder", "bitorder", "'big' or 'little'", lambda d: R.packbits(d["m23"], bitorder="LITTLE")),
    ("segment_indptr_end", "indptr", "len(x) (23)", lambda d: R.segment_packbits(d["m23"], [0, 8, 22])),
]


@pytest.mark.parametrize("name,arg,rule,call", RULES, ids=[r[0] for r in RULES])
def test_rule(name, arg, rule, call):
    assert_refused(call, _case(), arg, rule, name)


def test_packing_the_whole_mask_at_once_is_refused():
    """Each request's block is packed on its own: two 1 x 4 blocks take 1 + 1 bytes,
    not the ceil(8 / 8) = 1 byte of ``packbits`` over the whole flattened mask."""
    rng, seed = fresh()
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, [1, 1], [4, 4])
    m = rng.random(8) < 0.5
    before = [x.copy() for x in (q, k, v, m)]
    with pytest.raises(ValueError, match=r"^packed_custom_mask: .*sum\(ceil\(qo_len\[i\] \* kv_len\[i\] / 8\)\) = 2 .*"
                                         r"got shape \(1,\)"):
        R.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, packed_custom_mask=np.packbits(m, bitorder="little"))
    assert all(a.tobytes() == b.tobytes() for a, b in zip((q, k, v, m), before)), f"seed={seed}"
    seg, _ = R.segment_packbits(m, [0, 4, 8], bitorder="little")
    o = R.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, packed_custom_mask=seg)
    assert o.tobytes() == R.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, custom_mask=m).tobytes(), \
        f"seed={seed}"


@pytest.mark.parametrize("fn", ["single_decode", "batch_decode_paged"])
def test_decode_forms_take_no_custom_mask(fn):
    d = _case()
    with pytest.raises(TypeError, match="custom_mask"):
        if fn == "single_decode":
            R.single_decode(d["q"][0], d["k"], d["v"], custom_mask=np.ones(5, bool))
        else:
            R.batch_decode_paged(d["pq"][:2], d["cache"], d["indptr"], d["indices"], d["last"],
                                 custom_mask=np.ones(9, bool))
