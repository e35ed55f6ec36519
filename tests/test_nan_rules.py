"""The NaN rule, entry point by entry point, golden model and kernels (simulator).

The rule (docs/bad_input.md): a key is visible to a row when every mask keeps
it.  A visible key with a non-finite raw score (q . k * scale: a non-finite q
or K) or a non-finite V makes that (row, head) NaN, o and LSE.  Invisible
keys never affect a row.  A row that sees no key is o = 0, LSE = -inf.  A
merge of a NaN state is NaN.

Expected values come from :func:`oracle`, a float64 key-by-key computation
written for this file, not from :mod:`nbattn.reference`.  Every test draws
fresh random inputs (a new seed each run is printed on failure).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from numba import cuda  # noqa: E402
from nbattn import cuda as C
from nbattn import layout as L
from nbattn import reference as R
from nbattn.cuda.tuning import DECODE

from brute import gather_pages, random_paged_batch

SEED = np.random.SeedSequence().entropy


def rng_for(request):
    """A fresh generator per test; the seed is in the test's id on failure."""
    return np.random.default_rng([SEED, abs(hash(request.node.nodeid)) % (2 ** 32)])


def f32(x):
    x = np.asarray(x)
    if x.dtype.kind == "V":
        return (x.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def oracle(q, k, v, *, q_pos=None, kv_pos=None, causal=False, window_left=-1, sink_size=0,
           sm_scale=None, logits_soft_cap=None, mask_mod=None, extra_mask=None, b=0):
    """float64, one (row, head, key) at a time.  q [Q,Hq,D], k/v [K,Hkv,D]."""
    q, k, v = (np.asarray(f32(x), np.float64) for x in (q, k, v))
    nq, hq, d = q.shape
    nk, hkv = k.shape[:2]
    g = hq // hkv
    q_pos = np.arange(nk - nq, nk) if q_pos is None else q_pos
    kv_pos = np.arange(nk) if kv_pos is None else kv_pos
    scale = 1 / math.sqrt(d) if sm_scale is None else sm_scale
    o = np.zeros((nq, hq, d))
    lse = np.full((nq, hq), -np.inf)
    for i in range(nq):
        qi = int(q_pos[i])
        for h in range(hq):
            vis, scores, vals, bad = [], [], [], False
            for j in range(nk):
                kj = int(kv_pos[j])
                seen = True
                if causal and kj > qi:
                    seen = False
                if window_left >= 0 and qi - kj > window_left and not kj < sink_size:
                    seen = False
                if mask_mod is not None and not mask_mod(b, h, qi, kj):
                    seen = False
                if extra_mask is not None and not extra_mask[i, j]:
                    seen = False
                if not seen:
                    continue
                with np.errstate(all="ignore"):
                    raw = float(np.dot(q[i, h], k[j, h // g])) * scale
                if not math.isfinite(raw) or not np.isfinite(v[j, h // g]).all():
                    bad = True
                    break
                s = logits_soft_cap * math.tanh(raw / logits_soft_cap) if logits_soft_cap else raw
                scores.append(s)
                vals.append(v[j, h // g])
            if bad:
                o[i, h] = np.nan
                lse[i, h] = np.nan
            elif scores:
                s = np.array(scores)
                m = s.max()
                w = np.exp(s - m)
                o[i, h] = (w @ np.array(vals)) / w.sum()
                lse[i, h] = (m + math.log(w.sum())) / math.log(2)
    return o, lse


TOL = {"f32": 2e-4, "f16": 4e-3, "bf16": 3e-2}


def check(got, want, code="f32", what=""):
    o, lse = got
    wo, wl = want
    o, lse = f32(o).astype(np.float64), f32(lse).astype(np.float64)
    assert o.shape == wo.shape, what
    nan_rows = np.isnan(wl)
    # a NaN (row, head) is NaN throughout, o and LSE; nowhere else is anything NaN
    assert np.array_equal(np.isnan(lse), nan_rows), f"{what}: NaN LSE rows differ"
    assert np.isnan(o[nan_rows]).all(), f"{what}: a NaN row has non-NaN outputs"
    assert not np.isnan(o[~nan_rows]).any(), f"{what}: NaN leaked into a row that cannot see it"
    assert np.array_equal(np.isneginf(lse), np.isneginf(wl)), f"{what}: empty rows differ"
    assert (o[np.isneginf(wl)] == 0).all(), f"{what}: an empty row is not 0"
    ok = ~nan_rows
    np.testing.assert_allclose(o[ok], wo[ok], atol=TOL[code], rtol=TOL[code], err_msg=what)
    fin = np.isfinite(wl)
    np.testing.assert_allclose(lse[fin], wl[fin], atol=1e-3, rtol=1e-3, err_msg=what)


def poison_value(rng):
    return [np.nan, np.inf, -np.inf][rng.integers(3)]


# ---------------------------------------------------------------------------
# Paged batches: decode and prefill, golden and kernel
# ---------------------------------------------------------------------------

def paged_case(rng, *, decode, page_size=3, group=None, empty=True, head_dim=8):
    group = group or int(rng.choice([1, 2, 4]))
    hkv = 2 if group < 4 else 1
    kv_lens = [int(x) for x in rng.integers(2, 12, size=3)] + [0 if empty else 1]   # one empty request
    qo_lens = [1] * 4 if decode else [min(int(rng.integers(1, 4)), max(l, 1)) for l in kv_lens]
    qo_lens[-1] = 1 if decode or not empty else 0
    b = random_paged_batch(rng, qo_lens=qo_lens, kv_lens=kv_lens, page_size=page_size, num_kv_heads=hkv,
                           group=group, head_dim=head_dim, share_first_page=True)
    return b, kv_lens, qo_lens


def paged_oracle(b, kv_lens, qo_lens, **variant):
    q = b["q"]
    o = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    qo = np.concatenate([[0], np.cumsum(qo_lens)])
    for r in range(len(kv_lens)):
        k, v = gather_pages(b["cache"], b["indptr"], b["indices"], b["last"], r)
        rows = slice(qo[r], qo[r + 1])
        if rows.stop > rows.start:
            o[rows], lse[rows] = oracle(q[rows], k, v, b=r, **variant)
    return o, lse


def put_kv_value(b, r, t, which, value, rng):
    """Poison one element of key t of request r (K: which=0, V: which=1)."""
    ps = b["cache"].shape[2]
    page = b["indices"][b["indptr"][r] + t // ps]
    b["cache"][page, which, t % ps, rng.integers(b["cache"].shape[3]), rng.integers(b["cache"].shape[4])] = value


DECODE_FNS = {"reference": R.batch_decode_paged, "cuda": C.batch_decode_paged,
              "cuda-warp": functools.partial(C.batch_decode_paged, tuning=DECODE.replace(path="warp"))}
PREFILL_FNS = {"reference": R.batch_prefill_paged, "cuda": C.batch_prefill_paged}


def run_paged(side, decode, b, **variant):
    if decode:
        return DECODE_FNS[side](b["q"], b["cache"], b["indptr"], b["indices"], b["last"],
                                return_lse=True, **variant)
    return PREFILL_FNS[side](b["q"], b["cache"], b["qo_indptr"], b["indptr"], b["indices"], b["last"],
                             return_lse=True, **variant)


# reference; cuda with head_dim 8 (decode smem path, prefill scalar tile); cuda with
# head_dim 16 (prefill register-tiled tile); cuda decode forced onto the warp path.
SIDES = ["reference", "cuda", "cuda-d16", "cuda-warp"]


@pytest.fixture
def side_setup():
    def setup(side, decode):
        if side == "cuda-warp":
            if not decode:
                pytest.skip("the warp path is a decode path")
            return side, 8
        return ("reference" if side == "reference" else "cuda"), (16 if side == "cuda-d16" else 8)
    return setup


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_nonfinite_q_poisons_only_its_row_and_head(request, side_setup, side, decode):
    side, d = side_setup(side, decode)
    rng = rng_for(request)
    b, kv_lens, qo_lens = paged_case(rng, decode=decode, head_dim=d)
    b["q"][0, int(rng.integers(b["q"].shape[1])), int(rng.integers(8))] = poison_value(rng)
    check(run_paged(side, decode, b), paged_oracle(b, kv_lens, qo_lens), what=f"{side} q")


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("which", [0, 1], ids=["K", "V"])
def test_hidden_key_never_reaches_a_row_visible_key_poisons(request, side_setup, side, decode, which):
    """Causal + window: a poisoned key inside some rows' view and outside others'."""
    side, d = side_setup(side, decode)
    rng = rng_for(request)
    b, kv_lens, qo_lens = paged_case(rng, decode=decode, empty=False, head_dim=d)
    variant = dict(causal=True, window_left=int(rng.integers(1, 3)))
    for r in range(3):
        put_kv_value(b, r, int(rng.integers(kv_lens[r])), which, poison_value(rng), rng)
    # and the last key of request 0, which only its last row sees
    put_kv_value(b, 0, kv_lens[0] - 1, which, np.nan, rng)
    want = paged_oracle(b, kv_lens, qo_lens, **variant)
    check(run_paged(side, decode, b, **variant), want, what=f"{side} {'KV'[which]}")


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_row_that_sees_no_key_is_empty_whatever_its_keys_hold(request, side_setup, side, decode):
    side, d = side_setup(side, decode)
    rng = rng_for(request)
    b, kv_lens, qo_lens = paged_case(rng, decode=decode, head_dim=d)
    b["cache"][...] = np.nan            # every key poisoned, K and V
    mm = lambda b_, h, q_idx, kv_idx: q_idx < 0      # noqa: E731  (hides every key)
    want = paged_oracle(b, kv_lens, qo_lens, mask_mod=mm)
    assert np.isneginf(want[1]).all()
    check(run_paged(side, decode, b, mask_mod=mm), want, what=f"{side} all hidden")


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_soft_cap_cannot_hide_an_infinite_score(request, side_setup, side, decode):
    side, d = side_setup(side, decode)
    rng = rng_for(request)
    b, kv_lens, qo_lens = paged_case(rng, decode=decode, head_dim=d)
    b["q"][0, 0, 0] = np.inf
    want = paged_oracle(b, kv_lens, qo_lens, logits_soft_cap=5.0)
    assert np.isnan(want[1][0, 0])
    check(run_paged(side, decode, b, logits_soft_cap=5.0), want, what=f"{side} soft cap")


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_visible_key_of_weight_zero_still_poisons(request, side_setup, side, decode, value):
    """A visible key that scores 1000 below the rest (its weight 2^-1443 is 0 in
    float32) with a non-finite V, and a visible key whose K makes the raw score
    -inf (weight 0 too): both rows are NaN, not the softmax of the other keys."""
    side, d = side_setup(side, decode)
    rng = rng_for(request)
    b, kv_lens, qo_lens = paged_case(rng, decode=decode, empty=False, head_dim=d)
    qo = np.concatenate([[0], np.cumsum(qo_lens)])
    ps = b["cache"].shape[2]
    hkv = b["cache"].shape[3]
    for r, which in ((0, 1), (1, 0)):          # request 0: V of key 0; request 1: K of key 0
        rows = slice(qo[r], qo[r + 1])
        b["q"][rows] = np.abs(b["q"][rows]) + 0.5        # every q element positive
        page = b["indices"][b["indptr"][r]]
        b["cache"][page, 0, 0] = -4000.0 / np.sqrt(d)   # raw score <= -4000 / sqrt(d) * 0.5 * d / sqrt(d)
        if which == 1:
            b["cache"][page, 1, 0, int(rng.integers(hkv)), int(rng.integers(d))] = value
        else:
            b["cache"][page, 0, 0, int(rng.integers(hkv)), int(rng.integers(d))] = -np.inf
    want = paged_oracle(b, kv_lens, qo_lens)
    assert np.isnan(want[1][qo[0]:qo[1]]).any() and np.isnan(want[1][qo[1]:qo[2]]).any()
    check(run_paged(side, decode, b), want, what=f"{side} weight-0 key")


# ---------------------------------------------------------------------------
# Contiguous forms, block sparse, cascade
# ---------------------------------------------------------------------------

def contiguous_case(rng, nq, nk, d=8):
    group = int(rng.choice([1, 2, 4]))
    hkv = 2 if group < 4 else 1
    q = rng.standard_normal((nq, hkv * group, d)).astype(np.float32)
    k = rng.standard_normal((nk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((nk, hkv, d)).astype(np.float32)
    return q, k, v


def poison_contiguous(rng, q, k, v):
    """One q element of row 0, and K or V of keys everywhere, including the last
    key (seen by the last row only) and a key outside a small window."""
    q[0, int(rng.integers(q.shape[1])), int(rng.integers(q.shape[2]))] = poison_value(rng)
    for t in {0, int(rng.integers(k.shape[0])), k.shape[0] - 1}:
        arr = k if rng.integers(2) else v
        arr[t, int(rng.integers(k.shape[1])), int(rng.integers(k.shape[2]))] = poison_value(rng)


CONTIG = {
    "single_prefill": lambda M, q, k, v, **kw: M.single_prefill(q, k, v, return_lse=True, **kw),
    "ragged": lambda M, q, k, v, **kw: M.batch_prefill_ragged(
        q, k, v, np.array([0, 1, q.shape[0]], np.int32), np.array([0, 3, k.shape[0]], np.int32),
        return_lse=True, **kw),
}


def ragged_oracle(q, k, v, **kw):
    o1, l1 = oracle(q[:1], k[:3], v[:3], b=0, **kw)
    o2, l2 = oracle(q[1:], k[3:], v[3:], b=1, **kw)
    return np.concatenate([o1, o2]), np.concatenate([l1, l2])


@pytest.mark.parametrize("module", ["reference", "cuda"])
@pytest.mark.parametrize("form", list(CONTIG))
@pytest.mark.parametrize("kw", [dict(), dict(causal=True, window_left=2), dict(logits_soft_cap=3.0)],
                         ids=["plain", "causal-window", "softcap"])
def test_contiguous_forms(request, module, form, kw):
    rng = rng_for(request)
    q, k, v = contiguous_case(rng, 5, 9)
    poison_contiguous(rng, q, k, v)
    want = oracle(q, k, v, **kw) if form == "single_prefill" else ragged_oracle(q, k, v, **kw)
    M = R if module == "reference" else C
    check(CONTIG[form](M, q, k, v, **kw), want, what=f"{module} {form}")


@pytest.mark.parametrize("module", ["reference", "cuda"])
def test_single_decode(request, module):
    rng = rng_for(request)
    q, k, v = contiguous_case(rng, 1, 7)
    poison_contiguous(rng, q, k, v)
    v[2, :, 0] = np.nan               # a hidden key (window) whose V is NaN
    kw = dict(window_left=3)
    M = R if module == "reference" else C
    o, lse = M.single_decode(q[0], k, v, return_lse=True, **kw)
    wo, wl = oracle(q, k, v, **kw)
    check((np.asarray(o)[None], np.asarray(lse)[None]), (wo, wl), what=module)


@pytest.mark.parametrize("module", ["reference", "cuda"])
@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse(request, module, causal):
    rng = rng_for(request)
    m, n, (br, bc) = 6, 8, (2, 2)
    q, k, v = contiguous_case(rng, m, n)
    mask = rng.random((m // br, n // bc)) < 0.5
    mask[0] = False                   # block row 0 sees nothing: its rows are empty
    bsr = L.BSR.from_block_mask(mask, (br, bc), (m, n))
    k[...] = np.where(rng.random(k.shape) < 0.05, np.nan, k)
    v[...] = np.where(rng.random(v.shape) < 0.05, np.inf, v)
    k[0:2] = np.nan                   # keys of block column 0, seen by some rows at most
    extra = np.repeat(np.repeat(mask, br, 0), bc, 1)
    M = R if module == "reference" else C
    want = oracle(q, k, v, causal=causal, extra_mask=extra)
    check(M.block_sparse(q, k, v, bsr, causal=causal, return_lse=True), want, what=module)


@pytest.mark.parametrize("module", ["reference", "cuda"])
def test_cascade(request, module):
    rng = rng_for(request)
    b, kv_lens, qo_lens = paged_case(rng, decode=False, empty=False, page_size=2)
    pkv = L.PagedKV.validate(b["indptr"], b["indices"], b["last"], 2, b["cache"].shape[0])
    levels = L.cascade_decompose(b["qo_indptr"], pkv)
    put_kv_value(b, 0, 0, 1, np.nan, rng)            # V of request 0's first key (maybe shared)
    put_kv_value(b, 1, kv_lens[1] - 1, 0, np.inf, rng)
    b["q"][-1, 0, 0] = np.nan
    kw = dict(causal=True, window_left=3)
    M = R if module == "reference" else C
    got = M.cascade(b["q"], levels, b["cache"], return_lse=True, **kw)
    check(got, paged_oracle(b, kv_lens, qo_lens, **kw), what=module)


# ---------------------------------------------------------------------------
# Wrappers (split KV, merged partials) and merges
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_wrappers(request, decode):
    rng = rng_for(request)
    b, kv_lens, qo_lens = paged_case(rng, decode=decode, empty=False, page_size=2)
    hq, hkv, d = b["q"].shape[1], b["cache"].shape[3], b["q"].shape[2]
    for r in range(3):
        put_kv_value(b, r, int(rng.integers(kv_lens[r])), int(rng.integers(2)), poison_value(rng), rng)
    b["q"][0, 0, 0] = np.nan
    kw = dict(window_left=4)
    ws = cuda.device_array(1 << 20, np.uint8)          # a device workspace, as on a GPU
    if decode:
        w = C.BatchDecodeWithPagedKVCacheWrapper(ws, num_ctas=4)
        w.plan(b["indptr"], b["indices"], b["last"], hq, hkv, d, 2, q_data_type="float32",
               chunk_overhead=0.0, chunk_limit=None, **kw)
    else:
        w = C.BatchPrefillWithPagedKVCacheWrapper(ws, num_ctas=4)
        w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], hq, hkv, d, 2, causal=True,
               q_data_type="float32", **kw)
        kw["causal"] = True
    got = w.run(b["q"], b["cache"], return_lse=True)
    check(got, paged_oracle(b, kv_lens, qo_lens, **kw), what="wrapper")


def merge_oracle(v, s):
    """float64 merge of [rows, n, H, D] states, state by state in exact arithmetic terms."""
    v, s = np.asarray(v, np.float64), np.asarray(s, np.float64)
    rows, n, h, d = v.shape
    o = np.zeros((rows, h, d))
    lse = np.full((rows, h), -np.inf)
    for r in range(rows):
        for j in range(h):
            ls = s[r, :, j]
            if np.isnan(ls).any():
                o[r, j], lse[r, j] = np.nan, np.nan
                continue
            if np.isneginf(ls).all():
                continue
            m = ls.max()
            w = np.exp2(ls - m)
            o[r, j] = (w[:, None] * v[r, :, j]).sum(0) / w.sum()
            lse[r, j] = m + math.log2(w.sum())
    return o, lse


@pytest.mark.parametrize("module", ["reference", "cuda"])
@pytest.mark.parametrize("fn", ["merge_state", "merge_states", "merge_state_in_place"])
def test_merge_of_a_nan_state_is_nan(request, module, fn):
    rng = rng_for(request)
    rows, h, d = 5, 2, 8
    v = rng.standard_normal((rows, 2, h, d)).astype(np.float32)
    s = (rng.standard_normal((rows, 2, h)) * 4).astype(np.float32)
    s[0, 0, 0] = np.nan
    s[1, 1, 1] = np.nan
    s[2, :, 0] = -np.inf             # both empty
    v[2, :, 0] = 0
    s[3, 0, 1] = np.nan
    s[3, 1, 1] = -np.inf
    want = merge_oracle(v, s)
    M = R if module == "reference" else C
    if fn == "merge_states":
        got = M.merge_states(v, s)
    elif fn == "merge_state":
        got = M.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    else:
        va, sa = v[:, 0].copy(), s[:, 0].copy()
        M.merge_state_in_place(va, sa, v[:, 1].copy(), s[:, 1].copy())
        got = (va, sa)
    check(got, want, what=f"{module} {fn}")


@pytest.mark.parametrize("module", ["reference", "cuda"])
@pytest.mark.parametrize("cap", [float("inf"), float("nan"), -1.0])
def test_logits_soft_cap_must_be_finite_and_positive(module, cap):
    q, k, v = contiguous_case(np.random.default_rng(), 2, 3)
    M = R if module == "reference" else C
    with pytest.raises(ValueError, match="logits_soft_cap"):
        M.single_prefill(q, k, v, logits_soft_cap=cap)
