"""The register-tiled CUDA-core prefill tile (nbattn.cuda.kernels.prefill_cc) against a
float64 brute force and the golden model (docs/concepts/layouts.md, masks.md, state.md).

Under the simulator the tile runs at its tiny shape (T_q = 16 fused rows in two
"warps", T_k = 8 keys); the cases are sized so that several row tiles, several
KV tiles, partial tiles and both warps' rows take part.
"""
import math

import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn import _compat
from nbattn import reference as R
from nbattn.cuda import prefill as P
from nbattn.cuda.kernels import prefill_cc as CC
from nbattn.cuda.kernels import prefill_core
from nbattn.cuda.tuning import PREFILL
from nbattn.variants import Variant

from brute import brute_attention, gather_pages
from test_cuda_prefill import check, paged_case

SIM = _compat.simulator_enabled()


def to_bf16_raw(x):
    """float32 -> bf16 bits (round to nearest even) as NumPy's raw |V2, and the
    float32 values those bits stand for (what the reference must see)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return bits.view("V2"), (bits.astype(np.uint32) << 16).view(np.float32)


def brute_paged(q, cache, qo, ip, ix, lp, layout="NHD", **kw):
    """Per request: gather pages token by token, brute-force float64 attention."""
    o = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    for r in range(len(qo) - 1):
        a, b = int(qo[r]), int(qo[r + 1])
        if a == b:
            continue
        k, v = gather_pages(np.asarray(cache, np.float64), ip, ix, lp, r, layout)
        if len(k) == 0:
            continue
        o[a:b], lse[a:b] = brute_attention(q[a:b], k, v, b=r, **kw)
    return o, lse


def test_dispatch_picks_the_tile_where_it_applies():
    for kind in ("f16", "bf16", "f32"):
        spec = P.make_spec("paged", "NHD", kind, 16 if SIM else 128, 8, 2, Variant(causal=True), False)
        assert CC.covers(spec)
        assert (spec.tile_q, spec.tile_k, spec.threads) == CC.cuda_core_tiles(spec.head_dim, kind)
        assert P.get_tile(spec).py_func.__module__ == CC.__name__
    # a head_dim the lanes cannot split evenly falls back to the scalar tile
    spec = P.make_spec("paged", "NHD", "f16", 12, 8, 2, Variant(), False)
    assert not CC.covers(spec) and CC.cuda_core_tiles(12, "f16") is None
    assert P.get_tile(spec).py_func.__module__ == prefill_core.__name__
    # PrefillTuning.cuda_core off: the teaching tile on the same route
    spec = P.make_spec("paged", "NHD", "f16", 16 if SIM else 128, 8, 2, Variant(causal=True), False,
                       tuning=PREFILL.replace(cuda_core=False))
    assert not CC.covers(spec) and P.get_tile(spec).py_func.__module__ == prefill_core.__name__


@pytest.mark.parametrize("causal, layout", [(False, "NHD"), (True, "HND")])
def test_paged_gqa_against_brute_force(causal, layout):
    """GQA 4, page size 3 (non-full last pages), an empty request, a request with
    more fused rows than one tile and more keys than one KV tile."""
    rng = np.random.default_rng(101 + causal)
    q, cache, qo, ip, ix, lp = paged_case(rng, [5, 0, 9, 1], [21, 4, 9, 2], 3, hq=8, hk=2, d=16,
                                          layout=layout)
    got = P.batch_prefill_paged(q, cache, qo, ip, ix, lp, kv_layout=layout, causal=causal, return_lse=True,
                                tensor_cores=False)
    check(got, brute_paged(q, cache, qo, ip, ix, lp, layout, causal=causal))
    check(got, R.batch_prefill_paged(q, cache, qo, ip, ix, lp, kv_layout=layout, causal=causal,
                                     return_lse=True))


def test_empty_and_fully_masked_rows_with_huge_logits():
    """Scores of order +-1000 (fp32 inputs), a query position whose every key is
    masked, a request with no keys at all: o = 0 and lse = -inf there, never NaN."""
    rng = np.random.default_rng(102)
    q, cache, qo, ip, ix, lp = paged_case(rng, [6, 3], [13, 0], 4, hq=4, hk=1, d=16, dtype=np.float32)
    q, cache = q * 40, cache * 40
    mask = lambda b, h, qi, kj: qi != 9               # request 0's position 9 keeps nothing
    got = P.batch_prefill_paged(q, cache, qo, ip, ix, lp, mask_mod=mask, return_lse=True, tensor_cores=False)
    ref = brute_paged(q, cache, qo, ip, ix, lp, mask_mod=mask)
    assert np.abs(ref[1][np.isfinite(ref[1])]).max() > 500
    check(got, ref)
    check(got, R.batch_prefill_paged(q, cache, qo, ip, ix, lp, mask_mod=mask, return_lse=True))
    o, lse = got
    for row in (2, 6, 7, 8):                            # position 9 of request 0; request 1 (no keys)
        assert np.isneginf(lse[row]).all() and (o[row] == 0).all()
    assert np.isfinite(o).all()


@pytest.mark.parametrize("kw", [
    dict(causal=True, window_left=3, sink_size=2),      # whole KV tiles left of the window are skipped
    dict(logits_soft_cap=3.0, pos_encoding_mode="ALIBI", sm_scale=0.3),
    dict(use_sigmoid=True, sigmoid_bias=-1.0, causal=True),
    dict(score_mod=lambda s, b, h, qi, kj: s + 0.1 * (h + b) - 0.05 * (qi - kj), causal=True),
])
def test_variants_bf16_against_brute_force(kw):
    rng = np.random.default_rng(103)
    q, cache, qo, ip, ix, lp = paged_case(rng, [7, 2], [40, 5], 5, hq=4, hk=2, d=16, dtype=np.float32)
    (q_raw, q_f), (c_raw, c_f) = to_bf16_raw(q), to_bf16_raw(cache)
    lse = not kw.get("use_sigmoid")
    got = P.batch_prefill_paged(q_raw, c_raw, qo, ip, ix, lp, return_lse=lse, tensor_cores=False, **kw)
    bkw = {("alibi" if k == "pos_encoding_mode" else k): (True if k == "pos_encoding_mode" else v)
           for k, v in kw.items()}
    o_b, lse_b = brute_paged(q_f, c_f, qo, ip, ix, lp, **bkw)
    if lse:
        check(got, (o_b, lse_b), tol=1e-2)
    else:
        check(got, o_b, tol=1e-2)


def test_ragged_f32_and_single():
    rng = np.random.default_rng(104)
    hq, hk, d = 8, 2, 16
    q = rng.standard_normal((12, hq, d)).astype(np.float32)
    k = rng.standard_normal((30, hk, d)).astype(np.float32)
    v = rng.standard_normal((30, hk, d)).astype(np.float32)
    qo, kv = np.array([0, 9, 12], np.int32), np.array([0, 19, 30], np.int32)
    got = P.batch_prefill_ragged(q, k, v, qo, kv, causal=True, return_lse=True, tensor_cores=False)
    o0, l0 = brute_attention(q[:9], k[:19], v[:19], causal=True)
    o1, l1 = brute_attention(q[9:], k[19:], v[19:], causal=True, b=1)
    check(got, (np.concatenate([o0, o1]), np.concatenate([l0, l1])), tol=1e-4)
    got = P.single_prefill(q[:5], k[:7], v[:7], return_lse=True, tensor_cores=False)
    check(got, brute_attention(q[:5], k[:7], v[:7]), tol=1e-4)


def test_without_register_prefetch():
    """Wide K/V tiles load after the barrier instead of into registers ahead: the
    same results."""
    rng = np.random.default_rng(105)
    q, cache, qo, ip, ix, lp = paged_case(rng, [9, 3], [17, 3], 4, hq=8, hk=2, d=16)
    got = P.batch_prefill_paged(q, cache, qo, ip, ix, lp, causal=True, return_lse=True, tensor_cores=False,
                                tuning=PREFILL.replace(prefetch_max_chunks=0))
    check(got, brute_paged(q, cache, qo, ip, ix, lp, causal=True))


def test_lse_is_base_two():
    """One query, two keys with scores 0 and ln 3 (scale 1): lse = log2(1 + 3) = 2."""
    q = np.zeros((1, 1, 16), np.float32)
    k = np.zeros((2, 1, 16), np.float32)
    q[0, 0, 0] = 1.0
    k[1, 0, 0] = math.log(3.0)
    v = np.ones((2, 1, 16), np.float32)
    o, lse = P.single_prefill(q, k, v, sm_scale=1.0, return_lse=True, tensor_cores=False)
    np.testing.assert_allclose(lse, [[2.0]], rtol=1e-6)
    np.testing.assert_allclose(o, 1.0, rtol=1e-6)


def test_shared_layout_is_aligned_and_fits_two_ctas():
    # Q | K | V | P in one float array: each part starts on a 16-byte boundary (ld_v4 / st_v4),
    # and a shape the 100 KB GPU budget admits leaves room for two CTAs on an H200 SM (228 KB)
    R = PREFILL.rows_per_lane
    for D in (32, 64, 96, 128, 256):
        for RG, CG in ((4, 8), (2, 16), (2, 4)):
            for NW in (2, 4):
                for C in (1, 2, 4, 8):
                    offs = CC.smem_floats(D, RG, CG, NW, C, R)
                    assert all(x % 4 == 0 for x in offs)
                    T_q, T_k = NW * RG * R, CG * C
                    off_k, off_v, off_p, total = offs      # each part holds its rows, none overlap
                    assert off_k >= T_q * D and off_v - off_k >= T_k * D and off_p - off_v >= T_k * D
                    assert total - off_p >= NW * T_k * RG * R
    assert 2 * (CC.smem_bytes(128, 4, 8, 4, 4, R) + 1024) <= 228 * 1024
    # the simulator keeps every tile static: no launch passes dynamic shared memory there
    if SIM:
        spec = P.make_spec("paged", "NHD", "f16", 16, 8, 2, Variant(causal=True), False)
        assert CC.covers(spec) and CC.dynamic_smem(spec) == 0


def test_generated_source_is_shown_for_every_fast_tile():
    """``generated_source`` returns the straight-line text a fast tile compiles (the
    whole of it, or one function of it) -- for a tensor-core spec too, without a GPU."""
    from nbattn.cuda.kernels.prefill_common import KernelSpec
    from nbattn.cuda.kernels.prefill_dispatch import generated_source, tensor_core_tiles
    spec = P.make_spec("paged", "NHD", "f16", 16, 8, 2, Variant(causal=True), False)
    text = generated_source(spec)
    assert text == CC.source(spec) and all(f"def {n}(" in text for n in CC.MICRO_NAMES)
    put_p = generated_source(spec, "put_p")
    assert put_p.startswith("def put_p(") and put_p.count("def ") == 1 and "st_v4" in put_p
    with pytest.raises(KeyError, match="no function"):
        generated_source(spec, "nope")
    assert generated_source(P.make_spec("paged", "NHD", "f16", 12, 8, 2, Variant(), False)) == ""
    for d in (64, 96):                                   # pipelined, mma
        tc = KernelSpec("contig", "NHD", "f16", "f16", d, 4, 32, Variant(), True, *tensor_core_tiles(d))
        names = ("issue", "qk", "pv") if d == 64 else ("q_frags", "qk", "pv")
        assert all(f"def {n}(" in generated_source(tc) for n in names)


def test_generated_kernels_page_shows_what_generated_source_returns():
    """docs/concepts/generated_kernels.md prints one generated function; it is the
    text generated_source gives for the spec the page builds."""
    import pathlib
    import re

    from nbattn.cuda.kernels.prefill_common import KernelSpec
    from nbattn.cuda.kernels.prefill_dispatch import generated_source, tensor_core_tiles
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "concepts" / "generated_kernels.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    spec = KernelSpec("contig", "NHD", "f16", "f16", 64, 4, 32, Variant(causal=True), True, *tensor_core_tiles(64))
    assert generated_source(spec, "issue") in blocks


@pytest.mark.parametrize("kw", [
    dict(causal=True, window_left=40),                  # key tiles inside every row's window need no mask
    dict(causal=True, window_left=40, sink_size=3),
    dict(causal=False, window_left=33),
])
def test_window_interior_tiles_against_brute_force(kw):
    """Long windows: the tiles between a warp's window start and its diagonal take the
    scale-only step (prefill_common.warp_unmasked_keys), the edges the masked one;
    fresh data, non-full last pages, GQA, an empty request."""
    rng = np.random.default_rng()
    q, cache, qo, ip, ix, lp = paged_case(rng, [9, 2, 0], [97, 61, 0], 5, hq=4, hk=2, d=16, dtype=np.float32)
    got = P.batch_prefill_paged(q, cache, qo, ip, ix, lp, return_lse=True, tensor_cores=False, **kw)
    check(got, brute_paged(q, cache, qo, ip, ix, lp, **kw), tol=1e-4)
