"""nbattn.cuda decode kernel vs the golden model and a float64 brute force.

Runs in numba's CUDA simulator on CI (tiny shapes: each simulated thread is a
Python thread); the same tests run on a GPU.  Every test draws fresh random
inputs from its own seeded generator.
"""
from __future__ import annotations

import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn import layout as L
from nbattn import reference as R
from nbattn.cuda import decode as DEC
from nbattn.cuda import decode_problem as DP
from nbattn.cuda import batch_decode_paged
from nbattn.cuda.blocks.primitives import SIMULATOR
from nbattn.cuda.tuning import DECODE
from numba import cuda

from brute import brute_attention, gather_pages, random_paged_batch

TOL = {"f32": 2e-4, "f16": 4e-3, "bf16": 3e-2}


def to_dtype(x: np.ndarray, code: str) -> np.ndarray:
    if code == "f16":
        return x.astype(np.float16)
    if code == "bf16":  # round to nearest even, kept as raw 2-byte void (torch's bf16 view)
        b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
        return b.view(np.dtype("V2"))
    return x.astype(np.float32)


def as_f32(x) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.kind == "V":
        return (x.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def batch(rng, code, *, kv_lens, page_size, num_kv_heads=2, group=2, head_dim=16, layout="NHD",
          share=False):
    b = random_paged_batch(rng, qo_lens=[1] * len(kv_lens), kv_lens=kv_lens, page_size=page_size,
                           num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, kv_layout=layout,
                           share_first_page=share)
    b["q"], b["cache"] = to_dtype(b["q"], code), to_dtype(b["cache"], code)
    return b


def brute_decode(b, layout="NHD", **variant):
    q, cache = as_f32(b["q"]).astype(np.float64), as_f32(b["cache"]).astype(np.float64)
    alibi = variant.pop("pos_encoding_mode", "NONE") == "ALIBI"
    o = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    for r in range(q.shape[0]):
        k, v = gather_pages(cache, b["indptr"], b["indices"], b["last"], r, layout)
        if k.shape[0] == 0:
            continue
        o[r:r + 1], lse[r:r + 1] = brute_attention(q[r:r + 1], k, v, alibi=alibi, b=r, **variant)
    return o, lse


def run(b, layout="NHD", **kw):
    return batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"],
                              kv_layout=layout, **kw)


def golden(b, layout="NHD", **kw):
    return R.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"],
                                kv_layout=layout, **kw)


def check(o, lse, ro, rlse, code, *, lse_tol=1e-4):
    o = as_f32(o)
    assert o.shape == ro.shape
    np.testing.assert_allclose(o, ro, atol=TOL[code], rtol=TOL[code])
    assert np.array_equal(np.isneginf(lse), np.isneginf(rlse))
    fin = np.isfinite(rlse)
    np.testing.assert_allclose(lse[fin], rlse[fin], atol=lse_tol, rtol=lse_tol)


# ---------------------------------------------------------------------------
# Plain decode: dtypes x layouts x page sizes x groups, empty requests, shared pages
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("code,layout,page_size,group", [
    ("f16", "NHD", 3, 2), ("f16", "HND", 1, 4), ("bf16", "NHD", 16, 1), ("bf16", "HND", 3, 4),
    ("f32", "NHD", 1, 1), ("f32", "HND", 16, 2),
])
def test_decode_matches_golden_and_brute(code, layout, page_size, group):
    rng = np.random.default_rng([3, page_size, group, len(code), len(layout)])
    kv_lens = [int(x) for x in rng.integers(1, 20, size=3)] + [0]   # non-full last pages, one empty
    b = batch(rng, code, kv_lens=kv_lens, page_size=page_size, group=group, layout=layout, share=True)
    o, lse = run(b, layout, return_lse=True)
    assert o.dtype == b["q"].dtype and lse.dtype == np.float32
    ro, rlse = golden(b, layout, return_lse=True)
    check(o, lse, ro, rlse, code)
    bo, blse = brute_decode(b, layout)
    check(o, lse, bo, blse, code)
    assert np.all(as_f32(o)[-1] == 0) and np.all(np.isneginf(lse[-1]))   # empty request


def test_head_dim_8_and_group_8_splits_heads():
    rng = np.random.default_rng(11)
    b = batch(rng, "f16", kv_lens=[7, 12], page_size=4, num_kv_heads=1, group=16, head_dim=8)
    o, lse = run(b, return_lse=True)
    check(o, lse, *golden(b, return_lse=True), "f16")


# ---------------------------------------------------------------------------
# Variants (each compiled into the kernel) vs golden and brute force
# ---------------------------------------------------------------------------

VARIANTS = {
    "causal_scale": dict(causal=True, sm_scale=0.3),
    "soft_cap": dict(logits_soft_cap=2.0, sm_scale=1.0),
    "alibi": dict(pos_encoding_mode="ALIBI"),
    "window_sinks": dict(window_left=4, sink_size=2),
    "score_mod": dict(score_mod=lambda s, b, h, q, k: s - 0.05 * (q - k) + 0.1 * h),
    "mask_mod": dict(mask_mod=lambda b, h, q, k: (k + h + b) % 3 != 0),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant(name):
    rng = np.random.default_rng([7, len(name), ord(name[0])])
    b = batch(rng, "f32", kv_lens=[int(x) for x in rng.integers(1, 18, size=3)], page_size=3)
    o, lse = run(b, return_lse=True, **VARIANTS[name])
    check(o, lse, *golden(b, return_lse=True, **VARIANTS[name]), "f32")
    check(o, lse, *brute_decode(b, **VARIANTS[name]), "f32")


def test_sigmoid_attention():
    rng = np.random.default_rng(8)
    b = batch(rng, "f32", kv_lens=[5, 11, 0], page_size=4)
    kw = dict(use_sigmoid=True, sigmoid_bias=-0.5, window_left=6)
    o = run(b, **kw)
    np.testing.assert_allclose(o, golden(b, **kw), atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(o, brute_decode(b, **kw)[0], atol=2e-4, rtol=2e-4)
    with pytest.raises(ValueError, match="return_lse"):
        run(b, return_lse=True, **kw)


def test_fully_masked_rows_are_empty_states():
    rng = np.random.default_rng(9)
    b = batch(rng, "f16", kv_lens=[6, 9], page_size=2)
    o, lse = run(b, return_lse=True, mask_mod=lambda b, h, q, k: h % 2 == 0)
    o = as_f32(o)
    assert np.all(o[:, 1::2] == 0) and np.all(np.isneginf(lse[:, 1::2]))
    assert np.all(np.isfinite(lse[:, 0::2])) and not np.isnan(o).any()


def test_extreme_logits():
    rng = np.random.default_rng(10)
    b = batch(rng, "f32", kv_lens=[9, 14], page_size=3)
    b["q"] = (b["q"] * 1000.0).astype(np.float32)            # scores around +-1000 and beyond
    o, lse = run(b, return_lse=True, sm_scale=1.0)
    ro, rlse = golden(b, return_lse=True, sm_scale=1.0)
    assert np.isfinite(o).all()
    np.testing.assert_allclose(o, ro, atol=1e-3)
    np.testing.assert_allclose(lse, rlse, rtol=1e-5)


# ---------------------------------------------------------------------------
# Split-KV: chunks merged in KV order equal the unsplit kernel
# ---------------------------------------------------------------------------

def _decode_with_chunks(b, chunk, **kw):
    p = DEC.prepare_decode(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], **kw)
    DEC.run_split(p, chunk)
    return DEC.finish_decode(p, True)


@pytest.mark.parametrize("chunk", [1, 5, 8])
def test_split_kv_equals_unsplit(chunk):
    rng = np.random.default_rng([12, chunk])
    b = batch(rng, "f16", kv_lens=[17, 3, 0, 11], page_size=3, group=2)
    kw = dict(window_left=9, sink_size=1)
    uo, ul = _decode_with_chunks(b, None, **kw)
    so, sl = _decode_with_chunks(b, chunk, **kw)
    np.testing.assert_allclose(as_f32(so), as_f32(uo), atol=2e-3)
    np.testing.assert_allclose(sl[np.isfinite(ul)], ul[np.isfinite(ul)], atol=1e-5)
    check(so, sl, *golden(b, return_lse=True, **kw), "f16")


def test_split_kv_sigmoid_partials_add():
    rng = np.random.default_rng(13)
    b = batch(rng, "f32", kv_lens=[13, 4], page_size=2)
    o, _ = _decode_with_chunks(b, 4, use_sigmoid=True)
    np.testing.assert_allclose(o, golden(b, use_sigmoid=True), atol=2e-4)


def test_work_list_queue_and_merge_order():
    """The scheduler's entry point: several items per CTA, partial slots out of order."""
    _work_list_queue_and_merge_order(None)


def _work_list_queue_and_merge_order(tuning):
    from nbattn.cuda.merge import MergeMap, run_merge_partials
    rng = np.random.default_rng(14)
    b = batch(rng, "f32", kv_lens=[10, 6], page_size=4, group=2)
    p = DEC.prepare_decode(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], return_lse=True,
                           tuning=tuning)
    # request 0 in three chunks (slots 2, 0, 1 in KV order), request 1 written directly
    work = [np.array(x, np.int32) for x in ([0, 2, 4], [0, 1, 0, 0], [0, 0, 4, 8], [4, 6, 8, 10],
                                            [2, -1, 0, 1])]
    dwork = DEC.WorkList(*[cuda.to_device(a) for a in work])
    po = cuda.device_array((3, p.num_qo_heads, p.head_dim), np.float32)
    pl = cuda.device_array((3, p.num_qo_heads), np.float32)
    DEC.run_decode_work(p, dwork, po, pl)
    mmap = MergeMap(*[cuda.to_device(np.array(x, np.int32)) for x in ([0, 3], [0], [2, 0, 1])])
    run_merge_partials(po, pl, mmap, p.out_dev, p.lse_dev, code="f32")
    o, lse = DEC.finish_decode(p, True)
    check(o, lse, *golden(b, return_lse=True), "f32")
    # partial states themselves are the golden split_kv partials
    q = b["q"][0:1]
    k, v = gather_pages(b["cache"], b["indptr"], b["indices"], b["last"], 0)
    _, _, (gpo, gpl) = R.split_kv(q, k, v, np.array([0, 4, 8, 10], np.int32), return_lse=True,
                                  return_partials=True)
    hpo, hpl = po.copy_to_host(), pl.copy_to_host()
    np.testing.assert_allclose(hpo[[2, 0, 1]], gpo[0], atol=2e-4)
    np.testing.assert_allclose(hpl[[2, 0, 1]], gpl[0], atol=1e-4)


def test_builtin_heuristic_splits_long_requests():
    rng = np.random.default_rng(15)
    # long enough for the heuristic's floor of 8 CTA steps, whichever path (and step) this device uses
    probe = batch(rng, "f32", kv_lens=[16], page_size=16, num_kv_heads=1, group=1)
    step = DEC.prepare_decode(probe["q"], probe["cache"], probe["indptr"], probe["indices"],
                              probe["last"]).config().tile_tokens
    b = batch(rng, "f32", kv_lens=[20 * step + 3], page_size=16, num_kv_heads=1, group=1)
    p = DEC.prepare_decode(b["q"], b["cache"], b["indptr"], b["indices"], b["last"])
    assert DEC.choose_chunk(p) is not None                     # one request cannot fill the GPU
    o, lse = run(b, return_lse=True)
    check(o, lse, *golden(b, return_lse=True), "f32")


# ---------------------------------------------------------------------------
# Inputs, outputs, errors
# ---------------------------------------------------------------------------

def test_device_arrays_in_device_arrays_out_and_out_buffers():
    rng = np.random.default_rng(16)
    b = batch(rng, "f16", kv_lens=[5, 8], page_size=4)
    dq, dc = cuda.to_device(b["q"]), cuda.to_device(b["cache"])
    out = cuda.to_device(np.full(b["q"].shape, np.nan, np.float16))
    lse = cuda.to_device(np.full(b["q"].shape[:2], np.nan, np.float32))
    res_o, res_l = batch_decode_paged(dq, dc, cuda.to_device(b["indptr"]), b["indices"], b["last"],
                                      return_lse=True, out=out, lse=lse)
    assert res_o is out and res_l is lse
    check(out.copy_to_host(), lse.copy_to_host(), *golden(b, return_lse=True), "f16")
    host_out = np.full(b["q"].shape, np.nan, np.float16)
    r = run(b, out=host_out)
    assert r is host_out and not np.isnan(host_out.astype(np.float32)).any()


def _bad_cases(b):
    q, c, ip, ix, lp = b["q"], b["cache"], b["indptr"], b["indices"], b["last"]
    return {
        "q dtype": ((q.astype(np.float64), c, ip, ix, lp), {}, "q"),
        "dtype mismatch": ((q.astype(np.float32), c, ip, ix, lp), {}, "paged_kv_cache"),
        "float indptr": ((q, c, ip.astype(np.float32), ix, lp), {}, "paged_kv_indptr"),
        "decreasing indptr": ((q, c, ip[::-1].copy(), ix, lp), {}, "paged_kv_indptr"),
        "page id out of pool": ((q, c, ip, np.full_like(ix, c.shape[0]), lp), {}, "paged_kv_indices"),
        "last_page_len 0": ((q, c, ip, ix, np.zeros_like(lp)), {}, "paged_kv_last_page_len"),
        "heads": ((q[:, :3], c, ip, ix, lp), {}, "num_qo_heads"),
        "head_dim": ((q[..., :12].copy(), c[..., :12].copy(), ip, ix, lp), {}, "paged_kv_cache"),
        "rows": ((q[:1], c, ip, ix, lp), {}, "q"),
        "layout": ((q, c, ip, ix, lp), {"kv_layout": "NDH"}, "kv_layout"),
        "out shape": ((q, c, ip, ix, lp), {"out": np.zeros((1, 1, 1), np.float16)}, "out"),
        "lse dtype": ((q, c, ip, ix, lp), {"lse": np.zeros(q.shape[:2], np.float16)}, "lse"),
        "unknown kwarg": ((q, c, ip, ix, lp), {"windowleft": 3}, None),
    }


BAD_CASES = ["q dtype", "dtype mismatch", "float indptr", "decreasing indptr", "page id out of pool",
             "last_page_len 0", "heads", "head_dim", "rows", "layout", "out shape", "lse dtype",
             "unknown kwarg"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_inputs_raise_before_launch(case, monkeypatch):
    rng = np.random.default_rng(17)
    b = batch(rng, "f16", kv_lens=[5, 9], page_size=4)
    args, kw, name = _bad_cases(b)[case]
    snapshot = [np.array(a, copy=True) for a in args]
    launched = []
    monkeypatch.setattr(DP, "decode_kernel", lambda cfg: launched.append(cfg))
    err = TypeError if name is None else L.LayoutError
    with pytest.raises(err) as e:
        batch_decode_paged(*args, **kw)
    if name:
        assert str(e.value).startswith(name + ":")
    assert not launched
    for a, s in zip(args, snapshot):
        assert np.array_equal(np.asarray(a).view(np.uint8), s.view(np.uint8))


# ---------------------------------------------------------------------------
# The warp path (nbattn.cuda.kernels.decode_warp): the GPU's default.  Under the
# simulator it is forced on with emulated (block-wide) shuffles and one or two
# warps; on a GPU the same tests run it for real, plus real-size cases with
# poisoned outputs.
# ---------------------------------------------------------------------------

@pytest.fixture
def warp_path():
    """The tuning that forces the warp path."""
    return DECODE.replace(path="warp")


def _config_of(b, layout="NHD", **kw):
    return DEC.prepare_decode(b["q"], b["cache"], b["indptr"], b["indices"], b["last"],
                              kv_layout=layout, **kw).config()


@pytest.mark.parametrize("code,layout,page_size,group,head_dim,warps", [
    ("f16", "NHD", 3, 2, 16, 1), ("bf16", "HND", 4, 4, 32, 2), ("f32", "NHD", 1, 1, 64, 1),
    ("f16", "NHD", 5, 2, 8, 1), ("f32", "HND", 2, 6, 32, 1),   # 6 heads: 3 per CTA, padded to 4
])
def test_warp_path_matches_golden(warp_path, code, layout, page_size, group, head_dim, warps):
    tuning = warp_path.replace(warp_warps=warps) if SIMULATOR else warp_path
    rng = np.random.default_rng([21, page_size, group, head_dim])
    # emulated shuffles cost two block barriers each: keep the simulated cases short
    lens = [13, 1, 0, 20] if head_dim == 16 else [5, 1, 0, 9]
    b = batch(rng, code, kv_lens=lens, page_size=page_size, group=group, layout=layout,
              head_dim=head_dim, share=True)
    assert _config_of(b, layout, tuning=tuning).path == "warp"
    o, lse = run(b, layout, return_lse=True, tuning=tuning)
    check(o, lse, *golden(b, layout, return_lse=True), code)
    assert np.all(as_f32(o)[2] == 0) and np.all(np.isneginf(lse[2]))


def test_warp_path_variants_and_split(warp_path):
    rng = np.random.default_rng(22)
    b = batch(rng, "f32", kv_lens=[7, 10], page_size=3)
    kw = dict(causal=True, window_left=5, sink_size=2, logits_soft_cap=3.0, pos_encoding_mode="ALIBI",
              mask_mod=lambda b, h, q, k: (k + h) % 4 != 1)
    o, lse = run(b, return_lse=True, tuning=warp_path, **kw)
    check(o, lse, *golden(b, return_lse=True, **kw), "f32")
    so, sl = _decode_with_chunks(b, 5, tuning=warp_path, **kw)
    check(so, sl, *golden(b, return_lse=True, **kw), "f32")
    sig = dict(use_sigmoid=True, sigmoid_bias=-0.5, window_left=6)
    o, _ = _decode_with_chunks(b, 5, tuning=warp_path, **sig)
    np.testing.assert_allclose(o, golden(b, **sig), atol=2e-4, rtol=2e-4)


def test_warp_path_eight_heads_per_cta(warp_path):
    """One CTA for a whole group of 8 (opt-in: warp_max_heads=8): three reduce-scatter levels."""
    tuning = warp_path.replace(warp_max_heads=8)
    rng = np.random.default_rng(24)
    b = batch(rng, "f32", kv_lens=[5, 0, 6], page_size=4, num_kv_heads=1, group=8, head_dim=32)
    cfg = _config_of(b, tuning=tuning)
    assert (cfg.path, cfg.heads_per_cta, cfg.tuning) == ("warp", 8, tuning)
    o, lse = run(b, return_lse=True, tuning=tuning)
    check(o, lse, *golden(b, return_lse=True), "f32")


def test_warp_path_work_list(warp_path):
    _work_list_queue_and_merge_order(warp_path)


def test_warp_path_not_taken_for_odd_head_dim(warp_path):
    rng = np.random.default_rng(23)
    b = batch(rng, "f16", kv_lens=[4], page_size=2, head_dim=24)     # 3 chunks per row: no butterfly
    assert _config_of(b, tuning=warp_path).path == "smem"


def _poisoned_run(b, layout, chunk="auto", **kw):
    """Decode through the device arrays with NaN-poisoned outputs; every element must be written."""
    p = DEC.prepare_decode(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], kv_layout=layout,
                           return_lse=True, **kw)
    code = p.code
    nan_raw = {"f16": np.uint16(0x7E00), "bf16": np.uint16(0x7FC0), "f32": np.float32(np.nan)}[code]
    p.out_dev.copy_to_device(np.full(p.out_dev.shape, nan_raw, p.out_dev.dtype))
    p.lse_dev.copy_to_device(np.full(p.lse_dev.shape, np.nan, np.float32))
    DEC.run_split(p, DEC.choose_chunk(p) if chunk == "auto" else chunk)
    o, lse = DEC.finish_decode(p, True)
    return p.config(), o, lse


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a real GPU")
@pytest.mark.parametrize("code,layout,page_size,hkv,group,head_dim,nreq,max_len,chunk", [
    ("f16", "NHD", 16, 8, 4, 128, 24, 4100, "auto"),
    ("f16", "NHD", 16, 4, 8, 128, 32, 4100, "auto"),
    ("bf16", "HND", 1, 2, 8, 128, 8, 9000, "auto"),
    ("f32", "NHD", 64, 4, 1, 64, 32, 3000, None),
    ("f16", "NHD", 64, 1, 8, 256, 4, 20000, "auto"),
    ("bf16", "NHD", 3, 4, 4, 64, 16, 2000, 700),
    ("f16", "HND", 16, 8, 1, 128, 2, 33000, 1000),
    ("f16", "NHD", 5, 2, 6, 128, 8, 1500, None),
])
def test_warp_path_real_sizes_gpu(warp_path, code, layout, page_size, hkv, group, head_dim, nreq, max_len, chunk):
    rng = np.random.default_rng([31, page_size, hkv, group, head_dim, nreq])
    kv_lens = [int(x) for x in rng.integers(1, max_len, size=nreq)]
    kv_lens[0], kv_lens[-1] = 0, max_len           # an empty request and a full-length one
    b = batch(rng, code, kv_lens=kv_lens, page_size=page_size, num_kv_heads=hkv, group=group,
              head_dim=head_dim, layout=layout, share=True)
    cfg, o, lse = _poisoned_run(b, layout, chunk, tuning=warp_path)
    assert cfg.path == "warp"
    assert not np.isnan(as_f32(o)).any() and not np.isnan(lse).any()
    check(o, lse, *golden(b, layout, return_lse=True), code, lse_tol=2e-3)
    assert np.all(as_f32(o)[0] == 0) and np.all(np.isneginf(lse[0]))


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a real GPU")
def test_warp_path_variants_real_sizes_gpu(warp_path):
    rng = np.random.default_rng(32)
    b = batch(rng, "f16", kv_lens=[int(x) for x in rng.integers(1, 5000, size=12)], page_size=16,
              num_kv_heads=2, group=4, head_dim=128)
    for kw in (dict(causal=True, window_left=700, sink_size=4, logits_soft_cap=30.0, pos_encoding_mode="ALIBI"),
               dict(score_mod=lambda s, b, h, q, k: s - 0.001 * (q - k),
                    mask_mod=lambda b, h, q, k: (k + h) % 5 != 0)):
        cfg, o, lse = _poisoned_run(b, "NHD", 512, tuning=warp_path, **kw)
        assert cfg.path == "warp"
        check(o, lse, *golden(b, return_lse=True, **kw), "f16", lse_tol=2e-3)
    o = run(b, use_sigmoid=True, sigmoid_bias=-2.0, tuning=warp_path)
    np.testing.assert_allclose(as_f32(o), golden(b, use_sigmoid=True, sigmoid_bias=-2.0), atol=4e-3, rtol=4e-3)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a real GPU")
@pytest.mark.parametrize("code,layout,page_size", [("f16", "NHD", 16), ("bf16", "HND", 1)])
def test_warp_path_eight_heads_real_sizes_gpu(warp_path, code, layout, page_size):
    rng = np.random.default_rng([33, page_size])
    kv_lens = [0] + [int(x) for x in rng.integers(1, 6000, size=10)]
    b = batch(rng, code, kv_lens=kv_lens, page_size=page_size, num_kv_heads=2, group=8, head_dim=128,
              layout=layout)
    cfg, o, lse = _poisoned_run(b, layout, tuning=warp_path.replace(warp_max_heads=8))
    assert (cfg.path, cfg.heads_per_cta) == ("warp", 8)
    assert not np.isnan(as_f32(o)).any() and not np.isnan(lse).any()
    check(o, lse, *golden(b, layout, return_lse=True), code, lse_tol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a real GPU")
@pytest.mark.parametrize("code,layout,page_size,hkv,group,head_dim,chunk,variant", [
    ("f16", "NHD", 16, 4, 8, 128, "auto", {}),
    ("bf16", "HND", 1, 2, 4, 128, 700, {}),
    ("f16", "NHD", 5, 2, 6, 64, None, dict(window_left=900, sink_size=3, logits_soft_cap=20.0)),
    ("bf16", "NHD", 16, 1, 8, 96, "auto", dict(pos_encoding_mode="ALIBI",
                                               mask_mod=lambda b, h, q, k: (k + h) % 7 != 0)),
])
def test_tensor_core_path_real_sizes_gpu(code, layout, page_size, hkv, group, head_dim, chunk, variant):
    """The mma.sync decode path (GPU only, forced here) against the golden model."""
    rng = np.random.default_rng([34, page_size, hkv, group, head_dim])
    kv_lens = [0] + [int(x) for x in rng.integers(1, 6000, size=9)] + [17]
    b = batch(rng, code, kv_lens=kv_lens, page_size=page_size, num_kv_heads=hkv, group=group,
              head_dim=head_dim, layout=layout, share=True)
    cfg, o, lse = _poisoned_run(b, layout, chunk, tuning=DECODE.replace(path="tc"), **variant)
    assert cfg.path == "tc"
    assert not np.isnan(as_f32(o)).any() and not np.isnan(lse).any()
    check(o, lse, *golden(b, layout, return_lse=True, **variant), code, lse_tol=2e-3)
    assert np.all(as_f32(o)[0] == 0) and np.all(np.isneginf(lse[0]))


def test_decode_path_is_chosen_by_the_tuning_not_the_environment(monkeypatch):
    """``tuning=DECODE.replace(path=...)`` chooses the path call by call, through the
    public call too; an environment variable has no say (the package reads none)."""
    from nbattn.variants import Variant
    args = ("f32", 32, 2, "NHD", Variant(), True)
    auto = DEC.make_config(*args).path
    monkeypatch.setenv("NBATTN_DECODE_PATH", "warp" if auto != "warp" else "smem")
    assert DEC.make_config(*args).path == auto
    for path in ("warp", "smem", "auto"):
        cfg = DEC.make_config(*args, tuning=DECODE.replace(path=path))
        assert cfg.path == (auto if path == "auto" else path)
    assert DEC.make_config(*args, tuning=DECODE) is DEC.make_config(*args)
    rng = np.random.default_rng(25)
    b = batch(rng, "f32", kv_lens=[3, 5], page_size=4, head_dim=32)
    built = []
    real = DP.decode_kernel
    monkeypatch.setattr(DP, "decode_kernel", lambda cfg: built.append(cfg) or real(cfg))
    for path in ("smem", "warp"):
        o = run(b, tuning=DECODE.replace(path=path))
        assert built[-1].path == path and built[-1].tuning.path == path
        np.testing.assert_allclose(o, golden(b), atol=TOL["f32"], rtol=TOL["f32"])


def test_warp_min_blocks_sets_the_warp_paths_launch_bound():
    """``DecodeTuning.warp_min_blocks`` (0: the rule by heads a CTA) is the warp build's
    CTAs-an-SM bound; the other paths ignore it; a negative count is refused by name."""
    from nbattn.variants import Variant
    for heads, rule in ((4, 4), (8, 3)):      # (heads a CTA at group 8, the rule's bound)
        warp = DECODE.replace(path="warp", warp_max_heads=heads)
        args = ("f16", 128, 8, "NHD", Variant(pos_encoding_mode="ROPE_LLAMA"), True)
        assert DEC.make_config(*args, tuning=warp).min_blocks == rule
        for mb in (1, 2, 3, 5):
            cfg = DEC.make_config(*args, tuning=warp.replace(warp_min_blocks=mb))
            assert (cfg.path, cfg.heads_per_cta, cfg.min_blocks) == ("warp", heads, mb)
    smem = DEC.make_config("f32", 32, 2, "NHD", Variant(), True, tuning=DECODE.replace(path="smem",
                                                                                       warp_min_blocks=2))
    assert smem.path == "smem"
    with pytest.raises(ValueError, match="warp_min_blocks"):
        DECODE.replace(warp_min_blocks=-1)


@pytest.mark.parametrize("bad", ["warp", {"path": "warp"}, object()])
def test_tuning_of_another_type_raises_before_launch(monkeypatch, bad):
    from nbattn.cuda import single_decode
    from nbattn.cuda.tuning import PREFILL
    rng = np.random.default_rng(26)
    b = batch(rng, "f32", kv_lens=[3, 5], page_size=4)
    launched = []
    monkeypatch.setattr(DP, "decode_kernel", lambda cfg: launched.append(cfg))
    for call in (lambda: run(b, tuning=bad), lambda: run(b, tuning=PREFILL),
                 lambda: DEC.prepare_decode(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], tuning=bad),
                 lambda: single_decode(b["q"][0], b["q"][:4], b["q"][:4], tuning=DECODE)):
        with pytest.raises(TypeError, match="tuning"):
            call()
    assert not launched
