"""fp8 KV caches on the kernels (nbattn.cuda.fp8, nbattn.cuda.blocks.fp8) against the golden model.

Every decode result is compared with :func:`nbattn.reference.batch_decode_paged`
in float64 over the same fp8 bytes (which dequantizes with torch, independently
of the kernels' bit manipulation), with fresh random inputs (the seed is in
each message): both fp8 formats, scales other than 1, GQA groups 1 and 4, last
pages not full, a page shared by several requests, an empty request, NaN and
infinite fp8 codes.  The byte converters are checked on all 256 codes against
torch.  Tests marked ``gpu`` run the realistic shapes (batch 64 x 4k keys,
group 4, page 16, head_dim 128, and batch 1 x 32k) on a GPU only.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import nbattn  # noqa: F401  (compat first: the simulator is chosen before numba.cuda loads)
from numba import cuda  # noqa: E402
import nbattn.cuda as C
from nbattn import layout as L
from nbattn import reference as R
from nbattn.reference.fp8 import quantize
from nbattn.cuda import decode as DEC
from nbattn.cuda import decode_problem as DP
from nbattn.cuda.blocks import nanrule as NR
from nbattn.cuda.blocks.fp8 import fp8_unpack4
from nbattn.cuda.blocks.primitives import SIMULATOR
from nbattn.cuda.kernels import decode_common as DCOM
from nbattn.cuda.tuning import DECODE
from nbattn.variants import Variant

from brute import assert_refused, bytes_of, fresh, indptr_of, shuffled_pages

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
NAME = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
FP8_BAD = {"e4m3": 0x7F, "e5m2": 0x7C}                  # magnitude bits all ones: NaN (e4m3fn), inf/NaN (e5m2)
QDT = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
TOL = {"f16": 5e-3, "bf16": 3e-2, "f32": 1e-4}
PATHS = ["smem", "warp"]


# ---------------------------------------------------------------------------
# Inputs and checks
# ---------------------------------------------------------------------------

def fp8_batch(rng, fmt, qdt, kv_lens, *, page_size, hkv=2, group=2, d=32, layout="NHD", ks=0.05, vs=0.01,
              share=False):
    """Shuffled pages of a larger pool; K ~ N(0, 1) and V ~ N(0, 4) stored as fp8 of ``x / scale``,
    quantized by the golden model (saturating: every code finite, whatever torch's own cast does
    with values beyond the fp8 maximum -- some torch versions make them NaN).
    ``share``: every request with two pages or more starts with request 0's first page."""
    pool, indptr, indices, last = shuffled_pages(rng, kv_lens, page_size)
    if share:
        first = indices[0] if len(indices) else 0
        for r in range(1, len(kv_lens)):
            if indptr[r + 1] - indptr[r] >= 2 and indptr[1] - indptr[0] >= 1:
                indices[indptr[r]] = first
    shape = (pool, 2, page_size, hkv, d) if layout == "NHD" else (pool, 2, hkv, page_size, d)
    x = rng.standard_normal(shape)
    x[:, 1] *= 2.0
    cache = quantize(x / np.array([ks, vs]).reshape((1, 2) + (1,) * (len(shape) - 2)), 1.0, NAME[fmt])
    assert not ((cache.view(torch.uint8) & FP8_BAD[fmt]) == FP8_BAD[fmt]).any(), "test data: finite codes only"
    q = torch.from_numpy(rng.standard_normal((len(kv_lens), hkv * group, d)).astype(np.float32)).to(QDT[qdt])
    return dict(q=q, cache=cache, indptr=indptr, indices=indices, last=last, ks=ks, vs=vs, layout=layout)


def golden(b, **kw):
    return R.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], kv_layout=b["layout"],
                                k_scale=b["ks"], v_scale=b["vs"], return_lse=True, dtype=np.float64, **kw)


def decode(b, **kw):
    return C.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], kv_layout=b["layout"],
                                k_scale=b["ks"], v_scale=b["vs"], return_lse=True, **kw)


def f64(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64).numpy()
    if hasattr(x, "copy_to_host"):
        x = x.copy_to_host()
    return np.asarray(x, np.float64)


def check(got, want, qdt, seed, what=""):
    o, lse = (f64(x) for x in got)
    wo, wl = (f64(x) for x in want)
    tol = TOL[qdt]
    np.testing.assert_allclose(o, wo, atol=tol, rtol=tol, err_msg=f"o {what} (seed={seed})")
    np.testing.assert_allclose(lse, wl, atol=2e-4, rtol=2e-5, err_msg=f"lse {what} (seed={seed})")


def config_of(b, **kw):
    return DEC.prepare_decode(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], kv_layout=b["layout"],
                              k_scale=b["ks"], v_scale=b["vs"], **kw).config()


# ---------------------------------------------------------------------------
# The device building blocks
# ---------------------------------------------------------------------------

def _unpack_kernel(fmt):
    un = fp8_unpack4(fmt)

    @cuda.jit
    def k(words, out):
        i = cuda.grid(1)
        if i < words.size // 4:
            un(words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3], out, 16 * i)
    return k


@pytest.mark.parametrize("fmt", list(FP8))
def test_every_fp8_code_converts_exactly(fmt):
    """All 256 codes at each of the four byte positions of a word (column p of the
    256 x 4 bytes is a fresh permutation), against torch's fp8 -> float32."""
    rng, seed = fresh()
    codes = np.stack([rng.permutation(256) for _ in range(4)], axis=1).astype(np.uint8)
    out = np.full(codes.size, -1.0, np.float32)
    _unpack_kernel(fmt)[2, 32](codes.reshape(-1).view(np.uint32), out)
    want = torch.from_numpy(codes.reshape(-1).copy()).view(FP8[fmt]).to(torch.float32).numpy()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan), f"NaN codes (seed={seed})"
    assert np.array_equal(out[~nan], want[~nan]), f"values (seed={seed})"
    assert np.array_equal(np.signbit(out[~nan]), np.signbit(want[~nan])), f"signs of zero (seed={seed})"
    assert nan.sum() == 4 * (2 if fmt == "e4m3" else 6) and np.isinf(want).sum() == 4 * (0 if fmt == "e4m3" else 2)


@pytest.mark.parametrize("fmt", list(FP8))
def test_the_nan_rule_sees_every_non_finite_byte(fmt):
    bad = NR.chunk_bad(fmt)

    @cuda.jit
    def k(words, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = 1 if bad(words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3]) else 0
    rng, seed = fresh()
    chunks = np.zeros((256, 16), np.uint8)
    finite = rng.integers(0, 256, (256, 16)).astype(np.uint8)
    vals = torch.from_numpy(finite.reshape(-1)).view(FP8[fmt]).float().numpy().reshape(256, 16)
    finite[~np.isfinite(vals)] = 0x01
    chunks[:] = finite
    for c in range(256):                                   # chunk c carries code c at a random place
        chunks[c, rng.integers(0, 16)] = c
    out = np.zeros(256, np.int32)
    k[8, 32](chunks.reshape(-1).view(np.uint32), out)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8[fmt]).float().numpy()
    assert np.array_equal(out == 1, ~np.isfinite(codes)), f"seed={seed}"


def test_which_fp8_caches_take_the_tensor_core_path(monkeypatch):
    """On a GPU of compute capability 8.9 or later, fp16 or bf16 q with head_dim 64 or 128
    and a group of at least ``tc_min_group`` takes the tensor-core path; fp32 q, head_dim
    96, an older GPU, sigmoid, RoPE or ``path="warp"`` keep the warp path."""
    var = Variant()
    monkeypatch.setattr(DCOM, "SIMULATOR", False)
    cc = [(9, 0)]
    monkeypatch.setattr(DCOM, "compute_capability", lambda: cc[0])
    assert DCOM.tc_eligible("f16", 128, True, var, "e4m3") and DCOM.tc_eligible("f16", 64, True, var, "e5m2")
    assert DCOM.tc_eligible("bf16", 128, True, var, "e4m3")
    assert not DCOM.tc_eligible("f32", 128, True, var, "e4m3")
    assert not DCOM.tc_eligible("f16", 96, True, var, "e4m3")
    assert not DCOM.tc_eligible("f16", 128, True, Variant(use_sigmoid=True), "e4m3")
    DCOM._configs.clear()
    try:
        for path, want in (("auto", "tc"), ("tc", "tc"), ("warp", "warp")):
            cfg = DCOM.make_config("f16", 128, 4, "NHD", var, True, 512, DECODE.replace(path=path), "e5m2")
            assert (cfg.path, cfg.kv_code) == (want, "e5m2"), path
        cfg = DCOM.make_config("f32", 128, 4, "NHD", var, True, 512, DECODE, "e5m2")
        assert (cfg.path, cfg.kv_code, cfg.heads_per_cta) == ("warp", "e5m2", 2)
        # a 16-byte load carries 16 fp8 values: 8 lanes a 128-dim row
        assert DCOM.warp_geometry(cfg.kv, 128, 2, 4, 2)[0] == 8
        rope = Variant(pos_encoding_mode="ROPE_LLAMA")
        assert DCOM.make_config("f16", 128, 4, "NHD", rope, True, 512, DECODE, "e4m3").path == "warp"
        cc[0] = (8, 0)                                     # no fp8 conversion instruction
        DCOM._configs.clear()
        assert DCOM.make_config("f16", 128, 4, "NHD", var, True, 512, DECODE, "e4m3").path == "warp"
    finally:
        DCOM._configs.clear()


# ---------------------------------------------------------------------------
# batch_decode_paged over fp8 caches
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt,qdt,layout,group,page_size", [
    ("e4m3", "f16", "NHD", 4, 4), ("e5m2", "bf16", "HND", 1, 3), ("e4m3", "bf16", "HND", 1, 5),
    ("e5m2", "f16", "NHD", 4, 1), ("e4m3", "f32", "NHD", 2, 4),
])
def test_decode_matches_the_golden_model(path, fmt, qdt, layout, group, page_size):
    rng, seed = fresh()
    kv_lens = [int(rng.integers(1, 12)), 0, int(rng.integers(1, 4)) * page_size, int(rng.integers(5, 18))]
    b = fp8_batch(rng, fmt, qdt, kv_lens, page_size=page_size, group=group, layout=layout, share=True,
                  ks=float(rng.uniform(0.02, 0.1)), vs=float(rng.uniform(0.005, 0.03)))
    tuning = DECODE.replace(path=path)
    cfg = config_of(b, tuning=tuning)
    assert (cfg.path, cfg.kv_code) == (path, fmt)
    o, lse = decode(b, tuning=tuning)
    assert o.dtype == QDT[qdt] and isinstance(o, torch.Tensor)
    check((o, lse), golden(b), qdt, seed, f"{fmt} {path}")
    assert (f64(o)[1] == 0).all() and np.isneginf(f64(lse)[1]).all(), f"the empty request (seed={seed})"


@pytest.mark.parametrize("path", PATHS)
def test_split_kv_equals_the_golden_model(path):
    """Chunks of one request (partial states with v_scale inside, then the merge)."""
    rng, seed = fresh()
    b = fp8_batch(rng, "e4m3", "f16", [23, 0, 9], page_size=4, group=4, hkv=1, ks=0.07, vs=0.02)
    p = DEC.prepare_decode(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], k_scale=b["ks"],
                           v_scale=b["vs"], return_lse=True, tuning=DECODE.replace(path=path))
    DEC.run_split(p, 8)
    check(DEC.finish_decode(p, True), golden(b), "f16", seed, f"split {path}")


@pytest.mark.parametrize("path", PATHS)
def test_variants_and_sigmoid(path):
    rng, seed = fresh()
    b = fp8_batch(rng, "e5m2", "f16", [11, 6], page_size=4, group=2, ks=0.08, vs=0.02)
    tuning = DECODE.replace(path=path)
    kw = dict(window_left=5, logits_soft_cap=4.0, pos_encoding_mode="ALIBI", sm_scale=0.3)
    check(decode(b, tuning=tuning, **kw), golden(b, **kw), "f16", seed, "variants")
    sig = dict(use_sigmoid=True, sigmoid_bias=-0.5)
    o = C.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], k_scale=b["ks"],
                             v_scale=b["vs"], tuning=tuning, **sig)
    want = R.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], k_scale=b["ks"],
                                v_scale=b["vs"], dtype=np.float64, **sig)
    np.testing.assert_allclose(f64(o), f64(want), atol=5e-3, rtol=5e-3, err_msg=f"sigmoid (seed={seed})")


def test_no_scale_is_a_scale_of_one():
    rng, seed = fresh()
    b = fp8_batch(rng, "e4m3", "f16", [7, 3], page_size=4, ks=1.0, vs=1.0)
    a = C.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], return_lse=True)
    c = decode(b)
    assert all(torch.equal(x, y) for x, y in zip(a, c)), f"seed={seed}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt,where", [("e4m3", "k"), ("e5m2", "k"), ("e4m3", "v"), ("e5m2", "v")])
def test_a_non_finite_fp8_code_poisons_the_rows_that_see_it(path, fmt, where):
    """The NaN rule: a NaN (e4m3fn 0x7F, e5m2 0x7E) or an infinity (e5m2 0x7C) in a visible
    key's K or V makes the row NaN; a key hidden by the window does not."""
    rng, seed = fresh()
    page_size, d = 4, 32
    b = fp8_batch(rng, fmt, "f16", [9, 9, 6], page_size=page_size, hkv=2, group=2, d=d)
    code = {"e4m3": 0x7F, "e5m2": int(rng.choice([0x7C, 0x7E, 0xFC]))}[fmt]
    raw = b["cache"].view(torch.uint8)
    for r, j in ((0, 8), (1, 0)):                        # request 0: its last key; request 1: its first
        page = b["indices"][b["indptr"][r] + j // page_size]
        raw[page, 0 if where == "k" else 1, j % page_size, 1, int(rng.integers(0, d))] = code
    kw = dict(window_left=4)                             # request 1's key 0 is hidden by the window
    o, lse = decode(b, tuning=DECODE.replace(path=path), **kw)
    wo, wl = golden(b, **kw)
    assert np.isnan(f64(o)[0, 2:]).all() and np.isnan(f64(lse)[0, 2:]).all(), f"seed={seed}"
    assert np.isfinite(f64(o)[:, :2]).all() and np.isfinite(f64(o)[1:]).all(), f"seed={seed}"
    check((o, lse), (wo, wl), "f16", seed, "poisoned")


# ---------------------------------------------------------------------------
# The wrapper: plan(kv_data_type=fp8), run(k_scale=, v_scale=), re-plans
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
def test_wrapper_runs_and_replans(path):
    rng, seed = fresh()
    tuning = DECODE.replace(path=path)
    w = C.BatchDecodeWithPagedKVCacheWrapper(cuda.device_array(8 << 20, np.uint8), "NHD", num_ctas=3)
    b = fp8_batch(rng, "e4m3", "bf16", [30, 0, 5, 12], page_size=4, group=4, hkv=1)
    w.plan(b["indptr"], b["indices"], b["last"], 4, 1, 32, 4, q_data_type=torch.bfloat16,
           kv_data_type=torch.float8_e4m3fn, chunk_limit=8, tuning=tuning)
    assert w.last_plan.num_partials > 0, "the plan splits a request"
    for ks, vs in ((b["ks"], b["vs"]), (0.2, 0.003)):       # new scales need no new plan
        o, lse = w.run(b["q"], b["cache"], k_scale=ks, v_scale=vs, return_lse=True)
        check((o, lse), golden(dict(b, ks=ks, vs=vs)), "bf16", seed, f"run ks={ks}")
    # a re-plan: other lengths, the other format, its name as a string
    b2 = fp8_batch(rng, "e5m2", "bf16", [3, 17, 1, 0], page_size=4, group=4, hkv=1)
    w.plan(b2["indptr"], b2["indices"], b2["last"], 4, 1, 32, 4, q_data_type="bfloat16",
           kv_data_type="float8_e5m2", tuning=tuning)
    check(w.run(b2["q"], b2["cache"], k_scale=b2["ks"], v_scale=b2["vs"], return_lse=True), golden(b2),
          "bf16", seed, "re-plan")
    with pytest.raises(ValueError, match=r"^paged_kv_cache: dtype float8_e4m3fn differs from plan"):
        w.run(b["q"], b["cache"], k_scale=0.1)
    with pytest.raises(ValueError, match=r"^k_scale: must be finite and > 0"):
        w.run(b2["q"], b2["cache"], k_scale=-1.0)
    # back to a plain plan: fp8 caches and scales are refused there
    plain = b2["cache"].to(torch.float32).to(torch.bfloat16)
    w.plan(b2["indptr"], b2["indices"], b2["last"], 4, 1, 32, 4, q_data_type=torch.bfloat16, tuning=tuning)
    want = R.batch_decode_paged(b2["q"], plain, b2["indptr"], b2["indices"], b2["last"], dtype=np.float64)
    np.testing.assert_allclose(f64(w.run(b2["q"], plain)), f64(want), atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match=r"^v_scale: only fp8 K/V"):
        w.run(b2["q"], plain, v_scale=2.0)
    with pytest.raises(ValueError, match=r"^paged_kv_cache: dtype float8_e5m2 differs from plan"):
        w.run(b2["q"], b2["cache"])


def test_one_decode_wrapper_class_reads_fp8():
    """fp8 is the decode wrapper's own (no subclass): the exported class is decode_wrapper's;
    an fp8 plan of it reads a torch CPU fp8 cache, and refuses the same bytes as a plain
    device array (fp8 data is a torch tensor)."""
    import importlib.util
    from nbattn.cuda import decode_wrapper as DW
    assert C.BatchDecodeWithPagedKVCacheWrapper is DW.BatchDecodeWithPagedKVCacheWrapper
    assert importlib.util.find_spec("nbattn.cuda.fp8_wrapper") is None
    rng, seed = fresh()
    b = fp8_batch(rng, "e5m2", "f16", [6, 11], page_size=4, group=2, hkv=2)
    w = DW.BatchDecodeWithPagedKVCacheWrapper(cuda.device_array(4 << 20, np.uint8), "NHD", num_ctas=2)
    w.plan(b["indptr"], b["indices"], b["last"], 4, 2, 32, 4, kv_data_type=torch.float8_e5m2)
    check(w.run(b["q"], b["cache"], k_scale=b["ks"], v_scale=b["vs"], return_lse=True), golden(b), "f16", seed,
          "host")
    dev_q = cuda.to_device(b["q"].view(torch.int16).numpy().view(np.float16))
    with pytest.raises(ValueError, match=r"^paged_kv_cache: must be a torch float8_e5m2 tensor"):
        w.run(dev_q, cuda.to_device(b["cache"].view(torch.uint8).numpy()), k_scale=b["ks"], v_scale=b["vs"])


def test_wrapper_plan_refuses_what_fp8_cannot_do():
    w = C.BatchDecodeWithPagedKVCacheWrapper(cuda.device_array(1 << 20, np.uint8), "NHD", num_ctas=2)
    args = (np.array([0, 1], np.int32), np.array([0], np.int32), np.array([3], np.int32), 4, 2)
    with pytest.raises(ValueError, match=r"^paged_kv_cache: an fp8 cache needs head_dim a multiple of 16"):
        w.plan(*args, 24, 4, kv_data_type=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"^q_data_type: fp8 queries are not supported"):
        w.plan(*args, 32, 4, q_data_type=torch.float8_e4m3fn, kv_data_type=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"^kv_data_type: fp8 dtype float8_e4m3fnuz is not supported"):
        w.plan(*args, 32, 4, kv_data_type="float8_e4m3fnuz")


# ---------------------------------------------------------------------------
# Append into an fp8 cache, then attend
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("adt", ["float32", "bfloat16", "numpy", "fp8"])
def test_append_writes_the_golden_bytes_then_decodes(fmt, layout, adt):
    rng, seed = fresh()
    ks, vs = float(rng.uniform(0.02, 0.2)), float(rng.uniform(0.005, 0.05))
    page_size, hkv, d = 4, 2, 16
    new = np.array([2, 3, 0, 5])
    lens = np.array([3, 0, 4, 6]) + new
    pkv = L.PagedKV.allocate(lens, page_size, num_pages=12, rng=rng)
    shape = (12, 2, page_size, hkv, d) if layout == "NHD" else (12, 2, hkv, page_size, d)
    ours = torch.from_numpy((rng.standard_normal(shape) * 20).astype(np.float32)).to(FP8[fmt])
    theirs = ours.clone()
    nnz = int(new.sum())
    key = rng.standard_normal((nnz, hkv, d)) * 10 * ks     # key / k_scale ~ N(0, 10)
    val = rng.standard_normal((nnz, hkv, d)) * 50 * vs
    key[0, 0, 0] = 1e6 * ks                                # beyond both maxima: saturates
    scales = dict(k_scale=ks, v_scale=vs)
    if adt == "numpy":
        ak, av = key.astype(np.float32), val.astype(np.float32)
    elif adt == "fp8":                                     # already quantized: copied as it is, no scales
        ak, av = (quantize(x, s, NAME[fmt]) for x, s in ((key, ks), (val, vs)))
        scales = {}
    else:
        ak, av = (torch.from_numpy(x).to(getattr(torch, adt)) for x in (key, val))
    bi, pos = L.get_batch_indices_positions(indptr_of(new), lens, nnz)
    meta = (pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len)
    R.append_paged_kv_cache(ak, av, bi, pos, theirs, *meta, kv_layout=layout, **scales)
    C.append_paged_kv_cache(ak, av, bi, pos, ours, *meta, kv_layout=layout, **scales)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), f"seed={seed}"
    q = torch.from_numpy(rng.standard_normal((4, hkv * 2, d)).astype(np.float32)).to(torch.float16)
    b = dict(q=q, cache=ours, indptr=meta[0], indices=meta[1], last=meta[2], ks=ks, vs=vs, layout=layout)
    check(decode(b), golden(b), "f16", seed, "after append")


def test_append_refuses_bad_scales_before_writing():
    rng, seed = fresh()
    pkv = L.PagedKV.allocate(np.array([2]), 4, num_pages=2, rng=rng)
    cache = torch.from_numpy(rng.standard_normal((2, 2, 4, 1, 16)).astype(np.float32)).to(torch.float8_e5m2)
    k = torch.randn(2, 1, 16)
    bi, pos = L.get_batch_indices_positions(indptr_of([2]), np.array([2]), 2)
    meta = (pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len)
    d = dict(cache=cache, k=k)
    for kw, arg, rule in ((dict(k_scale=0.0), "k_scale", "finite and > 0"),
                          (dict(v_scale=float("nan")), "v_scale", "finite and > 0")):
        assert_refused(lambda d: C.append_paged_kv_cache(d["k"], d["k"], bi, pos, d["cache"], *meta, **kw),
                       d, arg, rule, f"{kw} (seed={seed})")
    plain = np.zeros((2, 2, 4, 1, 16), np.float16)
    assert_refused(lambda d: C.append_paged_kv_cache(d["k"], d["k"], bi, pos, d["cache"], *meta, k_scale=2.0),
                   dict(cache=plain, k=k.numpy().astype(np.float16)), "k_scale", "only fp8 K/V", "plain cache")


# ---------------------------------------------------------------------------
# Bad input: the golden model's rules and messages, before any kernel
# ---------------------------------------------------------------------------

def _bad_decode_cases(b):
    q, cache = b["q"], b["cache"]
    half = cache.to(torch.float32).to(torch.float16)
    return {
        "k_scale zero": (q, cache, dict(k_scale=0.0), "k_scale", "finite and > 0"),
        "v_scale inf": (q, cache, dict(v_scale=float("inf")), "v_scale", "finite and > 0"),
        "k_scale negative": (q, cache, dict(k_scale=-0.5), "k_scale", "finite and > 0"),
        "scale tensor of two": (q, cache, dict(v_scale=torch.ones(2)), "v_scale", "must be a float"),
        "scale on fp16": (q, half, dict(k_scale=0.5), "k_scale", "only fp8 K/V"),
        "fp8 q": (q.to(torch.float32).to(torch.float8_e4m3fn), cache, {}, "q", "fp8 queries are not supported"),
        "fnuz": (q, cache.to(torch.float32).to(torch.float8_e4m3fnuz), {}, "paged_kv_cache", "not supported"),
    }


@pytest.mark.parametrize("case", ["k_scale zero", "v_scale inf", "k_scale negative", "scale tensor of two",
                                  "scale on fp16", "fp8 q", "fnuz"])
def test_bad_input_is_refused_like_the_golden_model(case, monkeypatch):
    rng, seed = fresh()
    b = fp8_batch(rng, "e4m3", "f16", [5, 3], page_size=4)
    q, cache, kw, arg, rule = _bad_decode_cases(b)[case]
    launched = []
    monkeypatch.setattr(DP, "decode_kernel", lambda cfg: launched.append(cfg))
    out = torch.full(tuple(q.shape), 7.0, dtype=torch.float16)
    meta = (b["indptr"], b["indices"], b["last"])
    d = dict(q=q, cache=cache, out=out)
    assert_refused(lambda d: C.batch_decode_paged(d["q"], d["cache"], *meta, out=d["out"], **kw), d, arg, rule,
                   f"{case} (seed={seed})")
    with pytest.raises(ValueError) as golden_error:
        R.batch_decode_paged(q, cache, *meta, **kw)
    with pytest.raises(ValueError) as kernel_error:
        C.batch_decode_paged(q, cache, *meta, **kw)
    assert str(kernel_error.value) == str(golden_error.value), "the golden model's message"
    assert not launched


def test_fp8_head_dim_must_be_a_multiple_of_16():
    rng, seed = fresh()
    b = fp8_batch(rng, "e5m2", "f16", [5], page_size=4, d=24)
    assert_refused(lambda d: decode(dict(b, **d)), dict(cache=b["cache"], q=b["q"]), "paged_kv_cache",
                   "head_dim a multiple of 16", f"seed={seed}")


def _others(q, k, v, cache):
    kvi = np.array([0, 3, 5], np.int32)
    return {
        "block_sparse": (lambda: C.block_sparse(q, k, v, None), "k"),
        "split_kv": (lambda: C.split_kv(q, k, v, kvi), "k"),
        "cascade": (lambda: C.cascade(q, [], cache), "paged_kv_cache"),
        "single_prefill k_scale": (lambda: C.single_prefill(q, k.half(), v.half(), k_scale=2.0), "k_scale"),
    }


@pytest.mark.parametrize("name", list(_others(*[None] * 4)))
def test_the_forms_that_do_not_read_fp8_refuse_it(name, monkeypatch):
    rng, _ = fresh()
    q = torch.from_numpy(rng.standard_normal((2, 4, 16)).astype(np.float32)).half()
    k, v = (torch.from_numpy(rng.standard_normal((5, 2, 16)).astype(np.float32)).to(torch.float8_e4m3fn)
            for _ in range(2))
    cache = torch.from_numpy(rng.standard_normal((3, 2, 4, 2, 16)).astype(np.float32)).to(torch.float8_e5m2)
    before = [bytes_of(x) for x in (q, k, v, cache)]
    call, arg = _others(q, k, v, cache)[name]
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value).startswith(f"{arg}:") and ("fp8" in str(e.value)), str(e.value)
    assert [bytes_of(x) for x in (q, k, v, cache)] == before


# ---------------------------------------------------------------------------
# Realistic shapes on a GPU (the fast path, torch CUDA tensors, the wrapper)
# ---------------------------------------------------------------------------

def _gpu_batch(seed, fmt, batch, kv_len, group=4, hkv=2, page_size=16, d=128):
    rng = np.random.default_rng(seed)
    lens = [kv_len] * batch
    lens[0], lens[-1] = 0, kv_len - 5                        # an empty request, a non-full last page
    b = fp8_batch(rng, fmt, "f16", lens, page_size=page_size, hkv=hkv, group=group, d=d, share=True)
    g = golden(b)
    dev = dict(b, q=b["q"].cuda(), cache=b["cache"].cuda())
    return b, dev, g


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a real GPU")
@pytest.mark.parametrize("path", ["tc", "warp"])
@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("batch,kv_len", [(64, 4096), (1, 32768)])
def test_gpu_decode_realistic_shapes(path, fmt, batch, kv_len):
    b, dev, want = _gpu_batch([71, batch, kv_len], fmt, batch, kv_len)
    tuning = DECODE.replace(path=path)
    assert config_of(dev, tuning=tuning).path == path
    assert config_of(dev).path == "tc"                       # the default for fp16 q, group 4
    got = decode(dev, tuning=tuning)                         # torch CUDA in: the launch layer
    torch.cuda.synchronize()
    check(got, want, "f16", "fixed", f"{fmt} {path} b{batch} x {kv_len}")
    host = decode(b, tuning=tuning)                          # host in: the general path
    check(host, want, "f16", "fixed", f"{fmt} {path} host")


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a real GPU")
def test_gpu_fp16_conversion_of_every_code():
    """The tensor-core path's converters (``cvt.rn.f16x2.{e4m3,e5m2}x2``, then on to bf16)
    on all 256 codes at each byte position of a word, against torch's fp8 -> float16 / bfloat16."""
    from nbattn.cuda.blocks.mma import fp8x4_to_16x2
    rng, seed = fresh()
    for fmt, to in ((f, t) for f in FP8 for t in ("f16", "bf16")):
        conv = fp8x4_to_16x2(fmt, to)

        @cuda.jit
        def k(words, out):
            i = cuda.grid(1)
            if i < words.size:
                lo, hi = conv(words[i])
                out[2 * i] = lo
                out[2 * i + 1] = hi

        codes = np.stack([rng.permutation(256) for _ in range(4)], axis=1).astype(np.uint8)
        out = np.zeros(2 * 256, np.uint32)
        k[8, 32](codes.reshape(-1).view(np.uint32), out)
        tdt = torch.float16 if to == "f16" else torch.bfloat16
        got = torch.from_numpy(out.view(np.int16).copy()).view(tdt).float().numpy()
        want = torch.from_numpy(codes.reshape(-1).copy()).view(FP8[fmt]).to(tdt).float().numpy()
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan), f"{fmt} -> {to} NaN codes (seed={seed})"
        assert np.array_equal(got[~nan], want[~nan]), f"{fmt} -> {to} values (seed={seed})"
        assert np.array_equal(np.signbit(got[~nan]), np.signbit(want[~nan])), f"{fmt} -> {to} signs (seed={seed})"


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a real GPU")
@pytest.mark.parametrize("fmt,qdt,group,layout,d,kw", [
    ("e4m3", "f16", 4, "NHD", 128, {}),
    ("e5m2", "f16", 8, "HND", 128, dict(logits_soft_cap=30.0)),
    ("e4m3", "bf16", 4, "HND", 64, dict(window_left=40, pos_encoding_mode="ALIBI")),
    ("e5m2", "bf16", 4, "NHD", 128, dict(sm_scale=0.2)),
    ("e4m3", "bf16", 8, "NHD", 128, {}),
])
def test_gpu_tensor_core_path(fmt, qdt, group, layout, d, kw):
    """fp8 on the tensor-core path against the golden model: both formats, fp16 and bf16 q, groups 4 and 8,
    both layouts, head_dim 64 and 128, variants, shared pages, an empty request, last pages
    not full, split requests (the plain call splits the long one), and a bad code (NaN, or
    an e5m2 infinity) in a visible key's K of request 1 and in V of request 2: those rows
    come out NaN, the others finite."""
    rng, seed = fresh()
    page_size = 16
    lens = [int(x) for x in rng.integers(1, 700, 7)] + [0, 9000]
    b = fp8_batch(rng, fmt, qdt, lens, page_size=page_size, hkv=2, group=group, d=d, layout=layout,
                  share=True, ks=float(rng.uniform(0.02, 0.1)), vs=float(rng.uniform(0.005, 0.03)))
    raw = b["cache"].view(torch.uint8)
    code = {"e4m3": 0x7F, "e5m2": int(rng.choice([0x7C, 0x7E, 0xFC]))}[fmt]
    for r, kv in ((1, 0), (2, 1)):                           # the request's last key: visible to every variant
        j = lens[r] - 1
        page = b["indices"][b["indptr"][r] + j // page_size]
        at = (page, kv, j % page_size, 1, int(rng.integers(0, d))) if layout == "NHD" else \
             (page, kv, 1, j % page_size, int(rng.integers(0, d)))
        raw[at] = code
    dev = dict(b, q=b["q"].cuda(), cache=b["cache"].cuda())
    assert config_of(dev, **kw).path == "tc"
    want = golden(b, **kw)
    got = decode(dev, **kw)
    torch.cuda.synchronize()
    o = f64(got[0])
    assert np.isnan(o[1:3, group:]).all() and np.isfinite(o[1:3, :group]).all(), f"poisoned rows (seed={seed})"
    check(got, want, qdt, seed, f"tc {fmt} {qdt} g{group} {layout} d{d} {kw}")


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a real GPU")
@pytest.mark.parametrize("fmt", list(FP8))
def test_gpu_wrapper_realistic_shapes(fmt):
    b, dev, want = _gpu_batch([72], fmt, 64, 4096)
    # plan() with the batch's own shape (it had 32 / 8 heads for a batch of 8 / 2: refused by run())
    hq, hkv, page_size, d = b["q"].shape[1], b["cache"].shape[3], b["cache"].shape[2], b["cache"].shape[4]
    assert (hq, hkv, page_size, d) == (8, 2, 16, 128)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = C.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(torch.from_numpy(b["indptr"]), torch.from_numpy(b["indices"]), torch.from_numpy(b["last"]), hq, hkv,
           d, page_size, q_data_type=torch.float16, kv_data_type=FP8[fmt])
    got = w.run(dev["q"], dev["cache"], k_scale=b["ks"], v_scale=b["vs"], return_lse=True)
    torch.cuda.synchronize()
    check(got, want, "f16", "fixed", f"wrapper {fmt}")


@pytest.mark.parametrize("path", PATHS)
def test_rope_turns_the_dequantized_keys(path):
    """RoPE at attention time over an fp8 cache: each key is dequantized, then turned (16 fp8
    values a lane on the warp path, so the partner chunk is NX/2 = 1 lane away at head_dim 32)."""
    rng, seed = fresh()
    b = fp8_batch(rng, "e4m3", "f16", [13, 0, 30], page_size=4, group=2, ks=0.07, vs=0.03)
    tuning = DECODE.replace(path=path)
    kw = dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=60.0, rope_scale=1.5)
    assert config_of(b, tuning=tuning, **kw).path == path
    check(decode(b, tuning=tuning, **kw), golden(b, **kw), "f16", seed, f"rope {path}")
