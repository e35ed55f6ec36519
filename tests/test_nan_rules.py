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

import math

import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn import cuda as C
from nbattn import layout as L
from nbattn import reference as R

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


DECODE_FNS = {"reference": R.batch_decode_paged, "cuda": C.batch_decode_paged}
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
def side_setup(monkeypatch):
    def setup(side, decode):
        if side == "cuda-warp":
            if not decode:
                pytest.skip("the warp path is a decode path")
            from nbattn.cuda import decode as DEC
            monkeypatch.setattr(DEC, "DECODE_PATH", "warp")
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
