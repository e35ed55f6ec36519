"""The golden model against an independent float64 brute force, torch SDPA,
and the worked examples of docs/concepts/ (state.md, layouts.md)."""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nbattn  # noqa: F401  (compat first)
from nbattn import layout as L
from nbattn import reference as R
from nbattn.variants import Variant, alibi_slopes

from brute import brute_attention, gather_pages, random_paged_batch, shared_prefix_batch

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = dict(rtol=2e-4, atol=2e-4)


def close_states(o, lse, o_ref, lse_ref, tol=TOL):
    np.testing.assert_allclose(o, o_ref, **tol)
    both_inf = np.isneginf(lse) & np.isneginf(lse_ref)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    np.testing.assert_allclose(np.where(both_inf, 0, lse), np.where(both_inf, 0, lse_ref), **tol)


# ---------------------------------------------------------------------------
# Worked examples, exact
# ---------------------------------------------------------------------------

def test_spec3_merge_example():
    o, lse = R.merge_state(np.array([[1.0, 0.0]]), np.array([2.0]), np.array([[0.0, 1.0]]), np.array([1.0]))
    np.testing.assert_allclose(o, [[2 / 3, 1 / 3]], rtol=1e-12)
    np.testing.assert_allclose(lse, [2 + math.log2(1.5)], rtol=1e-12)
    assert abs(lse[0] - 2.585) < 1e-3


def test_spec3_split_example_and_why_averaging_is_wrong():
    q = np.ones((1, 1, 1))
    k = np.array([1.0, 2, 3, 4]).reshape(4, 1, 1)
    v = np.array([10.0, 20, 30, 40]).reshape(4, 1, 1)
    o, lse, (po, pl) = R.split_kv(q, k, v, np.array([0, 2, 4], np.int32), sm_scale=1.0, return_lse=True,
                                  return_partials=True, dtype=np.float64)
    np.testing.assert_allclose(po.ravel(), [17.3106, 37.3106], atol=1e-4)
    np.testing.assert_allclose(o.ravel(), [34.9265], atol=1e-4)
    assert abs(po.mean() - 27.31) < 0.01 and abs(o.ravel()[0] - po.mean()) > 7
    full = R.single_prefill(q, k, v, sm_scale=1.0, dtype=np.float64)
    np.testing.assert_allclose(o, full, rtol=1e-12)
    np.testing.assert_allclose(lse.ravel(), [math.log2(sum(math.exp(s) for s in (1, 2, 3, 4)))], rtol=1e-12)


def test_spec4_worked_layout():
    pkv = L.PagedKV.validate(np.array([0, 2, 3, 6], np.int32), np.array([7, 2, 11, 3, 14, 6], np.int32),
                             np.array([2, 2, 1], np.int32), 4, 15)
    assert pkv.kv_lens.tolist() == [6, 2, 9]
    assert tuple(int(x) for x in pkv.locate(2, 5)) == (14, 1)
    assert tuple(int(x) for x in pkv.locate(2, 8)) == (6, 0)
    qo = L.RaggedQ.validate(np.array([0, 3, 4, 8], np.int32))
    assert qo.lengths.tolist() == [3, 1, 4]
    # R2's four query rows see 6, 7, 8, 9 keys under the bottom-right causal mask
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((15, 2, 4, 1, 4)).astype(np.float32)
    q = rng.standard_normal((8, 1, 4)).astype(np.float32)
    seen = []
    for i, K in zip(range(4), [9] * 4):
        seen.append(int(np.sum(np.arange(K) <= K - 4 + i)))
    assert seen == [6, 7, 8, 9]
    o = R.batch_prefill_paged(q, cache, qo.qo_indptr, pkv.paged_kv_indptr, pkv.paged_kv_indices,
                              pkv.paged_kv_last_page_len, causal=True, dtype=np.float64)
    k, v = gather_pages(cache, pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len, 2)
    for i, n in enumerate([6, 7, 8, 9]):
        ref, _ = brute_attention(q[4 + i:5 + i], k[:n], v[:n], q_pos=[n - 1])
        np.testing.assert_allclose(o[4 + i], ref[0], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# Random batches vs brute force
# ---------------------------------------------------------------------------

@st.composite
def batches(draw, causal=None, allow_empty=True):
    batch = draw(st.integers(1, 4))
    causal = draw(st.booleans()) if causal is None else causal
    kv_lens = draw(st.lists(st.integers(0 if allow_empty else 1, 13), min_size=batch, max_size=batch))
    if causal:
        qo_lens = [draw(st.integers(0, kv)) for kv in kv_lens]
    else:
        qo_lens = draw(st.lists(st.integers(0, 5), min_size=batch, max_size=batch))
    return dict(
        causal=causal, qo_lens=qo_lens, kv_lens=kv_lens,
        page_size=draw(st.sampled_from([1, 3, 4, 5])),
        num_kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.sampled_from([4, 8])),
        kv_layout=draw(st.sampled_from(["NHD", "HND"])),
        share=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make(p):
    rng = np.random.default_rng(p["seed"])
    return random_paged_batch(rng, qo_lens=p["qo_lens"], kv_lens=p["kv_lens"], page_size=p["page_size"],
                              num_kv_heads=p["num_kv_heads"], group=p["group"], head_dim=p["head_dim"],
                              kv_layout=p["kv_layout"], share_first_page=p["share"])


def brute_paged(b, p, **variant):
    outs, lses = [], []
    for r in range(len(p["qo_lens"])):
        qs = slice(b["qo_indptr"][r], b["qo_indptr"][r + 1])
        k, v = gather_pages(b["cache"], b["indptr"], b["indices"], b["last"], r, p["kv_layout"])
        o, lse = brute_attention(b["q"][qs], k, v, b=r, **variant)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


@SETTINGS
@given(batches())
def test_batch_prefill_paged_vs_brute(p):
    b = make(p)
    o, lse = R.batch_prefill_paged(b["q"], b["cache"], b["qo_indptr"], b["indptr"], b["indices"], b["last"],
                                   kv_layout=p["kv_layout"], causal=p["causal"], return_lse=True)
    o_ref, lse_ref = brute_paged(b, p, causal=p["causal"])
    close_states(o, lse, o_ref, lse_ref)


VARIANTS = [
    dict(logits_soft_cap=2.0),
    dict(pos_encoding_mode="ALIBI"),
    dict(window_left=2),
    dict(window_left=1, sink_size=2),
    dict(use_sigmoid=True, sigmoid_bias=-0.5),
    dict(sm_scale=0.7),
    dict(score_mod=lambda s, b, h, qi, kj: s + 0.1 * h - 0.05 * (qi - kj)),
    dict(mask_mod=lambda b, h, qi, kj: (kj % 2 == 0) | (h == 1)),
]


def brute_kwargs(var):
    kw = dict(var)
    if kw.pop("pos_encoding_mode", None) == "ALIBI":
        kw["alibi"] = True
    return kw


@SETTINGS
@given(batches(causal=True), st.sampled_from(range(len(VARIANTS))))
def test_variants_vs_brute(p, vi):
    var = VARIANTS[vi]
    b = make(p)
    lse_wanted = not var.get("use_sigmoid")
    out = R.batch_prefill_paged(b["q"], b["cache"], b["qo_indptr"], b["indptr"], b["indices"], b["last"],
                                kv_layout=p["kv_layout"], causal=True, return_lse=lse_wanted, **var)
    o_ref, lse_ref = brute_paged(b, p, causal=True, **brute_kwargs(var))
    if lse_wanted:
        close_states(out[0], out[1], o_ref, lse_ref)
    else:
        np.testing.assert_allclose(out, o_ref, **TOL)


def test_score_mod_with_if_statement_uses_scalar_fallback():
    def clip_far(score, b, h, q_idx, kv_idx):
        if q_idx - kv_idx > 3:
            return score - 100.0
        return score

    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((3, 2, 4)), rng.standard_normal((9, 2, 4))
    o = R.single_prefill(q, k, k, causal=True, score_mod=clip_far, dtype=np.float64)
    ref, _ = brute_attention(q, k, k, causal=True, score_mod=clip_far)
    np.testing.assert_allclose(o, ref, rtol=1e-10)


@SETTINGS
@given(batches(causal=False, allow_empty=True))
def test_ragged_equals_paged_and_brute(p):
    b = make(p)
    ks, vs = zip(*[gather_pages(b["cache"], b["indptr"], b["indices"], b["last"], r, p["kv_layout"])
                   for r in range(len(p["kv_lens"]))])
    k, v = np.concatenate(ks).astype(np.float32), np.concatenate(vs).astype(np.float32)
    kv_indptr = np.concatenate([[0], np.cumsum(p["kv_lens"])]).astype(np.int32)
    o_r, l_r = R.batch_prefill_ragged(b["q"], k, v, b["qo_indptr"], kv_indptr, return_lse=True)
    o_p, l_p = R.batch_prefill_paged(b["q"], b["cache"], b["qo_indptr"], b["indptr"], b["indices"], b["last"],
                                     kv_layout=p["kv_layout"], return_lse=True)
    close_states(o_r, l_r, o_p, l_p, dict(rtol=1e-6, atol=1e-6))
    o_ref, l_ref = brute_paged(b, p)
    close_states(o_r, l_r, o_ref, l_ref)


@SETTINGS
@given(batches(causal=True, allow_empty=False))
def test_decode_equals_last_row_of_prefill(p):
    b = make(p)
    p2 = dict(p, qo_lens=[1] * len(p["kv_lens"]))
    d = make(p2)
    # decode queries = the last query row of each request of a causal prefill
    q_last = d["q"]
    o_dec, l_dec = R.batch_decode_paged(q_last, b["cache"], b["indptr"], b["indices"], b["last"],
                                        kv_layout=p["kv_layout"], return_lse=True)
    o_pre, l_pre = R.batch_prefill_paged(q_last, b["cache"], d["qo_indptr"], b["indptr"], b["indices"], b["last"],
                                         kv_layout=p["kv_layout"], causal=True, return_lse=True)
    close_states(o_dec, l_dec, o_pre, l_pre, dict(rtol=1e-6, atol=1e-6))
    # and inside a longer prefill, the last row is the same computation
    for r in range(len(p["kv_lens"])):
        if p["qo_lens"][r] == 0:
            continue
        rows = slice(b["qo_indptr"][r], b["qo_indptr"][r + 1])
        qq = b["q"][rows].copy()
        qq[-1] = q_last[r]
        qo = np.array([0, len(qq)], np.int32)
        ip = np.array([0, b["indptr"][r + 1] - b["indptr"][r]], np.int32)
        ix = b["indices"][b["indptr"][r]:b["indptr"][r + 1]]
        o = R.batch_prefill_paged(qq, b["cache"], qo, ip, ix, b["last"][r:r + 1], kv_layout=p["kv_layout"],
                                  causal=True)
        np.testing.assert_allclose(o[-1], o_dec[r], rtol=1e-5, atol=1e-6)


@SETTINGS
@given(batches(causal=False))
def test_nhd_equals_hnd(p):
    p = dict(p, kv_layout="NHD")
    b = make(p)
    hnd = np.ascontiguousarray(b["cache"].transpose(0, 1, 3, 2, 4))
    args = (b["qo_indptr"], b["indptr"], b["indices"], b["last"])
    o1, l1 = R.batch_prefill_paged(b["q"], b["cache"], *args, kv_layout="NHD", return_lse=True)
    o2, l2 = R.batch_prefill_paged(b["q"], hnd, *args, kv_layout="HND", return_lse=True)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)


def test_single_decode_and_prefill_shapes_and_values():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((4, 8)).astype(np.float32)
    k = rng.standard_normal((7, 2, 8)).astype(np.float32)
    v = rng.standard_normal((7, 2, 8)).astype(np.float32)
    o, lse = R.single_decode(q, k, v, return_lse=True)
    ref, lref = brute_attention(q[None], k, v)
    assert o.shape == (4, 8) and lse.shape == (4,)
    np.testing.assert_allclose(o, ref[0], **TOL)
    np.testing.assert_allclose(lse, lref[0], **TOL)
    o_hnd = R.single_decode(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), kv_layout="HND")
    np.testing.assert_allclose(o_hnd, o, rtol=1e-6)


# ---------------------------------------------------------------------------
# Split-KV, merge algebra, cascade, BSR
# ---------------------------------------------------------------------------

@SETTINGS
@given(st.integers(1, 12), st.integers(1, 3), st.booleans(), st.integers(0, 2**31 - 1))
def test_split_at_every_cut_equals_unsplit(nk, nq, causal, seed):
    rng = np.random.default_rng(seed)
    nq = min(nq, nk) if causal else nq
    q = rng.standard_normal((nq, 4, 8))
    k, v = rng.standard_normal((nk, 2, 8)), rng.standard_normal((nk, 2, 8))
    o, lse = R.single_prefill(q, k, v, causal=causal, return_lse=True, dtype=np.float64)
    for cut in range(nk + 1):
        o2, l2 = R.split_kv(q, k, v, np.array([0, cut, nk], np.int32), causal=causal, return_lse=True,
                            dtype=np.float64)
        close_states(o2, l2, o, lse, dict(rtol=1e-10, atol=1e-12))
    # also a random multi-way split, and sigmoid partials that simply add
    cuts = np.unique(np.concatenate([[0, nk], rng.integers(0, nk + 1, 3)])).astype(np.int32)
    o3 = R.split_kv(q, k, v, cuts, causal=causal, use_sigmoid=True, dtype=np.float64)
    np.testing.assert_allclose(o3, R.single_prefill(q, k, v, causal=causal, use_sigmoid=True, dtype=np.float64),
                               rtol=1e-10, atol=1e-12)


@st.composite
def states(draw, n=3):
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        o = rng.standard_normal((5, 2, 4))
        lse = rng.uniform(-30, 30, (5, 2))
        lse[rng.random((5, 2)) < 0.2] = -np.inf  # some empty key sets
        o[np.isneginf(lse)] = 0.0
        out.append((o, lse))
    return out


@SETTINGS
@given(states())
def test_merge_is_associative_and_commutative(sts):
    (a, la), (b, lb), (c, lc) = sts
    ab = R.merge_state(a, la, b, lb)
    ba = R.merge_state(b, lb, a, la)
    close_states(ab.o, ab.lse, ba.o, ba.lse, dict(rtol=1e-12, atol=1e-12))
    left = R.merge_state(*ab, c, lc)
    right = R.merge_state(a, la, *R.merge_state(b, lb, c, lc))
    close_states(left.o, left.lse, right.o, right.lse, dict(rtol=1e-10, atol=1e-12))
    assert not np.isnan(left.o).any() and not np.isnan(left.lse).any()
    stacked = R.merge_states(np.stack([a, b, c], 1), np.stack([la, lb, lc], 1))
    close_states(stacked.o, stacked.lse, left.o, left.lse, dict(rtol=1e-12, atol=1e-12))


def test_merge_state_in_place_with_mask():
    rng = np.random.default_rng(4)
    v, s = rng.standard_normal((3, 2, 4)), rng.standard_normal((3, 2))
    vo, so = rng.standard_normal((3, 2, 4)), rng.standard_normal((3, 2))
    want = R.merge_state(v, s, vo, so)
    v0, s0 = v.copy(), s.copy()
    mask = np.array([True, False, True])
    R.merge_state_in_place(v, s, vo, so, mask=mask)
    np.testing.assert_allclose(v[mask], want.o[mask])
    np.testing.assert_allclose(s[mask], want.lse[mask])
    np.testing.assert_array_equal(v[1], v0[1])
    np.testing.assert_array_equal(s[1], s0[1])


def test_empty_states_and_fully_masked_rows():
    e_o, e_l = np.zeros((2, 3)), np.full(2, -np.inf)
    o, lse = R.merge_state(e_o, e_l, e_o, e_l)
    assert np.all(o == 0) and np.all(np.isneginf(lse))
    x_o, x_l = np.ones((2, 3)), np.array([0.5, -2.0])
    o, lse = R.merge_state(e_o, e_l, x_o, x_l)
    np.testing.assert_array_equal(o, x_o)
    np.testing.assert_array_equal(lse, x_l)
    # a request with no keys, and rows a mask_mod hides completely
    rng = np.random.default_rng(5)
    q = rng.standard_normal((3, 2, 4)).astype(np.float32)
    k = np.zeros((0, 1, 4), np.float32)
    o, lse = R.single_prefill(q, k, k, return_lse=True)
    assert np.all(o == 0) and np.all(np.isneginf(lse))
    k = rng.standard_normal((5, 1, 4)).astype(np.float32)
    hide_first = lambda b, h, qi, kj: qi >= 3  # noqa: E731  (query 0 sits at position 2)
    o, lse = R.single_prefill(q, k, k, return_lse=True, mask_mod=hide_first)
    assert not np.isnan(o).any()
    assert np.all(o[0] == 0) and np.all(np.isneginf(lse[0]))
    assert np.isfinite(lse[1:]).all() and np.abs(o[1:]).max() > 0
    ref, lref = brute_attention(q, k, k, mask_mod=hide_first)
    close_states(o, lse, ref, lref)


def test_large_logits_stay_exact():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 2, 4))
    k, v = rng.standard_normal((6, 2, 4)), rng.standard_normal((6, 2, 4))
    for off in (1000.0, -1000.0):
        o, lse = R.single_prefill(q, k, v, return_lse=True, score_mod=lambda s, b, h, qi, kj: s + off)
        o0, lse0 = R.single_prefill(q, k, v, return_lse=True)
        np.testing.assert_allclose(o, o0, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse, lse0 + off / math.log(2), rtol=1e-6)
        assert np.isfinite(o).all()


def test_natural_lse_passed_as_base2_is_caught():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 1, 4))
    k, v = rng.standard_normal((8, 1, 4)), rng.standard_normal((8, 1, 4))
    cuts = np.array([0, 3, 8], np.int32)
    o, _, (po, pl) = R.split_kv(q, k, v, cuts, return_lse=True, return_partials=True, dtype=np.float64)
    natural = R.lse_base2_to_natural(pl)
    wrong = R.merge_states(po, natural).o
    right = R.merge_states(po, R.lse_natural_to_base2(natural)).o
    np.testing.assert_allclose(right, o, rtol=1e-12)
    assert np.abs(wrong - o).max() > 1e-3  # mixing bases gives a visibly different answer


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 2, 4]), st.booleans())
def test_cascade_equals_flat_paged(seed, page_size, causal):
    rng = np.random.default_rng(seed)
    q, cache, qo_lens, qo_indptr, pkv, prefix_pages = shared_prefix_batch(rng, page_size)
    batch = len(qo_lens)
    levels = L.cascade_decompose(qo_indptr, pkv)
    if batch > 1:
        assert len(levels[0].paged_kv_indices) == prefix_pages  # one block row holds the shared pages
    kw = dict(causal=causal, return_lse=True, pos_encoding_mode="ALIBI", window_left=5)
    o_c, l_c = R.cascade(q, levels, cache, **kw)
    o_f, l_f = R.batch_prefill_paged(q, cache, qo_indptr, pkv.paged_kv_indptr, pkv.paged_kv_indices,
                                     pkv.paged_kv_last_page_len, **kw)
    close_states(o_c, l_c, o_f, l_f, dict(rtol=2e-5, atol=2e-5))


@SETTINGS
@given(st.integers(1, 9), st.integers(1, 11), st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_block_sparse_equals_dense_under_mask(m, n, br, bc, seed):
    rng = np.random.default_rng(seed)
    nbr, nbc = -(-m // br), -(-n // bc)
    block = rng.random((nbr, nbc)) < 0.5
    bsr = L.BSR.from_block_mask(block, (br, bc), (m, n))
    q = rng.standard_normal((m, 2, 4))
    k, v = rng.standard_normal((n, 1, 4)), rng.standard_normal((n, 1, 4))
    o, lse = R.block_sparse(q, k, v, bsr, return_lse=True, dtype=np.float64)
    elem = np.zeros((m, n), bool)
    for i in range(m):
        for j in range(n):
            elem[i, j] = block[i // br, j // bc]
    ref, lref = brute_attention(q, k, v, extra_mask=elem)
    close_states(o, lse, ref, lref, dict(rtol=1e-10, atol=1e-12))


# ---------------------------------------------------------------------------
# torch SDPA as a second reference
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 4])
def test_against_torch_sdpa(causal, group):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8 + group)
    nq, nk, hkv, d = 5, 9, 2, 16
    q = rng.standard_normal((nq, hkv * group, d)).astype(np.float32)
    k = rng.standard_normal((nk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((nk, hkv, d)).astype(np.float32)
    o, lse = R.single_prefill(q, k, v, causal=causal, return_lse=True)
    tq, tk, tv = (torch.from_numpy(x).transpose(0, 1)[None] for x in (q, k, v))
    mask = None
    if causal:  # torch's is_causal is top-left aligned; ours is bottom-right
        mask = torch.from_numpy(np.arange(nk)[None, :] <= np.arange(nk - nq, nk)[:, None])
    ref = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True)
    np.testing.assert_allclose(o, ref[0].transpose(0, 1).numpy(), rtol=1e-4, atol=1e-5)
    # torch's natural-log LSE, converted once to base 2
    s = torch.einsum("hqd,hkd->hqk", tq[0], tk[0].repeat_interleave(group, 0)) / math.sqrt(d)
    if causal:
        s = s.masked_fill(~mask, float("-inf"))
    lse_nat = torch.logsumexp(s, dim=-1).T.numpy()
    np.testing.assert_allclose(lse, R.lse_natural_to_base2(lse_nat), rtol=1e-5, atol=1e-5)


def test_alibi_slopes_values():
    np.testing.assert_allclose(alibi_slopes(8), 2.0 ** (-np.arange(1, 9)), rtol=1e-6)
    np.testing.assert_allclose(alibi_slopes(6), [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3], rtol=1e-6)


def test_float64_option_and_variant_object():
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 2, 4)).astype(np.float32)
    k = rng.standard_normal((5, 2, 4)).astype(np.float32)
    o64 = R.single_prefill(q, k, k, dtype=np.float64, variant=Variant(causal=True, logits_soft_cap=3.0))
    o32 = R.single_prefill(q, k, k, causal=True, logits_soft_cap=3.0)
    assert o64.dtype == np.float64 and o32.dtype == np.float32
    np.testing.assert_allclose(o32, o64, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="unknown keyword"):
        R.single_prefill(q, k, k, casual=True)
    with pytest.raises(ValueError, match="return_lse"):
        R.single_prefill(q, k, k, use_sigmoid=True, return_lse=True)
