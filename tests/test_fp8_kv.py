"""fp8 KV caches in the golden model: torch ``float8_e4m3fn`` / ``float8_e5m2`` K/V
with scalar ``k_scale`` / ``v_scale`` (docs/concepts/layouts.md, "fp8 KV caches").

K is read as ``k.float() * k_scale`` and V as ``v.float() * v_scale``; q keeps
its own dtype.  Expected values come from this file: the fp8 data is
dequantized with torch here (``.to(torch.float32)``, exact), scaled in float64,
and fed to :func:`dense`, a float64 brute force over explicitly built lists of
visible keys.  Quantization (``append_paged_kv_cache`` into an fp8 cache) is
checked against an exact nearest-value search over every fp8 value, decoded
from its bits by hand.  Every test draws fresh random inputs; the seed is in
each assertion message.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import nbattn  # noqa: F401  (compat first)
from nbattn import layout as L
from nbattn import reference as R
from nbattn.reference.fp8 import quantize
from brute import assert_refused, dense_batch as dense, fresh, gather_pages as gather, indptr_of, shuffled_pages  # noqa: E402

LN2 = math.log(2.0)
FP8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FMT = {"e4m3fn": (4, 3, 7), "e5m2": (5, 2, 15)}      # exponent bits, mantissa bits, bias
FMAX = {"e4m3fn": 448.0, "e5m2": 57344.0}
QDT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}




# ---------------------------------------------------------------------------
# The independent references
# ---------------------------------------------------------------------------

def decode_bits(code: int, fmt: str) -> float:
    """An fp8 byte by hand: sign, exponent, mantissa (NaN / inf by the format's rules)."""
    e_bits, m_bits, bias = FMT[fmt]
    sign = -1.0 if code & 0x80 else 1.0
    e = (code >> m_bits) & ((1 << e_bits) - 1)
    m = code & ((1 << m_bits) - 1)
    if fmt == "e4m3fn" and e == 15 and m == 7:
        return math.nan                       # e4m3fn: no infinity, one NaN pattern a sign
    if fmt == "e5m2" and e == 31:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - m_bits)
    return sign * (1 + m / 2 ** m_bits) * 2.0 ** (e - bias)


def finite_table(fmt):
    """(value, code) of every finite fp8 value, codes with the sign bit 0 and 1."""
    out = [(decode_bits(c, fmt), c) for c in range(256)]
    return [(v, c) for v, c in out if math.isfinite(v)]


def nearest_code(x: float, scale: float, fmt: str) -> int:
    """The code of the fp8 value nearest to the exact rational ``x / scale``, ties to
    an even mantissa, beyond the largest value the largest (saturation); the sign
    is ``x``'s (so -0.0 and tiny negatives give -0)."""
    mag = min(abs(Fraction(x) / Fraction(scale)), Fraction(FMAX[fmt]))
    best = None
    for v, c in finite_table(fmt):
        if c & 0x80:
            continue
        key = (abs(Fraction(v) - mag), c & 1)     # ties: the even code (last mantissa bit 0)
        if best is None or key < best[0]:
            best = (key, c)
    return best[1] | (0x80 if math.copysign(1.0, x) < 0 else 0)


def deq(t, scale):
    """The test's own dequantization: torch's exact fp8 -> float32, then float64 times the scale."""
    return t.to(torch.float32).numpy().astype(np.float64) * (1.0 if scale is None else scale)


def q64(q):
    return q.to(torch.float32).numpy().astype(np.float64) if isinstance(q, torch.Tensor) else np.asarray(q, np.float64)






# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------



def scales(rng):
    return float(rng.uniform(0.02, 0.3)), float(rng.uniform(0.5, 4.0))


def to_fp8(x, fmt, scale):
    """Test data in fp8: torch's own cast of ``x / scale`` (values well inside the range)."""
    return torch.from_numpy(np.asarray(x / scale, np.float32)).to(FP8[fmt])


def query(rng, shape, qdt):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(QDT[qdt])


def contiguous(rng, nq, nk, fmt, qdt, hkv=2, group=2, d=16, ks=0.1, vs=2.0):
    q = query(rng, (nq, hkv * group, d), qdt)
    k = to_fp8(rng.standard_normal((nk, hkv, d)) * ks * 20, fmt, ks)
    v = to_fp8(rng.standard_normal((nk, hkv, d)) * vs * 3, fmt, vs)
    return q, k, v


def paged(rng, qo_lens, kv_lens, page_size, kv_layout, fmt, qdt, hkv=2, group=3, d=8, ks=0.1, vs=2.0):
    """Shuffled pages in a larger pool; empty requests have no pages and last_page_len 0."""
    pool, indptr, indices, last = shuffled_pages(rng, kv_lens, page_size)
    shape = (pool, 2, page_size, hkv, d) if kv_layout == "NHD" else (pool, 2, hkv, page_size, d)
    raw = rng.standard_normal(shape)
    raw[:, 0] *= 20 * ks
    raw[:, 1] *= 3 * vs
    cache = torch.from_numpy(raw.astype(np.float32))
    cache[:, 0] /= ks
    cache[:, 1] /= vs
    cache = cache.to(FP8[fmt])
    q = query(rng, (int(sum(qo_lens)), hkv * group, d), qdt)
    return q, cache, indptr_of(qo_lens), indptr, indices, last


def deq_cache(cache, ks, vs):
    c = cache.to(torch.float32).numpy().astype(np.float64)
    c[:, 0] *= ks
    c[:, 1] *= vs
    return c


def close(got, want, seed, what, atol=1e-5, rtol=1e-5):
    got = got.to(torch.float64).numpy() if isinstance(got, torch.Tensor) else np.asarray(got, np.float64)
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=f"{what} (seed={seed})")


def same_bytes(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    def raw(x):
        return x.contiguous().view(torch.uint8).numpy().tobytes() if isinstance(x, torch.Tensor) else x.tobytes()
    return len(a) == len(b) and all(raw(x) == raw(y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------
# Dequantization: what torch reads is what the bits say
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(FP8))
def test_every_fp8_value_dequantizes_exactly(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = codes.view(FP8[fmt]).to(torch.float32).numpy().astype(np.float64)
    want = np.array([decode_bits(c, fmt) for c in range(256)])
    assert np.array_equal(got, want, equal_nan=True)
    assert np.nanmax(np.abs(want[np.isfinite(want)])) == FMAX[fmt]


# ---------------------------------------------------------------------------
# Attention over fp8 K/V against the brute force
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("qdt", list(QDT))
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True])
def test_single_prefill(fmt, qdt, kv_layout, causal):
    rng, seed = fresh()
    ks, vs = scales(rng)
    nk = int(rng.integers(1, 15))
    nq = int(rng.integers(1, nk + 1))
    q, k, v = contiguous(rng, nq, nk, fmt, qdt, hkv=2, group=4, ks=ks, vs=vs)
    want_o, want_l = dense(q64(q), [deq(k, ks)], [deq(v, vs)], [nq], causal=causal)
    kk, vv = (k, v) if kv_layout == "NHD" else (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    for dt, tol in ((np.float64, 1e-12), (np.float32, 3e-5)):
        o, lse = R.single_prefill(q, kk, vv, kv_layout=kv_layout, causal=causal, k_scale=ks, v_scale=vs,
                                  return_lse=True, dtype=dt)
        close(o, want_o, seed, f"o {fmt} q={qdt} {dt.__name__}", atol=tol, rtol=tol)
        close(lse, want_l, seed, f"lse {fmt} q={qdt} {dt.__name__}", atol=tol, rtol=tol)


@pytest.mark.parametrize("fmt", list(FP8))
def test_single_decode(fmt):
    rng, seed = fresh()
    ks, vs = scales(rng)
    nk = int(rng.integers(1, 30))
    q, k, v = contiguous(rng, 1, nk, fmt, "bfloat16", hkv=1, group=4, ks=ks, vs=vs)
    want_o, want_l = dense(q64(q), [deq(k, ks)], [deq(v, vs)], [1], window_left=6)
    o, lse = R.single_decode(q[0], k, v, k_scale=ks, v_scale=vs, window_left=6, return_lse=True,
                             dtype=np.float64)
    close(o, want_o[0], seed, "o", atol=1e-12, rtol=1e-12)
    close(lse, want_l[0], seed, "lse", atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("qdt", ["float16", "float32"])
def test_batch_prefill_ragged(fmt, qdt):
    rng, seed = fresh()
    ks, vs = scales(rng)
    qo_lens, kv_lens = [3, 0, 2, 5, 0, 1], [6, 4, 0, 9, 0, 7]      # empty requests, one with rows and no keys
    q, k, v = contiguous(rng, sum(qo_lens), sum(kv_lens), fmt, qdt, ks=ks, vs=vs)
    kv_indptr = indptr_of(kv_lens)
    kd, vd = deq(k, ks), deq(v, vs)
    split = [slice(kv_indptr[r], kv_indptr[r + 1]) for r in range(len(kv_lens))]
    want_o, want_l = dense(q64(q), [kd[s] for s in split], [vd[s] for s in split], qo_lens, sm_scale=0.3)
    o, lse = R.batch_prefill_ragged(q, k, v, indptr_of(qo_lens), kv_indptr, k_scale=ks, v_scale=vs,
                                    sm_scale=0.3, return_lse=True, dtype=np.float64)
    close(o, want_o, seed, "o", atol=1e-12, rtol=1e-12)
    close(lse, want_l, seed, "lse", atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 4, 5])
def test_batch_prefill_paged(fmt, kv_layout, page_size):
    rng, seed = fresh()
    ks, vs = scales(rng)
    qo_lens, kv_lens = [2, 0, 0, 3, 1], [7, 3, 0, 9, 11]           # an empty request; last pages not full
    q, cache, qo_indptr, indptr, indices, last = paged(rng, qo_lens, kv_lens, page_size, kv_layout, fmt,
                                                       "float16", ks=ks, vs=vs)
    c = deq_cache(cache, ks, vs)
    kvs = [gather(c, indptr, indices, last, r, kv_layout) for r in range(len(qo_lens))]
    want_o, want_l = dense(q64(q), [a for a, _ in kvs], [b for _, b in kvs], qo_lens, causal=True)
    o, lse = R.batch_prefill_paged(q, cache, qo_indptr, indptr, indices, last, kv_layout=kv_layout, causal=True,
                                   k_scale=ks, v_scale=vs, return_lse=True, dtype=np.float64)
    close(o, want_o, seed, "o", atol=1e-12, rtol=1e-12)
    close(lse, want_l, seed, "lse", atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_batch_decode_paged(fmt, kv_layout, page_size):
    rng, seed = fresh()
    ks, vs = scales(rng)
    kv_lens = [5, 0, 1, 10, 17]
    q, cache, _, indptr, indices, last = paged(rng, [1] * 5, kv_lens, page_size, kv_layout, fmt, "bfloat16",
                                               group=4, ks=ks, vs=vs)
    c = deq_cache(cache, ks, vs)
    kvs = [gather(c, indptr, indices, last, r, kv_layout) for r in range(5)]
    want_o, want_l = dense(q64(q), [a for a, _ in kvs], [b for _, b in kvs], [1] * 5)
    for dt, tol in ((np.float64, 1e-12), (np.float32, 3e-5)):
        o, lse = R.batch_decode_paged(q, cache, indptr, indices, last, kv_layout=kv_layout, k_scale=ks,
                                      v_scale=vs, return_lse=True, dtype=dt)
        assert isinstance(o, torch.Tensor), f"torch in, torch out (seed={seed})"
        close(o, want_o, seed, f"o {dt.__name__}", atol=tol, rtol=tol)
        close(lse, want_l, seed, f"lse {dt.__name__}", atol=tol, rtol=tol)
    assert (o[1] == 0).all() and torch.isneginf(lse[1]).all(), f"the empty request (seed={seed})"


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_reads_equal_their_dequantized_values_bitwise(fmt):
    """fp8 K/V with scales give the same bytes as float64 K/V holding ``x.float() * scale``."""
    rng, seed = fresh()
    ks, vs = scales(rng)
    q, k, v = contiguous(rng, 4, 9, fmt, "float16", ks=ks, vs=vs)
    q64_ = q64(q)
    for dt in (np.float64, np.float32):
        a = R.single_prefill(q, k, v, k_scale=ks, v_scale=vs, return_lse=True, dtype=dt, causal=True)
        b = R.single_prefill(q64_, deq(k, ks), deq(v, vs), return_lse=True, dtype=dt, causal=True)
        assert same_bytes(tuple(x.numpy() for x in a), b), f"{dt.__name__} (seed={seed})"


def test_no_scale_is_a_scale_of_one():
    rng, seed = fresh()
    for fmt in FP8:
        q, k, v = contiguous(rng, 3, 7, fmt, "float32")
        a = R.single_prefill(q, k, v, return_lse=True)
        b = R.single_prefill(q, k, v, k_scale=1.0, v_scale=1.0, return_lse=True)
        c = R.single_prefill(q, k, v, k_scale=None, v_scale=1, return_lse=True)
        assert same_bytes(a, b) and same_bytes(a, c), f"{fmt} (seed={seed})"


@pytest.mark.parametrize("fmt", list(FP8))
def test_scales_scale(fmt):
    """``k_scale`` scales the scores (as ``sm_scale`` would), ``v_scale`` the output."""
    rng, seed = fresh()
    q, k, v = contiguous(rng, 3, 8, fmt, "float32")
    base_o, base_l = R.single_prefill(q, k, v, return_lse=True, dtype=np.float64, sm_scale=0.25)
    o, lse = R.single_prefill(q, k, v, k_scale=0.5, v_scale=3.0, return_lse=True, dtype=np.float64, sm_scale=0.5)
    close(o, 3.0 * base_o.numpy(), seed, "o", atol=1e-12, rtol=1e-12)
    close(lse, base_l.numpy(), seed, "lse", atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("fmt", list(FP8))
def test_a_non_finite_fp8_key_poisons_visible_rows_only(fmt):
    """e4m3fn's NaN code (and e5m2's infinity) in K or V is a non-finite key: the NaN rule."""
    rng, seed = fresh()
    nq, nk = 5, 8
    q, k, v = contiguous(rng, nq, nk, fmt, "float16")
    j = int(rng.integers(nk - nq + 1, nk))
    bad = 0x7F if fmt == "e4m3fn" else 0x7C          # NaN / +inf
    for t in (k, v):
        t8 = t.view(torch.uint8)
        t8[j, 1, int(rng.integers(0, 16))] = bad
    o, lse = R.single_prefill(q, k, v, causal=True, return_lse=True, dtype=np.float64)
    want_o, want_l = dense(q64(q), [deq(k, None)], [deq(v, None)], [nq], causal=True)
    sees = np.arange(nq) + nk - nq >= j
    o, lse = o.numpy(), lse.numpy()
    assert np.isnan(o[sees][:, 2:]).all() and np.isnan(lse[sees][:, 2:]).all(), f"seed={seed}"
    assert np.isfinite(o[~sees]).all() and np.isfinite(o[sees][:, :2]).all(), f"seed={seed}"
    close(o[~sees], want_o[~sees], seed, "hidden", atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------------------
# Writing into an fp8 cache
# ---------------------------------------------------------------------------

def empty_cache(rng, fmt, num_pages, page_size, hkv, d, kv_layout):
    shape = (num_pages, 2, page_size, hkv, d) if kv_layout == "NHD" else (num_pages, 2, hkv, page_size, d)
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(FP8[fmt])


def slot_of(cache, kv_layout, page, slot, which):
    return cache[page, which, slot] if kv_layout == "NHD" else cache[page, which, :, slot]


@pytest.mark.parametrize("fmt", list(FP8))
def test_quantize_is_the_nearest_fp8_value(fmt):
    """Each appended element is the fp8 value nearest to the exact ``x / scale``
    (ties to even, beyond the maximum: the maximum), checked with exact fractions."""
    rng, seed = fresh()
    scale = float(rng.uniform(0.05, 3.0))
    vals = [v for v, _ in finite_table(fmt) if v >= 0]
    mids = [(a + b) / 2 for a, b in zip(sorted(set(vals))[:-1], sorted(set(vals))[1:])]
    x = np.concatenate([
        rng.standard_normal(120) * FMAX[fmt] / 50,                         # normal values
        rng.standard_normal(24) * 2.0 ** (-7 if fmt == "e4m3fn" else -14),  # around the subnormals
        rng.choice(mids, 24) * rng.choice([-1, 1], 24),                      # exact ties (scale 1 below)
        np.array([FMAX[fmt] * 1.02, FMAX[fmt] * 1.5, -FMAX[fmt] * 7, 3e38, -3e38, 0.0, -0.0, 1e-30]),
    ]).astype(np.float32)
    # x / scale a hair off a midpoint (float32(mid * scale)): one rounding, not two, decides these
    near = (rng.choice(mids, 64) * scale).astype(np.float32) * rng.choice([-1, 1], 64).astype(np.float32)
    x = np.concatenate([x, near])
    for s in (scale, 1.0):
        y = quantize(x, s, f"float8_{fmt}")
        codes = y.view(torch.uint8).numpy()
        for i, xi in enumerate(x):
            want = nearest_code(float(xi), s, fmt)
            assert codes[i] == want, f"x={float(xi)!r} / {s!r}: got {codes[i]:#x}, want {want:#x} (seed={seed})"


@pytest.mark.parametrize("fmt", list(FP8))
def test_quantize_keeps_non_finite_values_non_finite(fmt):
    x = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    y = quantize(x, 0.5, f"float8_{fmt}").to(torch.float32).numpy()
    assert np.isnan(y[0]) and y[3] == 2.0
    if fmt == "e5m2":
        assert y[1] == np.inf and y[2] == -np.inf
    else:
        assert np.isnan(y[1]) and np.isnan(y[2])          # e4m3fn has no infinity
    # torch's plain cast, for the record, differs between torch versions for e4m3fn: 2.13 saturates
    # (even infinities), c10's older conversion gives NaN for everything from 464 up; e5m2 overflows to inf.
    # quantize gives the same bytes under either (its clip comes first).
    plain = torch.tensor([np.inf, FMAX[fmt] * 1.2]).to(FP8[fmt]).to(torch.float32).tolist()
    if fmt == "e4m3fn":
        assert plain == [448.0, 448.0] or all(math.isnan(v) for v in plain), plain
    else:
        assert plain == [math.inf, math.inf], plain


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("adt", ["float32", "float16", "bfloat16", "numpy"])
def test_round_trip_append_then_attend(fmt, kv_layout, adt):
    rng, seed = fresh()
    ks, vs = scales(rng)
    page_size, hkv, group, d = 4, 2, 2, 8
    old_lens = np.array([3, 0, 4, 6])
    new = np.array([2, 3, 0, 5])                  # request 2 appends nothing
    lens = old_lens + new
    pkv = L.PagedKV.allocate(lens, page_size, num_pages=12, rng=rng)
    cache = empty_cache(rng, fmt, 12, page_size, hkv, d, kv_layout)
    before = cache.clone()
    nnz = int(new.sum())
    key = rng.standard_normal((nnz, hkv, d)) * ks * 30
    val = rng.standard_normal((nnz, hkv, d)) * vs * 5
    key[0, 0, 0] = FMAX[fmt] * ks * 3             # saturates
    if adt == "numpy":
        ak, av = key.astype(np.float32), val.astype(np.float32)
    else:
        ak, av = torch.from_numpy(key).to(QDT[adt]), torch.from_numpy(val).to(QDT[adt])
    b, pos = L.get_batch_indices_positions(indptr_of(new), lens, nnz)
    R.append_paged_kv_cache(ak, av, b, pos, cache, pkv.paged_kv_indptr, pkv.paged_kv_indices,
                            pkv.paged_kv_last_page_len, kv_layout=kv_layout, k_scale=ks, v_scale=vs)
    touched = np.zeros(cache.shape[:1] + (cache.shape[2 if kv_layout == "NHD" else 3],), bool)
    xk = q64(ak) if adt != "numpy" else ak.astype(np.float64)
    xv = q64(av) if adt != "numpy" else av.astype(np.float64)
    for i in range(nnz):
        page, slot = pkv.locate(int(b[i]), int(pos[i]))
        page, slot = int(page), int(slot)
        touched[page, slot] = True
        for which, x, s in ((0, xk, ks), (1, xv, vs)):
            got = slot_of(cache, kv_layout, page, slot, which).contiguous().view(torch.uint8).numpy().ravel()
            want = [nearest_code(float(e), s, fmt) for e in x[i].ravel()]
            assert got.tolist() == want, f"token {i}, {'KV'[which]} (seed={seed})"
    for page in range(cache.shape[0]):
        for slot in range(touched.shape[1]):
            if not touched[page, slot]:
                for which in (0, 1):
                    assert same_bytes(slot_of(cache, kv_layout, page, slot, which),
                                      slot_of(before, kv_layout, page, slot, which)), f"untouched slot (seed={seed})"
    assert float(slot_of(cache, kv_layout, *[int(t) for t in pkv.locate(int(b[0]), int(pos[0]))], 0)[0, 0]
                 .to(torch.float32)) == FMAX[fmt], f"saturated (seed={seed})"
    # attend over what was written: the brute force reads the cache with the test's dequantization
    q = query(rng, (4, hkv * group, d), "float16")
    c = deq_cache(cache, ks, vs)
    kvs = [gather(c, pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len, r, kv_layout)
           for r in range(4)]
    want_o, want_l = dense(q64(q), [a for a, _ in kvs], [b_ for _, b_ in kvs], [1] * 4)
    o, lse = R.batch_decode_paged(q, cache, pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len,
                                  kv_layout=kv_layout, k_scale=ks, v_scale=vs, return_lse=True, dtype=np.float64)
    close(o, want_o, seed, "o", atol=1e-12, rtol=1e-12)
    close(lse, want_l, seed, "lse", atol=1e-12, rtol=1e-12)
    # and the written K/V are the appended ones up to fp8 rounding (relative 2^-(m+1), or the subnormal step)
    e_bits, m_bits, bias = FMT[fmt]
    for i in range(1, nnz):
        page, slot = (int(t) for t in pkv.locate(int(b[i]), int(pos[i])))
        got = c[page, 1, slot] if kv_layout == "NHD" else c[page, 1, :, slot]
        bound = np.abs(xv[i]) * 2.0 ** -(m_bits + 1) + vs * 2.0 ** (1 - bias - m_bits)
        assert (np.abs(got - xv[i]) <= bound * (1 + 1e-9)).all(), f"token {i} (seed={seed})"


def test_append_of_already_quantized_kv_is_a_copy():
    rng, seed = fresh()
    for fmt in FP8:
        pkv = L.PagedKV.allocate([3, 2], 2, num_pages=4, rng=rng)
        cache = empty_cache(rng, fmt, 4, 2, 1, 4, "NHD")
        k8 = torch.from_numpy(rng.standard_normal((5, 1, 4)).astype(np.float32)).to(FP8[fmt])
        v8 = torch.from_numpy(rng.standard_normal((5, 1, 4)).astype(np.float32)).to(FP8[fmt])
        b, pos = L.get_batch_indices_positions([0, 3, 5], [3, 2], 5)
        R.append_paged_kv_cache(k8, v8, b, pos, cache, pkv.paged_kv_indptr, pkv.paged_kv_indices,
                                pkv.paged_kv_last_page_len)
        for i in range(5):
            page, slot = (int(t) for t in pkv.locate(int(b[i]), int(pos[i])))
            assert same_bytes(cache[page, 0, slot], k8[i]) and same_bytes(cache[page, 1, slot], v8[i]), \
                f"{fmt} (seed={seed})"


# ---------------------------------------------------------------------------
# Absent arguments are the old behaviour
# ---------------------------------------------------------------------------

VARIANTS = [{}, dict(causal=True), dict(window_left=2, sink_size=1), dict(logits_soft_cap=3.0),
            dict(pos_encoding_mode="ALIBI"), dict(use_sigmoid=True, sigmoid_bias=0.5)]


@pytest.mark.parametrize("kw", VARIANTS, ids=range(len(VARIANTS)))
def test_none_is_the_same_bytes_as_not_passing_it(kw):
    rng, seed = fresh()
    qo_lens, kv_lens = [3, 0, 2], [5, 1, 6]
    q = rng.standard_normal((5, 4, 16)).astype(np.float32)
    k = rng.standard_normal((12, 2, 16)).astype(np.float32)
    v = rng.standard_normal((12, 2, 16)).astype(np.float32)
    lse = {} if kw.get("use_sigmoid") else dict(return_lse=True)
    none = dict(k_scale=None, v_scale=None)
    both = dict(lse, **kw)
    assert same_bytes(R.single_prefill(q[:3], k[:5], v[:5], **both),
                      R.single_prefill(q[:3], k[:5], v[:5], **both, **none)), f"single_prefill {kw} (seed={seed})"
    assert same_bytes(R.single_decode(q[0], k[:5], v[:5], **both),
                      R.single_decode(q[0], k[:5], v[:5], **both, **none)), f"single_decode {kw} (seed={seed})"
    assert same_bytes(R.batch_prefill_ragged(q, k, v, indptr_of(qo_lens), indptr_of(kv_lens), **both),
                      R.batch_prefill_ragged(q, k, v, indptr_of(qo_lens), indptr_of(kv_lens), **both, **none)), \
        f"ragged {kw} (seed={seed})"
    pkv = L.PagedKV.allocate(kv_lens, 4, num_pages=6, rng=rng)
    cache = rng.standard_normal((6, 2, 4, 2, 16)).astype(np.float32)
    args = (cache, indptr_of(qo_lens), pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len)
    assert same_bytes(R.batch_prefill_paged(q, *args, **both), R.batch_prefill_paged(q, *args, **both, **none)), \
        f"paged {kw} (seed={seed})"
    dargs = (cache, pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len)
    assert same_bytes(R.batch_decode_paged(q[:3], *dargs, **both),
                      R.batch_decode_paged(q[:3], *dargs, **both, **none)), f"decode {kw} (seed={seed})"


def test_append_into_a_numpy_cache_without_scales_is_unchanged():
    rng, seed = fresh()
    pkv = L.PagedKV.allocate([3, 2], 2, num_pages=4, rng=rng)
    k = rng.standard_normal((5, 1, 4)).astype(np.float32)
    v = rng.standard_normal((5, 1, 4)).astype(np.float32)
    b, pos = L.get_batch_indices_positions([0, 3, 5], [3, 2], 5)
    c1 = rng.standard_normal((4, 2, 2, 1, 4)).astype(np.float32)
    c2 = c1.copy()
    R.append_paged_kv_cache(k, v, b, pos, c1, pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len)
    R.append_paged_kv_cache(k, v, b, pos, c2, pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len,
                            k_scale=None, v_scale=None)
    assert c1.tobytes() == c2.tobytes(), f"seed={seed}"


# ---------------------------------------------------------------------------
# Validation: one case per rule; the message names the argument; nothing changes
# ---------------------------------------------------------------------------

class MlDtypesLike:
    """Stands in for a NumPy array of an ml_dtypes fp8 dtype (not installed here):
    what the checks see of one is a dtype named ``float8_e4m3fn``."""
    dtype = "float8_e4m3fn"

    def __init__(self, shape):
        self.shape = shape


def _case():
    rng = np.random.default_rng()
    q = torch.from_numpy(rng.standard_normal((2, 4, 8)).astype(np.float32)).half()
    kf = torch.from_numpy(rng.standard_normal((5, 2, 8)).astype(np.float32))
    vf = torch.from_numpy(rng.standard_normal((5, 2, 8)).astype(np.float32))
    cf = torch.from_numpy(rng.standard_normal((3, 2, 2, 2, 8)).astype(np.float32))
    return dict(q=q, k=kf.to(torch.float8_e4m3fn), v=vf.to(torch.float8_e4m3fn), k5=kf.to(torch.float8_e5m2),
                v5=vf.to(torch.float8_e5m2), kh=kf.half(), vh=vf.half(), cache=cf.to(torch.float8_e5m2),
                cache16=cf.half(), np_cache=cf.numpy().copy(), ak=kf[:2].clone(), av=vf[:2].clone(),
                ak8=kf[:2].to(torch.float8_e5m2), av8=vf[:2].to(torch.float8_e5m2),
                fnuz=kf.to(torch.float8_e4m3fnuz), out=torch.zeros(2, 4, 8))


PT = (np.array([0, 1, 3], np.int32), np.array([0, 2, 1], np.int32), np.array([2, 1], np.int32))


def _single(d, k="k", v="v", q="q", **kw):
    return R.single_prefill(d[q], d[k], d[v], **kw)


def _ragged(d, k="k", v="v", **kw):
    return R.batch_prefill_ragged(d["q"], d[k], d[v], [0, 1, 2], [0, 2, 5], out=d["out"], **kw)


def _paged(d, cache="cache", **kw):
    return R.batch_prefill_paged(d["q"], d[cache], [0, 1, 2], *PT, out=d["out"], **kw)


def _decode(d, cache="cache", **kw):
    return R.batch_decode_paged(d["q"], d[cache], *PT, **kw)


def _append(d, cache="cache", ak="ak", av="av", **kw):
    return R.append_paged_kv_cache(d[ak], d[av], [0, 1], [0, 0], d[cache], *PT, **kw)


# (id, argument the message starts with, a phrase of the rule, call)
RULES = [
    ("kv_fp8_kinds_differ", "v", "K and V must share one fp8 dtype", lambda d: _single(d, v="v5")),
    ("kv_fp8_kinds_differ_ragged", "v", "K and V must share one fp8 dtype", lambda d: _ragged(d, k="k5")),
    ("k_fp8_v_fp16", "v", "K and V must share one fp8 dtype", lambda d: _single(d, v="vh")),
    ("k_fp16_v_fp8", "v", "K and V must share one fp8 dtype", lambda d: _ragged(d, k="kh")),
    ("q_fp8", "q", "fp8 queries are not supported", lambda d: _single(d, q="k")),
    ("q_fp8_decode", "q", "fp8 queries are not supported",
     lambda d: R.single_decode(d["k"][0], d["k"], d["v"])),
    ("q_fp8_paged", "q", "fp8 queries are not supported",
     lambda d: R.batch_decode_paged(d["cache"][:2, 0, 0], d["cache"], *PT)),
    ("fp8_kind_fnuz", "k", "not supported", lambda d: _single(d, k="fnuz", v="fnuz")),
    ("numpy_fp8", "k", "NumPy has no fp8 dtype",
     lambda d: R.single_prefill(d["q"], MlDtypesLike((5, 2, 8)), MlDtypesLike((5, 2, 8)))),
    ("numpy_fp8_cache", "paged_kv_cache", "NumPy has no fp8 dtype",
     lambda d: R.batch_decode_paged(d["q"], MlDtypesLike((3, 2, 2, 2, 8)), *PT)),
    ("k_scale_not_fp8", "k_scale", "only fp8 K/V", lambda d: _single(d, k="kh", v="vh", q="q", k_scale=0.5)),
    ("v_scale_not_fp8_ragged", "v_scale", "only fp8 K/V", lambda d: _ragged(d, k="kh", v="vh", v_scale=1.0)),
    ("k_scale_not_fp8_paged", "k_scale", "paged_kv_cache has dtype float16",
     lambda d: _paged(d, cache="cache16", k_scale=2.0)),
    ("v_scale_not_fp8_decode", "v_scale", "only fp8 K/V", lambda d: _decode(d, cache="cache16", v_scale=2.0)),
    ("k_scale_zero", "k_scale", "finite and > 0", lambda d: _single(d, k_scale=0.0)),
    ("k_scale_negative", "k_scale", "finite and > 0", lambda d: _paged(d, k_scale=-1.0)),
    ("k_scale_nan", "k_scale", "finite and > 0", lambda d: _decode(d, k_scale=float("nan"))),
    ("v_scale_inf", "v_scale", "finite and > 0", lambda d: _ragged(d, v_scale=float("inf"))),
    ("v_scale_zero_decode", "v_scale", "finite and > 0", lambda d: R.single_decode(d["q"][0], d["k"], d["v"],
                                                                                   v_scale=0)),
    ("k_scale_string", "k_scale", "must be a float", lambda d: _single(d, k_scale="0.5")),
    ("k_scale_bool", "k_scale", "must be a float", lambda d: _single(d, k_scale=True)),
    ("v_scale_vector", "v_scale", "must be a float", lambda d: _paged(d, v_scale=np.ones(2))),
    ("block_sparse_fp8", "k", "block_sparse does not read fp8", lambda d: R.block_sparse(
        d["q"], d["k"], d["v"], L.BSR.from_block_mask(np.ones((1, 3), bool), (2, 2), (2, 5)))),
    ("cascade_fp8", "paged_kv_cache", "cascade does not read fp8",
     lambda d: R.cascade(d["q"], [L.CascadeLevel(np.array([0, 1, 2], np.int32), *PT)], d["cache"])),
    ("split_kv_fp8", "k", "split_kv does not read fp8",
     lambda d: R.split_kv(d["q"], d["k"], d["v"], np.array([0, 5], np.int32))),
    ("append_scale_numpy_cache", "k_scale", "only fp8 K/V",
     lambda d: _append(d, cache="np_cache", ak="ak", av="av", k_scale=1.0)),
    ("append_scale_nan", "v_scale", "finite and > 0", lambda d: _append(d, v_scale=float("nan"))),
    ("append_scale_negative", "k_scale", "finite and > 0", lambda d: _append(d, k_scale=-2.0)),
    ("append_kv_dtypes_differ", "append_value", "append_key's dtype", lambda d: _append(d, av="ak8")),
    ("append_fp8_with_scale", "k_scale", "already float8_e5m2", lambda d: _append(d, ak="ak8", av="av8",
                                                                                   k_scale=0.5)),
    ("append_fp8_other_kind", "append_key", "the cache's dtype (float8_e5m2)",
     lambda d: _append(d, ak="k", av="v")),
    ("append_numpy_fp8_cache", "paged_kv_cache", "NumPy has no fp8 dtype",
     lambda d: R.append_paged_kv_cache(d["ak"], d["av"], [0, 1], [0, 0], MlDtypesLike((3, 2, 2, 2, 8)), *PT)),
    ("append_int_into_fp8", "append_key", "floating-point", lambda d: _append(
        dict(d, ak=torch.ones(2, 2, 8, dtype=torch.int32), av=torch.ones(2, 2, 8, dtype=torch.int32)))),
    ("append_shape_fp8", "append_key", "must be [nnz, 2, 8]", lambda d: _append(
        dict(d, ak=d["ak"][:, :1], av=d["av"][:, :1]))),
]


@pytest.mark.parametrize("name,arg,rule,call", RULES, ids=[r[0] for r in RULES])
def test_rule(name, arg, rule, call):
    assert_refused(call, _case(), arg, rule, name)


def test_kernel_forms_refuse_fp8_where_they_do_not_read_it():
    """The decode and prefill kernels read fp8 (tests/test_cuda_fp8.py, tests/test_cuda_fp8_prefill.py);
    block-sparse refuses it, naming the argument, and a scale on a 16-bit K is refused as the golden model does."""
    from nbattn import cuda as C
    d = _case()
    with pytest.raises(ValueError, match=r"^k: nbattn.cuda.block_sparse does not read fp8 K/V \(float8_e4m3fn\)"):
        C.block_sparse(d["q"], d["k"], d["v"], L.BSR.from_block_mask(np.ones((1, 3), bool), (2, 2), (2, 5)))
    with pytest.raises(ValueError, match=r"^k_scale: only fp8 K/V"):
        C.single_prefill(d["q"], d["kh"], d["vh"], k_scale=1.0)
    with pytest.raises(TypeError, match="'v_scale'"):
        R.block_sparse(d["q"], d["kh"], d["vh"], L.BSR.from_block_mask(np.ones((1, 3), bool), (2, 2), (2, 5)),
                       v_scale=1.0)
