"""fp8 K/V on the prefill forms (``batch_prefill_paged``, ``batch_prefill_ragged``,
``single_prefill``, and ``single_decode``, a one-row prefill): the pages a call
reads are widened to q's dtype with the scales applied
(:mod:`nbattn.cuda.kernels.fp8_widen`), then the 16-bit tiles run.

The widening kernel is checked on all 256 codes of both formats against torch's
own conversion; every prefill result against the golden model in float64 over the
same fp8 bytes, with fresh random inputs (the seed is in each message): both
formats, q in float16 / bfloat16 / float32, both layouts, GQA, causal, last pages
not full, a page shared by several requests, an empty request, and a NaN code in a
visible key.  Tests marked ``gpu`` run the tensor-core tiles on realistic shapes.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import nbattn  # noqa: F401  (compat first: the simulator is chosen before numba.cuda loads)
import nbattn.cuda as C
from nbattn import reference as R
from nbattn.cuda import fp8 as F
from nbattn.cuda.blocks.primitives import SIMULATOR
from nbattn.cuda.kernels import fp8_widen as W

from brute import assert_refused, fresh, indptr_of
from test_cuda_fp8 import FP8, FP8_BAD, QDT, TOL, f64, fp8_batch

GPU = pytest.mark.skipif(SIMULATOR, reason="needs a real GPU")


def prefill_inputs(rng, fmt, qdt, qo_lens, kv_lens, **kw):
    """A paged fp8 batch (``fp8_batch``) with ``qo_lens`` query rows a request."""
    b = fp8_batch(rng, fmt, qdt, kv_lens, **kw)
    hq, d = b["q"].shape[1:]
    q = rng.standard_normal((sum(qo_lens), hq, d)).astype(np.float32)
    return dict(b, q=torch.from_numpy(q).to(QDT[qdt]), qo_indptr=indptr_of(qo_lens))


def paged_args(b):
    return (b["q"], b["cache"], b["qo_indptr"], b["indptr"], b["indices"], b["last"])


#: LSE tolerance: K is rounded once to q's dtype after its scale (2^-11 relative for
#: float16, 2^-8 for bfloat16), so a score of size ~5 moves by up to ~5 * that
LSE_TOL = {"f16": 5e-3, "bf16": 3e-2, "f32": 1e-4}


def check(got, want, qdt, what):
    o, lse = (f64(x) for x in got)
    wo, wl = (f64(x) for x in want)
    assert np.array_equal(np.isnan(o), np.isnan(wo)), f"NaN rows ({what})"
    fin = np.isfinite(wo)
    np.testing.assert_allclose(o[fin], wo[fin], atol=TOL[qdt], rtol=TOL[qdt], err_msg=f"o ({what})")
    assert np.array_equal(np.isnan(lse), np.isnan(wl)), f"NaN LSEs ({what})"
    np.testing.assert_allclose(lse, wl, atol=LSE_TOL[qdt], rtol=0, err_msg=f"lse ({what})")


# ---------------------------------------------------------------------------
# The widening kernel
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("qdt", list(QDT))
def test_widening_is_torch_conversion_times_the_scale(fmt, qdt):
    """Every code in two pages (gathered in a shuffled order, K half and V half with
    their own scales) against torch: ``(x.float() * scale).to(q's dtype)``."""
    rng, seed = fresh()
    codes = np.concatenate([rng.permutation(256) for _ in range(4)]).astype(np.uint8)   # a page: each code once
    cache = torch.from_numpy(codes).view(FP8[fmt]).reshape(4, 2, 4, 2, 16)     # pages of 2 x 4 x 2 x 16 values
    pages = np.array([3, 0, 3], np.int32)
    ks, vs = (float(np.float32(rng.uniform(0.01, 1.0))) for _ in range(2))
    got = F.widen(cache, "paged_kv_cache", fmt, qdt, ks, vs, 0, False, pages=pages).copy_to_host()
    want = cache[torch.from_numpy(pages).long()].float()
    want[:, 0] *= np.float32(ks)
    want[:, 1] *= np.float32(vs)
    want = want.to(QDT[qdt])
    nan = want.isnan().numpy()
    want = want.view(torch.int16).numpy() if qdt != "f32" else want.numpy()
    got_nan = (torch.from_numpy(got.view(np.int16)).view(QDT[qdt]) if qdt != "f32" else torch.from_numpy(got)).isnan()
    assert got.shape == want.shape
    assert nan.sum() == 3 * (2 if fmt == "e4m3" else 6), f"test data (seed={seed})"
    assert np.array_equal(got_nan.numpy(), nan), f"NaN codes (seed={seed})"
    assert np.array_equal(got.view(want.dtype)[~nan], want[~nan]), f"values (seed={seed})"


# ---------------------------------------------------------------------------
# The prefill forms against the golden model
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,qdt,layout,group,page_size,causal", [
    ("e4m3", "f16", "NHD", 2, 4, True), ("e5m2", "bf16", "HND", 1, 3, False),
    ("e4m3", "bf16", "NHD", 2, 5, False), ("e5m2", "f16", "HND", 2, 1, True), ("e4m3", "f32", "NHD", 1, 4, True),
])
def test_paged_prefill_matches_the_golden_model(fmt, qdt, layout, group, page_size, causal):
    rng, seed = fresh()
    kv_lens = [int(rng.integers(3, 11)), 0, int(rng.integers(2, 4)) * page_size, int(rng.integers(1, 9))]
    qo_lens = [int(rng.integers(1, min(n, 4) + 1)) if n else 0 for n in kv_lens]
    b = prefill_inputs(rng, fmt, qdt, qo_lens, kv_lens, page_size=page_size, group=group, layout=layout,
                       share=True, ks=float(rng.uniform(0.02, 0.1)), vs=float(rng.uniform(0.005, 0.03)))
    kw = dict(kv_layout=layout, k_scale=b["ks"], v_scale=b["vs"], return_lse=True, causal=causal)
    got = C.batch_prefill_paged(*paged_args(b), **kw)
    want = R.batch_prefill_paged(*paged_args(b), dtype=np.float64, **kw)
    check(got, want, qdt, f"{fmt} {qdt} {layout} seed={seed}")


@pytest.mark.parametrize("fmt,qdt", [("e4m3", "f16"), ("e5m2", "bf16")])
def test_ragged_single_prefill_and_single_decode_match_the_golden_model(fmt, qdt):
    rng, seed = fresh()
    qo_lens, kv_lens = [3, 1, 4], [7, 5, 4]
    n = sum(kv_lens)
    k, v = (torch.from_numpy(rng.standard_normal((n, 2, 16)).astype(np.float32) * 8).to(FP8[fmt])
            for _ in range(2))
    q = torch.from_numpy(rng.standard_normal((sum(qo_lens), 4, 16)).astype(np.float32)).to(QDT[qdt])
    ks, vs = float(rng.uniform(0.02, 0.2)), float(rng.uniform(0.02, 0.2))
    kw = dict(k_scale=ks, v_scale=vs, return_lse=True, causal=True, logits_soft_cap=4.0)
    args = (q, k, v, indptr_of(qo_lens), indptr_of(kv_lens))
    check(C.batch_prefill_ragged(*args, **kw), R.batch_prefill_ragged(*args, dtype=np.float64, **kw), qdt,
          f"ragged seed={seed}")
    one = (q[:3], k[:7], v[:7])
    check(C.single_prefill(*one, **kw), R.single_prefill(*one, dtype=np.float64, **kw), qdt, f"single seed={seed}")
    kw.pop("causal")
    dec = (q[5], k[7:12], v[7:12])
    check(C.single_decode(*dec, **kw), R.single_decode(*dec, dtype=np.float64, **kw), qdt, f"decode seed={seed}")


@pytest.mark.parametrize("fmt", list(FP8))
def test_a_nan_code_in_a_visible_key_poisons_the_rows_that_see_it(fmt):
    rng, seed = fresh()
    qo_lens, kv_lens = [3, 2], [6, 5]
    b = prefill_inputs(rng, fmt, "f16", qo_lens, kv_lens, page_size=4)
    raw = b["cache"].view(torch.uint8)
    raw[b["indices"][0], 0, 1, 0, 3] = FP8_BAD[fmt] | 0x03          # request 0, key 1, head 0: a NaN
    kw = dict(k_scale=b["ks"], v_scale=b["vs"], return_lse=True, causal=True)
    got = C.batch_prefill_paged(*paged_args(b), **kw)
    want = R.batch_prefill_paged(*paged_args(b), dtype=np.float64, **kw)
    assert np.isnan(f64(want[0])).any(), "the golden model sees the NaN"
    check(got, want, "f16", f"seed={seed}")


def test_a_scale_that_would_overflow_the_widened_dtype_is_refused_before_any_kernel(monkeypatch):
    rng, seed = fresh()
    b = prefill_inputs(rng, "e5m2", "f16", [2], [5], page_size=4)
    launched = []
    monkeypatch.setattr(W, "widen_kernel", lambda *a: launched.append(a))
    out = torch.full(tuple(b["q"].shape), 7.0, dtype=torch.float16)
    d = dict(q=b["q"], cache=b["cache"], out=out)
    call = (lambda d: C.batch_prefill_paged(d["q"], d["cache"], *paged_args(b)[2:], out=d["out"], k_scale=2.0))
    assert_refused(call, d, "k_scale", "exceeds its largest value", f"seed={seed}")
    assert not launched
    monkeypatch.undo()
    bf = dict(b, q=b["q"].to(torch.bfloat16))                          # bf16 q holds it
    kw = dict(k_scale=2.0, v_scale=b["vs"], return_lse=True)
    check(C.batch_prefill_paged(*paged_args(bf), **kw), R.batch_prefill_paged(*paged_args(bf), dtype=np.float64,
                                                                             **kw), "bf16", f"seed={seed}")


@pytest.mark.parametrize("case", ["scale on fp16", "k fp8, v fp16", "e4m3 k, e5m2 v", "fp8 q"])
def test_bad_fp8_input_is_refused_with_the_golden_models_message(case):
    rng, _ = fresh()
    q = torch.from_numpy(rng.standard_normal((3, 4, 16)).astype(np.float32)).half()
    k32 = torch.from_numpy(rng.standard_normal((5, 2, 16)).astype(np.float32))
    k8, v8 = k32.to(torch.float8_e4m3fn), k32.to(torch.float8_e4m3fn)
    q_, k, v, kw = {"scale on fp16": (q, k32.half(), k32.half(), dict(v_scale=0.5)),
                    "k fp8, v fp16": (q, k8, k32.half(), {}),
                    "e4m3 k, e5m2 v": (q, k8, k32.to(torch.float8_e5m2), {}),
                    "fp8 q": (q.float().to(torch.float8_e4m3fn), k8, v8, {})}[case]
    with pytest.raises(ValueError) as golden:
        R.single_prefill(q_, k, v, **kw)
    d = dict(q=q_, k=k, v=v)
    arg = str(golden.value).split(":")[0]
    assert_refused(lambda d: C.single_prefill(d["q"], d["k"], d["v"], **kw), d, arg, str(golden.value), case)


def workspace(nbytes=8 << 20):
    return np.zeros(nbytes, np.uint8) if SIMULATOR else torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def wrapper_plan(w, b, hk, d, page_size, **kw):
    hq = b["q"].shape[1]
    w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], hq, hk, d, page_size,
           q_data_type=b["q"].dtype, kv_data_type=b["cache"].dtype, **kw)


@pytest.mark.parametrize("fmt,qdt,layout", [("e4m3", "f16", "NHD"), ("e5m2", "bf16", "HND"),
                                            ("e4m3", "f32", "HND")])
def test_the_prefill_wrapper_reads_fp8_and_replans(fmt, qdt, layout):
    """An fp8 plan split into partial states (the merge runs), new scales with no new
    plan, a re-plan with more pages (the scratch grows) and one with fewer (it is
    reused), learnable sinks, then a plain plan: every result against the golden model."""
    rng, seed = fresh()
    # 4 CTAs: at most 3 + 3 + 2 chunks of 4 keys, within the bound of 2 partials a CTA
    w = C.BatchPrefillWithPagedKVCacheWrapper(workspace(), layout, num_ctas=4)
    kv_lens = [int(rng.integers(5, 12)), 0, int(rng.integers(2, 4)) * 4, int(rng.integers(1, 7))]
    qo_lens = [int(rng.integers(1, min(n, 4) + 1)) if n else 0 for n in kv_lens]
    b = prefill_inputs(rng, fmt, qdt, qo_lens, kv_lens, page_size=4, group=2, layout=layout, share=True)
    wrapper_plan(w, b, 2, 32, 4, causal=True, chunk_limit=4)
    assert w.last_plan.num_partials > 0, "the plan splits a tile"
    for ks, vs in ((b["ks"], b["vs"]), (0.03, 0.02)):
        kw = dict(kv_layout=layout, k_scale=ks, v_scale=vs, return_lse=True, causal=True)
        want = R.batch_prefill_paged(*paged_args(b), dtype=np.float64, **kw)
        check(w.run(b["q"], b["cache"], k_scale=ks, v_scale=vs, return_lse=True), want, qdt,
              f"{fmt} {layout} ks={ks} seed={seed}")
    for lens in ([20, 13, 1], [2, 3]):          # more pages than before, then fewer
        b2 = prefill_inputs(rng, fmt, qdt, [min(n, 3) for n in lens], lens, page_size=4, group=2, layout=layout)
        wrapper_plan(w, b2, 2, 32, 4)
        kw = dict(kv_layout=layout, k_scale=b2["ks"], v_scale=b2["vs"], return_lse=True)
        want = R.batch_prefill_paged(*paged_args(b2), dtype=np.float64, **kw)
        check(w.run(b2["q"], b2["cache"], k_scale=b2["ks"], v_scale=b2["vs"], return_lse=True), want, qdt,
              f"re-plan {lens} seed={seed}")
    sinks = torch.from_numpy(rng.standard_normal(4).astype(np.float32))
    want = R.batch_prefill_paged(*paged_args(b2), dtype=np.float64, sinks=sinks.numpy(), **kw)
    check(w.run(b2["q"], b2["cache"], k_scale=b2["ks"], v_scale=b2["vs"], return_lse=True, sinks=sinks), want,
          qdt, f"sinks seed={seed}")
    plain = b2["cache"].to(torch.float32)          # the same values with their scales, in q's dtype
    plain[:, 0] *= b2["ks"]
    plain[:, 1] *= b2["vs"]
    plain = plain.to(QDT[qdt])
    w.plan(b2["qo_indptr"], b2["indptr"], b2["indices"], b2["last"], 4, 2, 32, 4, q_data_type=b2["q"].dtype)
    want = R.batch_prefill_paged(b2["q"], plain, *paged_args(b2)[2:], kv_layout=layout, dtype=np.float64)
    np.testing.assert_allclose(f64(w.run(b2["q"], plain)), f64(want), atol=TOL[qdt], rtol=TOL[qdt])
    with pytest.raises(ValueError, match=r"^k_scale: only fp8 K/V"):
        w.run(b2["q"], plain, k_scale=2.0)
    with pytest.raises(ValueError, match=r"^paged_kv_cache: dtype float8_e\w+ differs from plan"):
        w.run(b2["q"], b2["cache"])


def test_the_prefill_wrapper_refuses_before_widening(monkeypatch):
    """A scale that would overflow q's dtype, a cache of the other fp8 format or of q's
    dtype, and a bad ``kv_data_type``: refused naming the argument, before any kernel,
    with the output untouched."""
    rng, seed = fresh()
    b = prefill_inputs(rng, "e5m2", "f16", [2, 1], [5, 3], page_size=4)
    w = C.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD", num_ctas=2)
    wrapper_plan(w, b, 2, 32, 4)
    launched = []
    monkeypatch.setattr(F, "widen_kernel", lambda *a: launched.append(a))
    out = torch.full(tuple(b["q"].shape), 7.0, dtype=torch.float16)
    other = b["cache"].view(torch.uint8).view(torch.float8_e4m3fn)
    for arg, rule, cache, kw in (("k_scale", "exceeds its largest value", b["cache"], dict(k_scale=2.0)),
                                 ("v_scale", "must be finite and > 0", b["cache"], dict(v_scale=float("nan"))),
                                 ("paged_kv_cache", "differs from plan()'s kv_data_type", other, {}),
                                 ("paged_kv_cache", "must be a torch float8_e5m2 tensor",
                                  b["cache"].to(torch.float16), {})):
        d = dict(q=b["q"], cache=cache, out=out)
        assert_refused(lambda d: w.run(d["q"], d["cache"], out=d["out"], **kw), d, arg, rule,  # noqa: B023
                       f"{arg} seed={seed}")
    assert not launched
    with pytest.raises(ValueError, match=r"^kv_data_type: fp8 dtype float8_e4m3fnuz is not supported"):
        w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], 4, 2, 32, 4, kv_data_type="float8_e4m3fnuz")
    with pytest.raises(ValueError, match=r"^q_data_type: fp8 queries are not supported"):
        w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], 4, 2, 32, 4,
               q_data_type=torch.float8_e4m3fn, kv_data_type=torch.float8_e4m3fn)


@pytest.mark.parametrize("head_dim", [2, 6])
def test_a_page_whose_k_half_ends_inside_a_word(head_dim):
    """One KV head, page size 1, head_dim 2 or 6: a page's K half ends in the middle of a
    32-bit word of four fp8 values, so the word's first values take k_scale and the rest
    v_scale (the plain call and the wrapper)."""
    rng, seed = fresh()
    b = prefill_inputs(rng, "e4m3", "f16", [2, 1], [3, 2], page_size=1, hkv=1, group=1, d=head_dim,
                       ks=0.3, vs=0.02)
    kw = dict(k_scale=b["ks"], v_scale=b["vs"], return_lse=True)
    want = R.batch_prefill_paged(*paged_args(b), dtype=np.float64, **kw)
    check(C.batch_prefill_paged(*paged_args(b), **kw), want, "f16", f"plain seed={seed}")
    w = C.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD", num_ctas=2)
    wrapper_plan(w, b, 1, head_dim, 1)
    check(w.run(b["q"], b["cache"], k_scale=b["ks"], v_scale=b["vs"], return_lse=True), want, "f16",
          f"wrapper seed={seed}")


# ---------------------------------------------------------------------------
# Realistic shapes on a GPU: the tensor-core tiles, torch CUDA tensors
# ---------------------------------------------------------------------------

@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("fmt,qdt", [("e4m3", "f16"), ("e5m2", "bf16"), ("e4m3", "bf16")])
def test_gpu_paged_prefill_realistic_shapes(fmt, qdt):
    rng, seed = fresh()
    kv_lens, qo_lens = [1000, 0, 777, 2048], [300, 0, 1, 512]
    b = prefill_inputs(rng, fmt, qdt, qo_lens, kv_lens, page_size=16, hkv=2, group=4, d=128, share=True)
    kw = dict(k_scale=b["ks"], v_scale=b["vs"], return_lse=True, causal=True)
    want = R.batch_prefill_paged(*paged_args(b), dtype=np.float64, **kw)
    dev = dict(b, q=b["q"].cuda(), cache=b["cache"].cuda())
    check(C.batch_prefill_paged(*paged_args(dev), **kw), want, qdt, f"{fmt} {qdt} seed={seed}")
    k = b["cache"][torch.from_numpy(b["indices"][:63]).long(), 0].reshape(-1, 2, 128).cuda()
    v = b["cache"][torch.from_numpy(b["indices"][:63]).long(), 1].reshape(-1, 2, 128).cuda()
    one = (dev["q"][:300], k[:1000], v[:1000])
    check(C.single_prefill(*one, **kw), R.single_prefill(*(x.cpu() for x in one), dtype=np.float64, **kw), qdt,
          f"single {fmt} {qdt} seed={seed}")


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("fmt,qdt", [("e4m3", "f16"), ("e5m2", "bf16")])
def test_gpu_prefill_wrapper_realistic_shapes(fmt, qdt):
    """The prefill wrapper's fp8 plan on the tensor-core tiles, torch CUDA tensors, a
    split plan, two scales, then a CUDA graph captured on the plan and replayed with new q."""
    rng, seed = fresh()
    kv_lens, qo_lens = [1000, 0, 777, 2048], [300, 0, 1, 512]
    b = prefill_inputs(rng, fmt, qdt, qo_lens, kv_lens, page_size=16, hkv=2, group=4, d=128, share=True)
    dev = dict(b, q=b["q"].cuda(), cache=b["cache"].cuda())
    w = C.BatchPrefillWithPagedKVCacheWrapper(workspace(64 << 20), "NHD")
    wrapper_plan(w, dev, 2, 128, 16, causal=True)
    for ks, vs in ((b["ks"], b["vs"]), (0.03, 0.02)):
        kw = dict(k_scale=ks, v_scale=vs, return_lse=True, causal=True)
        want = R.batch_prefill_paged(*paged_args(b), dtype=np.float64, **kw)
        check(w.run(dev["q"], dev["cache"], k_scale=ks, v_scale=vs, return_lse=True), want, qdt,
              f"{fmt} {qdt} ks={ks} seed={seed}")
    out = torch.empty_like(dev["q"])
    lse = torch.empty(dev["q"].shape[:2], device="cuda")
    w.run(dev["q"], dev["cache"], k_scale=0.03, v_scale=0.02, out=out, lse=lse)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(dev["q"], dev["cache"], k_scale=0.03, v_scale=0.02, out=out, lse=lse)
    q2 = torch.from_numpy(rng.standard_normal(tuple(b["q"].shape)).astype(np.float32)).to(QDT[qdt])
    dev["q"].copy_(q2.cuda())
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    want = R.batch_prefill_paged(q2, *paged_args(b)[1:], dtype=np.float64, k_scale=0.03, v_scale=0.02,
                                 return_lse=True, causal=True)
    check((out, lse), want, qdt, f"graph replay seed={seed}")
