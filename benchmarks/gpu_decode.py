"""One GPU session for issue 3 (nbattn.cuda decode): correctness at real sizes,
compute-sanitizer, bandwidth benchmark with peers, compile time and disk cache.

    PYTHONPATH=$PWD python3 benchmarks/gpu_decode.py          # writes OUT/decode.json,
                                                             # OUT/decode_correctness.json
    ... gpu_decode.py correct    # only (a), then exit
    ... gpu_decode.py bench      # only (c); reads (a)'s file for the compile time if present
    ... gpu_decode.py extras     # only (b) and the on-disk cache check, OUT/decode_extras.json
    options: --out DIR (default $OUT), --quick (skip the sanitizer and the second process),
             --budget-s S (time budget, 390), --path P (the decode path the bench and the
             sanitizer's child processes pin: auto | warp | smem | tc), --sweep (the warp
             path's unroll and heads-per-CTA sweeps)

Paths: the default decode path on a GPU is chosen by nbattn.cuda.kernels.decode_common.make_config
(the tensor-core kernel for groups >= 4, else the warp kernel); every bandwidth record also times
the shared-memory kernel (peer "nbattn_smem") in the same run, and a few cases sweep the warp
path's unroll.  Paths and sweeps are nbattn.cuda.tuning.DecodeTuning values passed as ``tuning=``.

(a) correctness vs the golden model (nbattn.reference) on fresh random inputs:
    batch up to 256, KV up to 32k with non-full last pages, page sizes 1/16/64,
    groups 1/4/8, head_dim 64/128/256, fp16/bf16/fp32, NHD/HND, variants,
    empty requests; outputs poisoned with NaN first, every element checked.
(b) compute-sanitizer memcheck and racecheck on a small split-KV case.
(c) bandwidth: minimal bytes (performance model) / kernel time (CUDA events around CUDA
    graph replays, warm-up, median) as a fraction of the device-to-device copy
    bandwidth measured in this run; peers torch SDPA (flash, cuDNN) and
    FlexAttention (compiled) on equivalent dense tensors; first-call compile
    time; a second process's first call (on-disk kernel cache).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback

import numpy as np

import nbattn  # noqa: F401  (compat before numba.cuda)
import torch
from numba import cuda

from nbattn import reference as R
from nbattn.cuda import batch_decode_paged
from nbattn.cuda import decode as DEC
from nbattn.cuda import merge as MRG
from nbattn.cuda.tuning import DECODE

from _timing import graph_ms  # noqa: E402  (benchmarks/ is the script's folder)

# the command line's options (main() sets them; the defaults serve importers such as gpu_decode_b1.py)
OPTS = argparse.Namespace(mode="main", out=os.environ.get("OUT", "/tmp/nbattn_out"), budget_s=390.0, quick=False,
                          path="auto", sweep=False)


# Fields of a correctness entry that are measurements; the rest describe the case.
_CHECK_FIELDS = ("ok", "ok_o", "ok_lse", "unwritten", "max_abs_err_o", "max_abs_err_lse", "lse_inf_match",
                 "first_call_s", "second_call_s", "returned_out_buffer", "error", "skipped")


def corr_as_suite(corr: dict) -> dict:
    """The correctness report in the result-file format (docs/gpu.md): one record per
    case, metric ``ok`` (1.0 or 0.0), the error figures beside it as extra fields."""
    out = {k: v for k, v in corr.items() if k != "records"}
    out.setdefault("copy_bandwidth_GBps", None)
    recs = []
    for r in corr.get("records", []):
        if "metric" in r:          # already converted (bench mode re-reads the file)
            recs.append(r)
            continue
        case = {k: (json.dumps(v) if isinstance(v, (dict, list)) else v)
                for k, v in r.items() if k not in _CHECK_FIELDS}
        if isinstance(case.get("case"), str):
            case["name"] = case.pop("case")
        extra = {k: r[k] for k in _CHECK_FIELDS if k in r and k != "ok"}
        recs.append(dict({"case": case, "metric": "ok", "value": 1.0 if r.get("ok") else 0.0,
                          "unit": "bool", "peers": {}}, **extra))
    out["records"] = recs
    return out


def _case_name(r: dict):
    return r["case"].get("name") if isinstance(r.get("case"), dict) else r.get("case")


def _is_ok(r: dict) -> bool:
    return bool(r["value"]) if r.get("metric") == "ok" else bool(r.get("ok"))


T0 = time.time()
TORCH_DT = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def left() -> float:
    return OPTS.budget_s - (time.time() - T0)


def tuning_for(path="auto", unroll=0, heads=4):
    """The DecodeTuning that pins a path (and the warp path's unroll and heads per CTA);
    "warp8": the warp path with a whole group of 8 in one CTA (opt-in)."""
    if path == "warp8":
        path, heads = "warp", 8
    return DECODE.replace(path=path, warp_unroll=unroll, warp_max_heads=heads)


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------

def make_case(gen: torch.Generator, code, lens, page_size, num_kv_heads, group, head_dim, layout):
    lens = np.asarray(lens, np.int64)
    n_pages = -(-lens // page_size)
    pool = int(n_pages.sum()) + 7
    perm = torch.randperm(pool, generator=gen).numpy().astype(np.int32)
    indices = perm[:int(n_pages.sum())].copy()
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    last = np.where(n_pages > 0, lens - (n_pages - 1) * page_size, 0).astype(np.int32)
    shape = ((pool, 2, page_size, num_kv_heads, head_dim) if layout == "NHD"
             else (pool, 2, num_kv_heads, page_size, head_dim))
    cache = torch.randn(shape, generator=gen, device="cpu").to(TORCH_DT[code]).cuda()
    q = torch.randn((len(lens), num_kv_heads * group, head_dim), generator=gen).to(TORCH_DT[code]).cuda()
    return q, cache, indptr, indices, last


def to_np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.dtype("V2"))
    return t.numpy()


def f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


TOL = {"f16": (2e-3, 2e-3), "bf16": (1.6e-2, 1.6e-2), "f32": (1e-4, 1e-4)}


# ---------------------------------------------------------------------------
# (a) correctness
# ---------------------------------------------------------------------------

CORRECTNESS = [
    # name, code, lens spec, page, Hkv, group, D, layout, variant, meta on device
    ("b256_f16_p16_g4_d128", "f16", ("uniform", 256, 1, 4096), 16, 2, 4, 128, "NHD", {}, True),
    ("b8_bf16_p1_g8_d128_32k", "bf16", ("uniform", 8, 16000, 32768), 1, 2, 8, 128, "HND", {}, True),
    ("b64_f32_p64_g1_d64", "f32", ("uniform", 64, 1, 8192), 64, 4, 1, 64, "NHD", {}, False),
    ("b4_f16_p64_g8_d256_32k", "f16", ("list", [32768, 32767, 1, 20000]), 64, 1, 8, 256, "NHD", {}, True),
    ("b32_bf16_p16_g4_d64", "bf16", ("uniform", 32, 1, 2048), 16, 4, 4, 64, "NHD", {}, True),
    ("b128_f32_p16_g1_d128_empty", "f32", ("uniform", 128, 0, 3000), 16, 8, 1, 128, "HND", {}, True),
    ("b16_f16_variants", "f16", ("uniform", 16, 1, 8192), 16, 2, 4, 128, "NHD",
     dict(causal=True, window_left=1000, sink_size=4, logits_soft_cap=30.0, pos_encoding_mode="ALIBI"), True),
    ("b16_f16_user_mods", "f16", ("uniform", 16, 1, 8192), 16, 2, 4, 128, "NHD",
     dict(score_mod=lambda s, b, h, q, k: s - 0.001 * (q - k), mask_mod=lambda b, h, q, k: (k + h) % 5 != 0),
     True),
    ("b16_f16_sigmoid", "f16", ("uniform", 16, 1, 4096), 16, 2, 4, 128, "NHD",
     dict(use_sigmoid=True, sigmoid_bias=-2.0), True),
    ("b64_f16_p16_g8_d128", "f16", ("uniform", 64, 1, 4096), 16, 4, 8, 128, "NHD", {}, True),
    ("b16_f16_g8_variants", "f16", ("uniform", 16, 1, 8192), 16, 2, 8, 128, "NHD",
     dict(causal=True, window_left=1000, sink_size=4, logits_soft_cap=30.0, pos_encoding_mode="ALIBI"), True),
    # batch 1 x 32k: the benchmark's shape, split on the small-batch CTA shape
    ("b1_f16_p16_g4_d128_32k", "f16", ("list", [32768]), 16, 8, 4, 128, "NHD", {}, True),
    # a split request with every key masked: o = 0, lse = -inf from ~30 empty partials
    ("b3_bf16_p16_g8_d128_masked", "bf16", ("list", [30000, 1, 17001]), 16, 4, 8, 128, "HND",
     dict(mask_mod=lambda b, h, q, k: b != 0), True),
]


def lens_of(spec, rng):
    if spec[0] == "list":
        return np.asarray(spec[1])
    _, n, lo, hi = spec
    lens = rng.integers(lo, hi + 1, size=n)
    if lo == 0:
        lens[::17] = 0          # empty requests: o = 0, lse = -inf
    return lens


def check_decode(case, rng, gen, path="auto") -> dict:
    name, code, spec, ps, hkv, g, d, layout, variant, meta_dev = case
    tuning = tuning_for(path)
    lens = lens_of(spec, rng)
    q, cache, indptr, indices, last = make_case(gen, code, lens, ps, hkv, g, d, layout)
    meta = [torch.from_numpy(a).cuda() if meta_dev else a for a in (indptr, indices, last)]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")   # poisoned
    sig = variant.get("use_sigmoid", False)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device="cuda")
    t = time.time()
    res = batch_decode_paged(q, cache, *meta, kv_layout=layout, return_lse=not sig, out=out,
                             lse=None if sig else lse, tuning=tuning, **variant)
    torch.cuda.synchronize()
    first = time.time() - t
    t = time.time()
    batch_decode_paged(q, cache, *meta, kv_layout=layout, return_lse=not sig, out=out,
                       lse=None if sig else lse, tuning=tuning, **variant)
    torch.cuda.synchronize()
    second = time.time() - t
    o = f32(out)
    gold = R.batch_decode_paged(to_np(q), to_np(cache), indptr, indices, last, kv_layout=layout,
                                return_lse=not sig, **variant)
    ro, rl = (gold, None) if sig else gold
    atol, rtol = TOL[code]
    rec = dict(case=name, dtype=code, batch=len(lens), max_kv=int(lens.max()), page_size=ps,
               num_kv_heads=hkv, group=g, head_dim=d, kv_layout=layout,
               variant={k: (v if not callable(v) else "fn") for k, v in variant.items()},
               unwritten=int(np.isnan(o).sum()),
               max_abs_err_o=float(np.nanmax(np.abs(o - ro))) if o.size else 0.0,
               ok_o=bool(np.allclose(o, ro, atol=atol, rtol=rtol) and not np.isnan(o).any()),
               returned_out_buffer=(res[0] if isinstance(res, tuple) else res) is out,
               first_call_s=first, second_call_s=second,
               split_chunk=DEC.choose_chunk(DEC.prepare_decode(q, cache, *meta, kv_layout=layout, tuning=tuning,
                                                               **variant)),
               path=path if path == "warp8" else DEC.prepare_decode(q, cache, *meta, kv_layout=layout,
                                                                    tuning=tuning, **variant).config().path)
    if not sig:
        lv = f32(lse)
        fin = np.isfinite(rl)
        rec["lse_inf_match"] = bool(np.array_equal(np.isneginf(lv), np.isneginf(rl)))
        rec["max_abs_err_lse"] = float(np.abs(lv[fin] - rl[fin]).max()) if fin.any() else 0.0
        rec["ok_lse"] = bool(rec["lse_inf_match"] and np.allclose(lv[fin], rl[fin], atol=2e-3, rtol=1e-4)
                             and not np.isnan(lv).any())
    rec["ok"] = bool(rec["ok_o"] and rec.get("ok_lse", True))
    return rec


def check_merge(rng) -> list[dict]:
    recs = []
    for code in ("f16", "bf16", "f32"):
        v = torch.randn((64, 4, 32, 128)).to(TORCH_DT[code]).cuda()
        s = (torch.randn((64, 4, 32)) * 20).float()
        s[torch.rand(s.shape) < 0.1] = -math.inf
        s = s.cuda()
        o, l = MRG.merge_states(v, s)
        ro, rl = R.merge_states(_as_f32(to_np(v)), f32(s))
        atol, rtol = TOL[code]
        ok = np.allclose(f32(o), ro, atol=atol, rtol=rtol)
        fin = np.isfinite(rl)
        ok_l = np.array_equal(np.isneginf(f32(l)), np.isneginf(rl)) and np.allclose(f32(l)[fin], rl[fin], rtol=1e-5,
                                                                                  atol=1e-4)
        va, vb = v[:, 0], v[:, 1]
        sa, sb = s[:, 0].contiguous(), s[:, 1].contiguous()
        o2, l2 = MRG.merge_state(va.contiguous(), sa, vb.contiguous(), sb)
        ro2, rl2 = R.merge_state(_as_f32(to_np(va)), f32(sa), _as_f32(to_np(vb)), f32(sb))
        ok2 = np.allclose(f32(o2), ro2, atol=atol, rtol=rtol)
        vi, si = va.contiguous().clone(), sa.clone()
        mask = torch.rand(64) < 0.5
        MRG.merge_state_in_place(vi, si, vb.contiguous(), sb, mask=mask.numpy())
        rv, rs = _as_f32(to_np(va)).copy(), f32(sa).copy()
        R.merge_state_in_place(rv, rs, _as_f32(to_np(vb)), f32(sb), mask=mask.numpy())
        ok3 = np.allclose(f32(vi), rv, atol=atol, rtol=rtol)
        recs.append(dict(case=f"merge_{code}", ok=bool(ok and ok_l and ok2 and ok3), merge_states=bool(ok and ok_l),
                         merge_state=bool(ok2), merge_state_in_place=bool(ok3),
                         no_nan=bool(not np.isnan(f32(o)).any() and not np.isnan(f32(l)).any())))
    return recs


def _as_f32(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "V":
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


# ---------------------------------------------------------------------------
# (c) timing
# ---------------------------------------------------------------------------

def bench(fn, iters=15, rep=10, graph=True):
    """Median ms per call and whether it was graphed (:func:`_timing.graph_ms`)."""
    return graph_ms(fn, iters, rep, graph, log=log)


def write_gpu_suite(suite: str, recs: list, copy_bw: float, root: str, script: str):
    """``nbattn.perf.results.write_suite`` with this GPU's name, the versions and
    today's date, for the scripts that import this module."""
    import platform

    from nbattn.perf import results
    return results.write_suite(
        suite, recs, gpu=torch.cuda.get_device_name(), command=f"PYTHONPATH=$PWD python3 benchmarks/{script}",
        versions={"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version()},
        date=datetime.date.today().isoformat(), root=root, copy_bandwidth_GBps=copy_bw)


def copy_bandwidth() -> dict:
    """Device-to-device copy of 1 GiB (bytes read + written), three ways; the
    best is the ceiling (a graph's memcpy node may run on a copy engine)."""
    n = 1 << 30
    a = torch.empty(n // 4, dtype=torch.float32, device="cuda")
    a.uniform_()
    b = torch.empty_like(a)
    res = {}
    for name, fn, graph in (("memcpy", lambda: b.copy_(a), False),
                            ("memcpy_graph", lambda: b.copy_(a), True),
                            ("sm_kernel", lambda: torch.mul(a, 1.0, out=b), False)):
        ms, _ = bench(fn, iters=10, rep=5, graph=graph)
        res[name] = 2 * n / (ms * 1e-3) / 1e9
    a = b = None          # free the 2 GiB (rebinding, not del: pyflakes reads the lambdas above as undefined)
    return res


def our_runner(p, chunk, path="auto", unroll=0, heads=4):
    """A closure launching the decode work (+ merge) on torch's current stream,
    with the decode path (and the warp path's unroll) fixed for its lifetime."""
    pt = dataclasses.replace(p, tuning=tuning_for(path, unroll, heads))
    launch = DEC.split_runner(pt, chunk)
    items = len(DEC.split_work(pt.kv_lens, chunk)[1])

    def run():
        pt.stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        launch()
    return run, items


def with_path(p, path, unroll, fn, heads=4):
    return fn(dataclasses.replace(p, tuning=tuning_for(path, unroll, heads)))


def bench_case(batch, kv_len, hkv, copy_bw, gen, split_modes=("auto",), unrolls=(), heads=()):
    hq, d, ps = 32, 128, 16
    lens = np.full(batch, kv_len)
    q, cache, indptr, indices, last = make_case_fast(lens, ps, hkv, d)
    meta = [torch.from_numpy(a).cuda() for a in (indptr, indices, last)]
    nbytes = 2 * d * (batch * hq * 2 + 2 * int(lens.sum()) * hkv)
    p = DEC.prepare_decode(q, cache, *meta, return_lse=True)
    recs = []
    # the default path, the shared-memory path, and (optionally) other warp-path unrolls
    # (and heads per CTA on the warp path)
    runs = [(m, OPTS.path, 0, 4) for m in split_modes]
    if OPTS.path != "smem":
        runs += [(m, "smem", 0, 4) for m in split_modes] + [(split_modes[0], "warp", u, 4) for u in unrolls]
        if with_path(p, OPTS.path, 0, lambda p: p.config().path) == "tc":   # the CUDA-core peer
            runs += [(m, "warp", 0, 4) for m in split_modes]
        runs += [(split_modes[0], "warp", 0, h) for h in heads]
    for mode, path, unroll, hmax in runs:
        chunk = (with_path(p, path, unroll, DEC.choose_chunk, hmax) if mode == "auto"
                 else (None if mode == "unsplit" else int(mode)))
        cfg = with_path(p, path, unroll, lambda p: p.config(), hmax)
        fn, items = our_runner(p, chunk, path, unroll, hmax)
        ms, graphed = bench(fn)
        recs.append(dict(mode=mode, path=cfg.path, unroll=cfg.unroll, heads_per_cta=cfg.heads_per_cta,
                         asked=(path, unroll, hmax),
                         chunk=chunk, items=items, ms=ms, graphed=graphed,
                         bw=nbytes / (ms * 1e-3) / 1e9 / copy_bw))
    # same-run sanity check of the default path's output against torch's math (dense copy)
    fn, _ = our_runner(p, with_path(p, OPTS.path, 0, DEC.choose_chunk), OPTS.path)
    fn()
    torch.cuda.synchronize()
    try:
        recs[0]["check_max_abs_err"] = dense_check(p, q, cache, indptr, indices, batch, kv_len, hkv, ps, d)
    except Exception:  # noqa: BLE001
        log("dense check failed", traceback.format_exc()[-300:])
    peers = {}
    qd = q.view(batch, hkv, hq // hkv, d).reshape(batch, hq, 1, d)
    kd = torch.randn((batch, hkv, kv_len, d), dtype=torch.float16, device="cuda")
    vd = torch.randn((batch, hkv, kv_len, d), dtype=torch.float16, device="cuda")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            def f(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)
            ms, _ = bench(f)
            peers[name] = nbytes / (ms * 1e-3) / 1e9 / copy_bw
        except Exception as exc:  # noqa: BLE001
            log(name, "failed:", repr(exc)[:150])
            peers[name] = None
    try:
        if FLEX is None or left() < 60:
            raise RuntimeError("flex skipped (time)")
        ms, _ = bench(lambda: FLEX(qd, kd, vd, enable_gqa=True))
        peers["flex"] = nbytes / (ms * 1e-3) / 1e9 / copy_bw
    except Exception as exc:  # noqa: BLE001
        log("flex failed:", repr(exc)[:150])
        peers["flex"] = None
    q = cache = kd = vd = p = None   # free the case (rebinding, not del: see copy_bandwidth)
    torch.cuda.empty_cache()
    return recs, peers, nbytes


def dense_check(p, q, cache, indptr, indices, batch, kv_len, hkv, ps, d, rows=2):
    """Max |ours - torch math| over the first `rows` requests (pages gathered on the GPU)."""
    o = p.out_user[:rows].float().reshape(-1, hkv * (q.shape[1] // hkv), d)
    idx = torch.from_numpy(indices.astype(np.int64)).cuda()
    n_pages = -(-kv_len // ps)
    errs = []
    for r in range(min(rows, batch)):
        pages = idx[int(indptr[r]):int(indptr[r]) + n_pages]
        kv = cache[pages].float()                      # [n, 2, ps, hkv, d]
        k = kv[:, 0].reshape(-1, hkv, d)[:kv_len]
        v = kv[:, 1].reshape(-1, hkv, d)[:kv_len]
        qq = q[r].float().view(hkv, -1, d)             # [hkv, g, d]
        s = torch.einsum("hgd,thd->hgt", qq, k) / math.sqrt(d)
        ref = torch.einsum("hgt,thd->hgd", torch.softmax(s, -1), v).reshape(-1, d)
        errs.append(float((o[r] - ref).abs().max()))
    return max(errs)


def make_case_fast(lens, ps, hkv, d):
    """Benchmark inputs built on the GPU (large): shuffled pages, fp16, NHD."""
    n_pages = -(-lens // ps)
    pool = int(n_pages.sum())
    perm = np.random.default_rng(0).permutation(pool).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    last = (lens - (n_pages - 1) * ps).astype(np.int32)
    cache = torch.randn((pool, 2, ps, hkv, d), dtype=torch.float16, device="cuda")
    q = torch.randn((len(lens), 32, d), dtype=torch.float16, device="cuda")
    return q, cache, indptr, perm, last


FLEX = None


# ---------------------------------------------------------------------------
# (b) sanitizer and second-process modes
# ---------------------------------------------------------------------------

def small_case_run():
    gen = torch.Generator().manual_seed(5)
    q, cache, indptr, indices, last = make_case(gen, "f16", [5, 40, 0, 33], 16, 2, 4, 128, "NHD")
    p = DEC.prepare_decode(q, cache, indptr, indices, last, return_lse=True, tuning=tuning_for(OPTS.path))
    DEC.run_split(p, 16)
    o, l = DEC.finish_decode(p, True)
    torch.cuda.synchronize()
    ro, rl = R.batch_decode_paged(to_np(q), to_np(cache), indptr, indices, last, return_lse=True)
    print("small case path", p.config().path, "max err", float(np.abs(f32(o) - ro).max()))


def second_process():
    torch.zeros(1, device="cuda")
    cuda.current_context()
    gen = torch.Generator().manual_seed(6)
    q, cache, indptr, indices, last = make_case(gen, "f16", [100, 7], 16, 2, 4, 128, "NHD")
    t = time.time()
    batch_decode_paged(q, cache, indptr, indices, last, tuning=tuning_for(OPTS.path))
    torch.cuda.synchronize()
    print(json.dumps({"second_process_first_call_s": time.time() - t}))


def sanitize(paths=("auto", "warp"), env_extra=None) -> dict:
    """compute-sanitizer memcheck and racecheck on the small split-KV case, once per
    decode path (auto = the tensor-core kernel for this group-4 fp16 case)."""
    res = {}
    exe = None
    for cand in ("compute-sanitizer", "/usr/local/cuda/bin/compute-sanitizer"):
        if subprocess.run(["bash", "-c", f"command -v {cand}"], capture_output=True).returncode == 0:
            exe = cand
            break
    if exe is None:
        return {"note": "compute-sanitizer not found on this machine; skipped"}
    for path in paths:
        for tool in ("memcheck", "racecheck"):
            key = f"{tool}_{path}"
            if left() < 25:
                res[key] = "skipped: out of time"
                continue
            try:
                env = dict(os.environ, **(env_extra or {}))
                # host API return codes (numba's driver probing: cuGetProcAddress) are not
                # kernel memory errors: left out of the count
                r = subprocess.run([exe, "--tool", tool, "--report-api-errors", "no", "--print-limit", "20",
                                    sys.executable, __file__, "small", "--path", path],
                                   capture_output=True, text=True, timeout=min(150, left() - 5), env=env)
                lines = (r.stdout + r.stderr).strip().splitlines()
                keep = [x for x in lines if "SUMMARY" in x or "small case" in x or "Error" in x
                        or "Invalid" in x or "Race" in x][-10:]
                res[key] = {"rc": r.returncode, "summary": keep}
            except subprocess.TimeoutExpired:
                res[key] = "timeout"
    return res


def extras():
    """On-disk kernel cache (a fresh cache directory: the first process compiles, a
    second process loads) and the sanitizer runs; one JSON under $OUT."""
    os.makedirs(OPTS.out, exist_ok=True)
    import tempfile
    cache_dir = tempfile.mkdtemp(prefix="nbattn_numba_cache_")
    res = {"cache_dir": "fresh temporary NUMBA_CACHE_DIR"}
    for name in ("first_process", "second_process"):
        r = subprocess.run([sys.executable, __file__, "second", "--path", OPTS.path], capture_output=True,
                           text=True, timeout=150, env=dict(os.environ, NUMBA_CACHE_DIR=cache_dir))
        line = [x for x in r.stdout.splitlines() if x.startswith("{")]
        res[name + "_first_call_s"] = json.loads(line[-1])["second_process_first_call_s"] if line else r.stderr[-300:]
        log(name, res[name + "_first_call_s"])
    res["sanitizer"] = sanitize(env_extra={"NUMBA_CACHE_DIR": cache_dir})   # kernels compiled above load
    log("sanitizer", json.dumps(res["sanitizer"])[:2000])
    write_gpu_suite("decode_extras", extras_records(res), None, OPTS.out, "gpu_decode.py extras")


def extras_records(res: dict) -> list:
    """The extras run as result records: the first decode call of each process (the
    second one loads the first one's on-disk cache) and, per sanitizer run, the count
    its summary line reports (with the lines themselves)."""
    first = res.get("first_process_first_call_s")
    recs = []
    for n, name in enumerate(("first_process", "second_process"), 1):
        v = res.get(name + "_first_call_s")
        if isinstance(v, (int, float)):
            recs.append(dict(case={"process": n, "cache_dir": "fresh NUMBA_CACHE_DIR"},
                             metric="decode_first_call_s", value=float(v), unit="s",
                             peers={"first_process": float(first)} if n == 2 and isinstance(first, float) else {}))
    for key, run in (res.get("sanitizer") or {}).items():
        if not isinstance(run, dict) or "summary" not in run:
            continue
        tool, _, path = key.partition("_")
        counts = [int(m) for line in run["summary"] if "SUMMARY" in line
                  for m in re.findall(r"(\d+) (?:errors|hazards)", line)[:1]]
        if counts:
            recs.append(dict(case={"tool": tool, "decode_path": path, "case": "small split-KV"},
                             metric="sanitizer_reported", value=float(counts[-1]), unit="errors or hazards",
                             peers={}, rc=run["rc"], summary=list(run["summary"])))
    return recs


# ---------------------------------------------------------------------------

def main(mode="all"):
    os.makedirs(OPTS.out, exist_ok=True)
    rng = np.random.default_rng(int(time.time()))
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    torch.zeros(1, device="cuda")
    dev = torch.cuda.get_device_name()
    versions = {"torch": torch.__version__, "numpy": np.__version__,
                "numba_cuda": __import__("numba_cuda").__version__, "python": sys.version.split()[0]}
    corr = {"suite": "decode_correctness", "gpu": dev, "date": datetime.date.today().isoformat(),
            "command": "PYTHONPATH=$PWD python3 benchmarks/gpu_decode.py", "versions": versions,
            "records": []}

    def dump_corr():
        with open(os.path.join(OPTS.out, "decode_correctness.json"), "w") as f:
            json.dump(corr_as_suite(corr), f, indent=1, default=str)

    if mode == "bench":
        return bench_main(rng, gen, dev, versions)
    # the default (warp) path on every case, the shared-memory fallback on two
    todo = [(c, "auto") for c in CORRECTNESS]
    todo += [(c, "smem") for c in CORRECTNESS if c[0] in ("b64_f16_p16_g8_d128", "b16_f16_variants")]
    todo += [(c, "warp8") for c in CORRECTNESS if c[0] in ("b64_f16_p16_g8_d128", "b8_bf16_p1_g8_d128_32k")]
    # the CUDA-core warp path where the default is the tensor-core one
    todo += [(c, "warp") for c in CORRECTNESS if c[0] in ("b64_f16_p16_g8_d128", "b256_f16_p16_g4_d128",
                                                          "b16_f16_g8_variants")]
    for case, path in todo:
        if left() < 200:
            corr["records"].append({"case": case[0], "skipped": "time"})
            continue
        try:
            rec = check_decode(case, rng, gen, path)
        except Exception:  # noqa: BLE001
            rec = {"case": case[0], "ok": False, "error": traceback.format_exc()[-1500:]}
        corr["records"].append(rec)
        log("correct", rec["case"], "OK" if rec.get("ok") else "FAIL",
            {k: rec.get(k) for k in ("path", "max_abs_err_o", "max_abs_err_lse", "unwritten", "first_call_s",
                                     "split_chunk", "error")})
        torch.cuda.empty_cache()
        dump_corr()
    try:
        for rec in check_merge(rng):
            corr["records"].append(rec)
            log("correct", rec["case"], "OK" if rec["ok"] else "FAIL", rec)
    except Exception:  # noqa: BLE001
        corr["records"].append({"case": "merge", "ok": False, "error": traceback.format_exc()[-1500:]})
        log("merge error", traceback.format_exc()[-800:])
    dump_corr()
    if mode == "correct":
        print("correctness:", sum(1 for r in corr["records"] if _is_ok(r)), "ok of", len(corr["records"]))
        return
    bench_main(rng, gen, dev, versions, corr)


def bench_main(rng, gen, dev, versions, corr=None):
    global FLEX
    if corr is None:
        try:
            with open(os.path.join(OPTS.out, "decode_correctness.json")) as f:
                corr = json.load(f)
        except OSError:
            corr = {"records": []}

    def dump_corr():
        with open(os.path.join(OPTS.out, "decode_correctness.json"), "w") as f:
            json.dump(corr_as_suite(corr), f, indent=1, default=str)

    # -------- benchmark --------
    result = {"suite": "decode", "gpu": dev, "date": datetime.date.today().isoformat(),
              "command": " ".join(["PYTHONPATH=$PWD python3 benchmarks/gpu_decode.py"] + sys.argv[1:]),
              "versions": versions,
              "copy_bandwidth_GBps": None, "records": []}

    def dump():
        with open(os.path.join(OPTS.out, "decode.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)

    copies = copy_bandwidth()
    copy_bw = max(copies.values())
    result["copy_bandwidth_GBps"] = copy_bw
    result["copy_bandwidth_methods_GBps"] = copies
    log(f"copy bandwidth {copy_bw:.0f} GB/s (read+write), by method {copies}")
    try:
        import importlib
        importlib.import_module("torch._dynamo").config.recompile_limit = 64
        from torch.nn.attention.flex_attention import flex_attention
        FLEX = torch.compile(flex_attention, dynamic=False)
    except Exception as exc:  # noqa: BLE001
        log("flex unavailable", repr(exc)[:100])
    first = next((r for r in corr["records"] if _case_name(r) == "b256_f16_p16_g4_d128"), {})
    if "first_call_s" in first:
        result["records"].append({"case": {"dtype": "f16", "head_dim": 128, "group": 4, "page_size": 16},
                                  "metric": "first_call_s", "value": first["first_call_s"], "unit": "s",
                                  "peers": {"second_call_s": first["second_call_s"]}})
    table = []
    # most telling first, in case the time budget runs out
    # (batch, kv_len, kv heads, split modes, warp unroll sweep, warp heads-per-CTA sweep)
    # (the warp path's unroll and heads-per-CTA sweeps: --sweep; measured in earlier runs)
    sweep = OPTS.sweep
    cases = [(64, 4096, hkv, ("auto",), (), (8,) if hkv == 4 and sweep else ()) for hkv in (8, 4)]
    cases += [(1, 32768, 8, ("auto", "unsplit"), (), ()), (1, 32768, 4, ("auto", "unsplit"), (), ())]
    cases += [(64, L, hkv, ("auto",), (2, 4) if L == 16384 and sweep else (),
               (8,) if hkv == 4 and L == 16384 and sweep else ())
              for L in (16384, 32768, 1024) for hkv in (8, 4)]
    for batch, L, hkv, modes, unrolls, heads in cases:
        if left() < 30:
            log("skipping bench", batch, L, hkv, "(time)")
            continue
        try:
            recs, peers, nbytes = bench_case(batch, L, hkv, copy_bw, gen, modes, unrolls, heads)
        except Exception:  # noqa: BLE001
            log("bench error", batch, L, hkv, traceback.format_exc()[-600:])
            continue
        smem = {r["mode"]: r["bw"] for r in recs if r["path"] == "smem"}
        warp = {r["mode"]: r["bw"] for r in recs if r["asked"] == ("warp", 0, 4)}
        for r in recs:
            case = {"batch": batch, "kv_len": L, "num_qo_heads": 32, "num_kv_heads": hkv, "group": 32 // hkv,
                    "head_dim": 128, "page_size": 16, "dtype": "f16", "split": r["mode"],
                    "kv_chunk": r["chunk"], "work_items": r["items"], "graphed": r["graphed"],
                    "path": r["path"], "unroll": r["unroll"], "heads_per_cta": r["heads_per_cta"]}
            if "check_max_abs_err" in r:
                case["check_max_abs_err_vs_torch"] = r["check_max_abs_err"]
            pe = dict(peers)
            if r["path"] != "smem":
                pe["nbattn_smem"] = smem.get(r["mode"])
            if r["path"] == "tc":
                pe["nbattn_warp"] = warp.get(r["mode"])
            # the library's default path keeps the plain metric names (plots and notebooks
            # select them by case); the comparison runs get their own
            default = (r["path"], r["unroll"], r["heads_per_cta"]) == (recs[0]["path"], recs[0]["unroll"],
                                                                     recs[0]["heads_per_cta"])
            alt = "" if default else "_path_sweep"
            result["records"].append({"case": case, "metric": "bw_fraction" + alt, "value": r["bw"],
                                      "unit": "fraction of copy bandwidth", "peers": pe})
            result["records"].append({"case": case, "metric": "latency_us" + alt, "value": r["ms"] * 1e3,
                                      "unit": "us", "peers": {}})
            tag = f"u{r['unroll']}h{r['heads_per_cta']}" if r["path"] == "warp" else ""
            table.append((batch, L, hkv, f"{r['mode']}/{r['path']}{tag}",
                          r["chunk"], r["ms"] * 1e3, r["bw"], peers))
            log(f"bench b={batch} L={L} hkv={hkv} {r['mode']}/{r['path']} u{r['unroll']} (chunk {r['chunk']}): "
                f"{r['ms']*1e3:.1f} us bw {r['bw']:.3f} err {r.get('check_max_abs_err')} peers "
                + " ".join(f"{k}={v:.3f}" if v else f"{k}=NA" for k, v in peers.items()))
        dump()
    # second process: first call should hit the on-disk cache
    try:
        if OPTS.quick:
            raise RuntimeError("skipped (--quick)")
        r = subprocess.run([sys.executable, __file__, "second", "--path", OPTS.path], capture_output=True, text=True,
                           timeout=120)
        line = [x for x in r.stdout.splitlines() if x.startswith("{")]
        sec = json.loads(line[-1])["second_process_first_call_s"] if line else None
        result["records"].append({"case": {"dtype": "f16", "head_dim": 128, "group": 4, "page_size": 16},
                                  "metric": "second_process_first_call_s", "value": sec, "unit": "s",
                                  "peers": {}})
        log("second process first call", sec, r.stderr[-300:] if sec is None else "")
    except Exception as exc:  # noqa: BLE001
        log("second process failed", repr(exc)[:200])
    dump()
    corr["sanitizer"] = {"note": "skipped (--quick)"} if OPTS.quick else sanitize()
    log("sanitizer", json.dumps(corr["sanitizer"])[:1500])
    dump_corr()
    print("\n batch    L  hkv mode/path         chunk      us    bw   flash  cudnn   flex")
    for b, L, h, m, c, us, bw, pe in table:
        fmt = lambda v: f"{v:6.3f}" if v else "    NA"  # noqa: E731
        print(f"{b:6d} {L:5d} {h:3d} {m:16s} {str(c):>6s} {us:8.1f} {bw:5.3f} {fmt(pe.get('sdpa_flash'))} "
              f"{fmt(pe.get('sdpa_cudnn'))} {fmt(pe.get('flex'))}")
    print("correctness:", sum(1 for r in corr["records"] if _is_ok(r)), "ok of", len(corr["records"]))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="main",
                    choices=("main", "all", "correct", "bench", "extras", "small", "second"))
    ap.add_argument("--out", default=OPTS.out, help="where the result files go (default: $OUT)")
    ap.add_argument("--budget-s", type=float, default=OPTS.budget_s, help="time budget of the session")
    ap.add_argument("--quick", action="store_true", help="skip the sanitizer and the second process")
    ap.add_argument("--path", default=OPTS.path, choices=("auto", "warp", "smem", "tc"),
                    help="the decode path pinned as the default (e.g. smem when warp failed its checks)")
    ap.add_argument("--sweep", action="store_true", help="the warp path's unroll and heads-per-CTA sweeps")
    return ap.parse_args(argv)


if __name__ == "__main__":
    OPTS = parse_args()
    if OPTS.mode == "small":
        small_case_run()
    elif OPTS.mode == "extras":
        extras()
    elif OPTS.mode == "second":
        second_process()
    else:
        main(OPTS.mode)
