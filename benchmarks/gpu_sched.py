"""One GPU visit for the scheduler (issues 5 and 21): fit the cost model, then sweep the policies.

    COMMIT=$(git rev-parse HEAD) PYTHONPATH=$PWD python3 benchmarks/gpu_sched.py \
        --out $OUT --commit $COMMIT --budget-s 300
    NUMBA_ENABLE_CUDASIM=1 PYTHONPATH=$PWD python3 benchmarks/gpu_sched.py --quick --out /tmp/x   # dry run

Writes ``$OUT/cost_fit.json`` (suite ``cost_fit``: the probe times as records, the
fitted :class:`nbattn.sched.cost.CostModel` of the decode tensor-core path as its
``"fit"`` object, naming GPU and commit) and ``$OUT/sched.json`` (suite ``sched``).
Both are written again after every stage, so a run stopped by the budget still
leaves valid files; whatever was not reached is listed under ``checks.skipped``.

Stages (fp16, head_dim 128, 32 query / 8 KV heads, page 16; kernel times are CUDA
events around CUDA-graph replays of 10 calls, median of 15, :mod:`_timing`):

1. Copy bandwidth (1 GiB device-to-device), and correctness of the decode wrapper
   against the golden model (outputs poisoned with NaN) on a skewed and a variable
   batch, default plan and the fitted one later.
2. Determinism (100 runs bitwise equal, a re-plan of the same lengths too) and a
   CUDA graph of run() replayed after plan() with other lengths.
3. The fit (``benchmarks/fit_cost.py``): stream, solo and merge probes, each a
   forced plan through the public decode wrapper; least squares.
4. The sweep: workloads constant (4096), uniform (512..8192), skewed (1 x 32768 +
   512s), Zipf (256 * Zipf(1.5), capped at 32768) at batch 64, 16 and 256, and
   mixed prefill + decode (every 8th request appends 256 queries) through the
   prefill wrapper.  Decode policies: ``one_per_cta`` and ``split_<n>`` (n = 512,
   1024, 2048, 4096; FlashDecoding: one CTA per chunk, merged in KV order, through
   ``nbattn.cuda.decode``), ``lpt`` (the wrapper with the fitted model,
   ``search="plans"``), ``lpt_default`` (the wrapper's default plan) and
   ``lpt_spec`` (the paper's rule exactly: no item price, ``L = ceil(W/C)``).  Every
   record carries ``bw_fraction`` (decode; bytes of K, V, q and o over the copy
   bandwidth) or ``tflops`` (prefill), the simulator's prediction under the fitted
   model (``predicted_us``, error), and same-run peers: the other policies and SDPA
   flash / cuDNN on the padded dense batch (timing peers: the padding is not
   masked; ``padding_factor`` says how many more keys they read).
5. Plan time on the CPU with the fitted model (batch 64 and 1024).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

import nbattn  # noqa: F401  (compat before numba.cuda)
import torch
from numba import cuda

from nbattn import reference as R
from nbattn.cuda import decode as DEC
from nbattn.cuda import merge as MRG
from nbattn.cuda.blocks.primitives import SIMULATOR
from nbattn.cuda.wrappers import (BatchDecodeWithPagedKVCacheWrapper,
                                  BatchPrefillWithPagedKVCacheWrapper, default_num_ctas)
from nbattn.sched import CostModel, make_workload, plan as lpt_plan, simulate, simulate_plan
from nbattn.sched.cost import DEFAULT_FIT, CostFit, cost_fit_from_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import graph_ms  # noqa: E402  (benchmarks/ is the script's folder)
import fit_cost  # noqa: E402

T0 = time.time()
BUDGET_S = 300.0
QUICK = SIMULATOR
DEV = "cpu" if SIMULATOR else "cuda"
HQ, HK, D, PAGE = 32, 8, 128, 16
GROUP = HQ // HK
WS_BYTES = 256 << 20
FIXED = (512, 1024, 2048, 4096)
BATCHES = (64, 16, 256)


def configure(quick: bool) -> None:
    """Shapes of a full run or of the tiny dry run."""
    global QUICK, HQ, HK, D, PAGE, GROUP, WS_BYTES, FIXED, BATCHES
    QUICK = bool(quick or SIMULATOR)
    if QUICK:
        HQ, HK, D, PAGE, WS_BYTES, FIXED, BATCHES = 4, 1, 16, 4, 1 << 20, (8, 16, 32, 64), (4, 8)
    GROUP = HQ // HK


def left() -> float:
    return BUDGET_S - (time.time() - T0)


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def sync():
    if not SIMULATOR:
        torch.cuda.synchronize()


def golden(q, cache, indptr, indices, last):
    return R.batch_decode_paged(q.cpu().numpy(), cache.cpu().numpy(), indptr, indices, last, return_lse=True)


def compare(o, lse, ref, tol=3e-3) -> dict:
    o = torch.as_tensor(np.asarray(o)) if not torch.is_tensor(o) else o
    lse = torch.as_tensor(np.asarray(lse)) if not torch.is_tensor(lse) else lse
    o = o.float().cpu().numpy()
    lse = lse.cpu().numpy()
    ro, rl = ref
    fin = np.isfinite(rl)
    err_o = float(np.abs(o - ro).max())
    err_l = float(np.abs(lse[fin] - rl[fin]).max()) if fin.any() else 0.0
    ok = (not np.isnan(o).any() and not np.isnan(lse).any() and np.allclose(o, ro, atol=tol, rtol=tol)
          and np.array_equal(np.isneginf(lse), np.isneginf(rl)) and err_l < tol)
    return dict(ok=bool(ok), max_abs_err_o=err_o, max_abs_err_lse=err_l, unwritten=int(np.isnan(o).sum()))


def bench(fn, iters=15, rep=10):
    """(median microseconds per call, graphed): CUDA-graph replays on a GPU; one
    wall-clock call (after a warm call) on the simulator or with --quick."""
    if SIMULATOR:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6, False
    if QUICK:
        iters, rep = 3, 2
    ms, graphed = graph_ms(fn, iters, rep, log=log)
    return ms * 1e3, graphed


def as_host(x):
    return x if torch.is_tensor(x) else torch.as_tensor(np.asarray(x))


def decode_wrapper(capacity):
    ws = torch.empty(WS_BYTES, dtype=torch.uint8, device=DEV)
    return BatchDecodeWithPagedKVCacheWrapper(ws.numpy() if SIMULATOR else ws, "NHD", num_ctas=capacity)


def decode_bytes(lens) -> int:
    """K and V of every key per KV head, q read and o written, fp16."""
    return 2 * D * (len(lens) * HQ * 2 + 2 * int(np.sum(lens)) * HK)


# ---------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------

def decode_lens(name: str, batch: int, seed: int) -> np.ndarray:
    if QUICK:
        kw = dict(kv_len=24, low=4, high=40, long_len=96, short_len=6, zipf_scale=4, max_len=96)
    else:
        kw = dict(kv_len=4096, low=512, high=8192, long_len=32768, short_len=512, zipf_scale=256,
                  max_len=32768)
    w = make_workload("variable" if name == "uniform" else name, batch, seed=seed, **kw)
    return np.asarray(w.kv_lens, np.int64)


def mixed_lens(batch: int, seed: int):
    kw = dict(low=8, high=40, prefill_len=6, prefill_every=4) if QUICK else dict(low=512, high=4096)
    w = make_workload("mixed", batch, seed=seed, **kw)
    return np.asarray(w.qo_lens, np.int64), np.asarray(w.kv_lens, np.int64)


# ---------------------------------------------------------------------------
# Inputs, bandwidth, the FlashDecoding baseline, checks (as in the first GPU session)
# ---------------------------------------------------------------------------

def make_batch(lens, seed, pool=None):
    """Shuffled pages of a pool, fp16 NHD cache and q on the device."""
    lens = np.asarray(lens, np.int64)
    n_pages = -(-lens // PAGE)
    pool = int(n_pages.sum()) if pool is None else pool
    rng = np.random.default_rng(seed)
    indices = rng.permutation(pool)[:int(n_pages.sum())].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    last = np.where(n_pages > 0, lens - (n_pages - 1) * PAGE, 0).astype(np.int32)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    cache = torch.randn((pool, 2, PAGE, HK, D), generator=gen, device=DEV, dtype=torch.float16)
    q = torch.randn((len(lens), HQ, D), generator=gen, device=DEV, dtype=torch.float16)
    return q, cache, indptr, indices, last


def copy_bandwidth() -> float | None:
    """Device-to-device copy of 1 GiB (bytes read + written), as gpu_decode.py
    measures it: the best of a plain memcpy and an SM copy kernel (a graph's
    memcpy node alone read ~35% low here in session 1)."""
    if SIMULATOR:
        return None
    n = 1 << 30
    a = torch.empty(n // 4, dtype=torch.float32, device="cuda")
    a.uniform_()
    b = torch.empty_like(a)
    best = 0.0
    for fn in (lambda: b.copy_(a), lambda: torch.mul(a, 1.0, out=b)):
        fn()
        sync()
        times = []
        for _ in range(10):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(5):
                fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) * 1e-3 / 5)
        best = max(best, 2 * n / statistics.median(times) / 1e9)
    a = b = None          # free the 2 GiB (rebinding, not del: pyflakes reads the lambdas above as undefined)
    torch.cuda.empty_cache()
    return best



def baseline_runner(q, cache, indptr, indices, last, out, lse, chunk):
    """split_work(lens, chunk) launched like the decode module does (one CTA
    per item, merge in KV order), with every buffer allocated up front."""
    meta = [torch.from_numpy(a).to(DEV) for a in (indptr, indices, last)]
    p = DEC.prepare_decode(q, cache, *meta, return_lse=True, out=out, lse=lse)
    if chunk == "auto":
        chunk = DEC.choose_chunk(p)
    (cta_indptr, req, ks, ke, slot, m_indptr, m_row, m_slots, n_slots) = DEC.split_work(p.kv_lens, chunk)
    up = lambda a: cuda.to_device(np.ascontiguousarray(a, np.int32))  # noqa: E731
    work = DEC.WorkList(up(cta_indptr), up(req), up(ks), up(ke), up(slot))
    n = max(n_slots, 1)
    po = cuda.device_array((n, HQ, D), np.float32)
    pl = cuda.device_array((n, HQ), np.float32)
    mmap = MRG.MergeMap(up(m_indptr), up(m_row), up(m_slots))

    def run():
        if not SIMULATOR:
            p.stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        DEC.run_decode_work(p, work, po, pl)
        if n_slots:
            MRG.run_merge_partials(po, pl, mmap, p.out_dev, p.lse_dev, code=p.code, stream=p.stream)
    return run, dict(chunk=chunk, items=len(req), partials=int(n_slots)), p



def graph_check(w, q, cache, indptr, indices, last, lens) -> dict:
    """Capture run() with torch.cuda.graph, re-plan other lengths (same batch,
    pages of the same pool), write new q values, replay, compare to golden."""
    try:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], device="cuda")
        w.run(q, cache, out=out, lse=lse)
        sync()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            w.run(q, cache, out=out, lse=lse)
        torch.cuda.current_stream().wait_stream(s)
        sync()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            w.run(q, cache, out=out, lse=lse)
        pool = int(cache.shape[0])
        rng = np.random.default_rng(7)
        lens2 = np.concatenate([[16000], rng.integers(1, 700, len(lens) - 1)])
        n2 = -(-lens2 // PAGE)
        assert n2.sum() <= pool
        indices2 = rng.permutation(pool)[:int(n2.sum())].astype(np.int32)
        indptr2 = np.concatenate([[0], np.cumsum(n2)]).astype(np.int32)
        last2 = (lens2 - (n2 - 1) * PAGE).astype(np.int32)
        w.plan(indptr2, indices2, last2, HQ, HK, D, PAGE)
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        sync()
        rec = compare(out, lse, golden(q, cache, indptr2, indices2, last2))
        rec["merges_after_replan"] = w.last_plan.num_merges
        # and back to the original lengths, same graph
        w.plan(indptr, indices, last, HQ, HK, D, PAGE)
        out.fill_(float("nan"))
        g.replay()
        sync()
        rec2 = compare(out, lse, golden(q, cache, indptr, indices, last))
        rec["ok_back_to_first_plan"] = rec2["ok"]
        rec["ok"] = bool(rec["ok"] and rec2["ok"])
        return rec
    except Exception:  # noqa: BLE001
        return dict(ok=False, error=traceback.format_exc()[-1500:])



def prefill_batch(qo, kv, seed: int, spare_pages: int):
    """A paged prefill batch: shuffled pages of a pool with ``spare_pages`` unused ones, fp16
    NHD cache and q on the device; (q, cache, qo_indptr, indptr, indices, last)."""
    n_pages = -(-kv // PAGE)
    pool = int(n_pages.sum()) + spare_pages
    indices = np.random.default_rng(seed).permutation(pool)[:int(n_pages.sum())].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    last = (kv - (n_pages - 1) * PAGE).astype(np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    gen = torch.Generator(device=DEV).manual_seed(9)
    cache = torch.randn((pool, 2, PAGE, HK, D), generator=gen, device=DEV, dtype=torch.float16)
    q = torch.randn((int(qo.sum()), HQ, D), generator=gen, device=DEV, dtype=torch.float16)
    return q, cache, qo_indptr, indptr, indices, last


def prefill_check() -> dict:
    res = {}
    qo = np.array([100, 1, 37, 300]) if not SIMULATOR else np.array([3, 1, 5])
    kv = np.array([2000, 5000, 37, 300]) if not SIMULATOR else np.array([20, 9, 5])
    q, cache, qo_indptr, indptr, indices, last = prefill_batch(qo, kv, seed=9, spare_pages=3)
    ws = torch.empty(WS_BYTES, dtype=torch.uint8, device=DEV)
    w = BatchPrefillWithPagedKVCacheWrapper(ws.numpy() if SIMULATOR else ws, "NHD",
                                            num_ctas=4 if SIMULATOR else 32)
    ref = R.batch_prefill_paged(q.cpu().numpy(), cache.cpu().numpy(), qo_indptr, indptr, indices, last,
                                causal=True, return_lse=True)
    for tc in ([False] if SIMULATOR else [False, True]):
        if left() < 25:
            res[f"tensor_cores={tc}"] = "skipped: time"
            continue
        try:
            t = time.time()
            w.plan(qo_indptr, indptr, indices, last, HQ, HK, D, PAGE, causal=True, tensor_cores=tc)
            o, lse = w.run(q, cache, return_lse=True)
            sync()
            if SIMULATOR:
                o, lse = torch.as_tensor(np.asarray(o)), torch.as_tensor(np.asarray(lse))
            rec = compare(o, lse, ref)
            rec.update(first_call_s=time.time() - t, merges=w.last_plan.num_merges)
            res[f"tensor_cores={tc}"] = rec
        except Exception:  # noqa: BLE001
            res[f"tensor_cores={tc}"] = dict(ok=False, error=traceback.format_exc()[-800:])
    res["ok"] = all(isinstance(v, dict) and v.get("ok") for v in res.values())
    return res




# ---------------------------------------------------------------------------
# Stage 3: the fit
# ---------------------------------------------------------------------------

def forced_time(w, lens, slots, limit, seed):
    """run() time of a forced plan (LPT placement, no item price) of decode ``lens`` on
    ``slots`` planner CTAs with chunk ``limit``; returns (us, plan)."""
    q, cache, indptr, indices, last = make_batch(lens, seed)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=DEV)
    w.plan(indptr, indices, last, HQ, HK, D, PAGE, schedule="lpt", num_ctas=slots, chunk_limit=int(limit),
           chunk_overhead=0.0)
    us, _ = bench(lambda: w.run(q, cache, out=out, lse=lse))
    return us, w.last_plan


def fit_stage(w, slots, records, checks):
    """Probes and the least-squares fit (benchmarks/fit_cost.py); returns the CostModel."""
    keys = (64, 256) if QUICK else (4096, 16384)
    stream, solo, merge_probes = [], [], []
    for k in keys:
        for n in ((1, 4) if QUICK else (1, 4, 16)):
            if n > 1 and k > keys[0] and not QUICK:
                n = 4 if n == 4 else None
            if n is None or left() < 30:
                continue
            lens = np.full(slots * n, k // n)
            us, p = forced_time(w, lens, slots, k // n, 11)
            assert p.num_partials == 0 and np.all(np.diff(p.cta_indptr) == n)
            stream.append((n, k, us))
            records.append(dict(case=dict(probe="stream", items_per_slot=n, keys_per_slot=k, slots=slots,
                                          batch=len(lens)), metric="kernel_us", value=us, unit="us"))
            log("probe stream", n, k, round(us, 1))
    k = keys[-1]
    for a in sorted({1, max(1, slots // 8), max(1, slots // 3), slots}):
        if left() < 30:
            break
        us, p = forced_time(w, np.full(a, k), slots, k, 12)
        solo.append((a, k, us))
        records.append(dict(case=dict(probe="solo", active=a, keys=k, slots=slots), metric="kernel_us",
                            value=us, unit="us"))
        log("probe solo", a, k, round(us, 1))
    piece = keys[0] // 8
    merge_runs = []
    for n_req, parts in ((1, 2), (1, 8), (1, min(32, slots)), (slots, 2)):
        if left() < 30:
            break
        lens = np.full(n_req, parts * piece)
        us, p = forced_time(w, lens, slots, piece, 13)
        merge_runs.append((p, us))
        records.append(dict(case=dict(probe="merge", requests=n_req, partials_per_merge=parts, piece=piece,
                                      slots=slots, merges=p.num_merges, partials=p.num_partials),
                            metric="kernel_us", value=us, unit="us"))
        log("probe merge", n_req, parts, round(us, 1))

    def merge_points(partial):
        m = CostModel(**partial, merge_cost=0.0, merge_launch=0.0, merge_total=0.0, search="plans", unit="us")
        pts = []
        for p, us in merge_runs:
            parts = int(np.diff(p.merge_indptr).max()) if p.num_merges else 0
            pts.append((GROUP * parts, p.num_partials, us, simulate_plan(p, m).makespan))
        return pts

    if len(stream) < 3 or len(solo) < 2:
        checks["fit"] = "not enough probes before the budget ran out: the default model stays"
        return None, {}
    cfg_min_blocks = 2   # the tensor-core shape of batch >= 16 (DecodeTuning.tc_shape); resident = slots
    model, resid = fit_cost.fit_decode(stream, solo, merge_points if len(merge_runs) >= 2 else None, slots,
                                       cfg_min_blocks, default_num_ctas())
    checks["fit_residuals"] = resid
    log("fit", model)
    return CostModel(**model), resid


def write_fit(out_dir, model, records, meta, commit, prefill=None):
    paths = (["decode_tc"] if model is not None else []) + (["prefill"] if prefill is not None else [])
    fit = CostFit(decode_tc=model if model is not None else DEFAULT_FIT.decode_tc,
                  prefill=prefill if prefill is not None else DEFAULT_FIT.prefill, gpu=meta["gpu"],
                  commit=commit, date=meta["date"],
                  source=("benchmarks/gpu_sched.py: decode_tc from the probes (stream, solo, merge) through the "
                          "decode wrapper, least squares (benchmarks/fit_cost.py fit_decode)"
                          + ("; prefill from the sweep's mixed steps under the fixed policies, two launches "
                             "(fit_cost.fit_prefill_model)" if prefill is not None else "")
                          + "; paths not in measured_paths keep the defaults (not measured)") if paths
                  else "not fitted: the budget ran out")
    obj = dict(meta, suite="cost_fit", records=records or [dict(case=dict(probe="none"), metric="kernel_us",
                                                                 value=0.0, unit="us")],
               fit=dict(fit.to_dict(), measured_paths=paths))
    with open(os.path.join(out_dir, "cost_fit.json"), "w") as f:
        json.dump(obj, f, indent=1, default=str)
    cost_fit_from_dict(obj["fit"])          # what was written loads back
    return fit


# ---------------------------------------------------------------------------
# Stage 4: the sweep
# ---------------------------------------------------------------------------

def padding_factor(lens) -> float:
    """Keys of the padded dense batch over the keys of the ragged one."""
    return float(len(lens) * int(np.max(lens)) / max(int(np.sum(lens)), 1))


def sdpa_peers(lens, qo_lens=None) -> dict:
    """SDPA flash and cuDNN on the padded dense batch (timing peers, padding not masked)."""
    res = {"padding_factor": padding_factor(lens)}
    if SIMULATOR or QUICK:
        return res
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, Lk = len(lens), int(np.max(lens))
    Lq = 1 if qo_lens is None else int(np.max(qo_lens))
    if 2 * B * HK * Lk * D * 2 > (24 << 30):
        res["skipped"] = "padded K/V over 24 GiB"
        return res
    try:
        q = torch.randn(B, HQ, Lq, D, device="cuda", dtype=torch.float16)
        k = torch.randn(B, HK, Lk, D, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        for name, backend in (("sdpa_flash_padded", SDPBackend.FLASH_ATTENTION),
                              ("sdpa_cudnn_padded", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                        q, k, v, enable_gqa=True, is_causal=qo_lens is not None and Lq > 1)
                    us, _ = bench(fn, iters=7, rep=3)
                res[name] = us
            except Exception as exc:  # noqa: BLE001
                res[name] = None
                res[name + "_error"] = repr(exc)[:160]
    finally:
        q = k = v = None
        torch.cuda.empty_cache()
    return res


def predict_baseline(lens, slots, chunk, model):
    qo = np.ones(len(lens), np.int64)
    if chunk is None:
        return simulate(qo, lens, slots, "one_per_cta", group=GROUP, tile_q=GROUP, cost=model).makespan
    return simulate(qo, lens, slots, "fixed_split", group=GROUP, tile_q=GROUP, cost=model,
                    chunk_size=int(chunk)).makespan


def decode_case(name, batch, w, slots, model, bw, records, checks, more=None):
    """One decode step under every policy (``more``: further wrapper policies, a name
    and the cost model its plan is made under)."""
    lens = decode_lens(name, batch, seed=100 + batch)
    q, cache, indptr, indices, last = make_batch(lens, 2)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=DEV)
    nbytes = decode_bytes(lens)
    case = dict(workload=name, batch=batch, total_kv=int(lens.sum()), max_kv=int(lens.max()), num_qo_heads=HQ,
                num_kv_heads=HK, head_dim=D, page_size=PAGE, dtype="f16", slots=slots)
    times, info = {}, {}
    for chunk in (None, *FIXED):
        key = "one_per_cta" if chunk is None else f"split_{(512, 1024, 2048, 4096)[FIXED.index(chunk)]}"
        if left() < 20:
            break
        try:
            fn, meta, _ = baseline_runner(q, cache, indptr, indices, last, out, lse, chunk)
            times[key], graphed = bench(fn)
            info[key] = dict(meta, graphed=graphed, chunk=chunk,
                             predicted_us=predict_baseline(lens, slots, chunk, model) if model else None)
        except Exception as exc:  # noqa: BLE001
            log(key, "failed", repr(exc)[:200])
    policies = {"lpt": dict(cost=model), "lpt_default": {}, "lpt_spec": dict(chunk_overhead=0.0, chunk_limit=None)}
    policies.update({k: dict(cost=m) for k, m in (more or {}).items()})
    for key, kw in policies.items():
        if left() < 20 or (key == "lpt" and model is None):
            continue
        w.plan(indptr, indices, last, HQ, HK, D, PAGE, schedule="lpt", **kw)
        p = w.last_plan
        times[key], graphed = bench(lambda: w.run(q, cache, out=out, lse=lse))
        info[key] = dict(num_ctas=p.num_ctas, items=p.num_items, partials=p.num_partials, merges=p.num_merges,
                         chunk_limit=p.chunk_limit, placement=p.placement, chunk_overhead=p.chunk_overhead,
                         graphed=graphed, plan_us=w.plan_seconds * 1e6,
                         predicted_us=simulate_plan(p, model).makespan if model else None)
    peers_sdpa = sdpa_peers(lens) if left() > 25 else {"skipped": "time", "padding_factor": padding_factor(lens)}
    sdpa = {k: v for k, v in peers_sdpa.items() if k.startswith("sdpa") and not k.endswith("error")}
    for key, us in times.items():
        extra = {k: v for k, v in info.get(key, {}).items() if v is not None and not isinstance(v, dict)}
        pred = info.get(key, {}).get("predicted_us")
        c = dict(case, policy=key, padding_factor=peers_sdpa["padding_factor"], **extra)
        if pred is not None:
            c["prediction_error"] = pred / us - 1
        peers = dict({k: v for k, v in times.items() if k != key}, **sdpa)
        records.append(dict(case=c, metric="latency_us", value=us, unit="us", peers=peers))
        if bw:
            records.append(dict(case=dict(case, policy=key), metric="bw_fraction",
                                value=nbytes / (us * 1e-6) / 1e9 / bw, unit="fraction of copy bw",
                                peers={k: (nbytes / (v * 1e-6) / 1e9 / bw if v else None) for k, v in sdpa.items()}))
        if pred is not None:
            records.append(dict(case=dict(case, policy=key), metric="predicted_us", value=pred, unit="us",
                                peers={"measured": us}))
    fixed = {k: v for k, v in times.items() if k == "one_per_cta" or k.startswith("split_")}
    if "lpt" in times and fixed:
        best = min(fixed, key=fixed.get)
        records.append(dict(case=dict(case, policy="lpt", baseline=best), metric="slowdown_vs_best_fixed",
                            value=times["lpt"] / fixed[best], unit="x",
                            peers={k: times[k] / fixed[best] for k in ("lpt_default", "lpt_spec") if k in times}))
    checks.setdefault("sdpa", {})[f"{name}_b{batch}"] = peers_sdpa
    log(name, batch, {k: round(v, 1) for k, v in times.items()})
    q = cache = out = lse = None
    if not SIMULATOR:
        torch.cuda.empty_cache()
    return times


def causal_flops(qo, kv) -> float:
    total = 0.0
    for a, b in zip(qo, kv):
        i = np.arange(int(a))
        total += float(np.sum(b - a + i + 1))
    return 4.0 * HQ * D * total


def mixed_case(batch, records, checks, capacity, bw, fixed_rows, prefill_model=None):
    """Mixed prefill + decode through the prefill wrapper (causal append).

    ``prefill_model`` None: the fixed policies (one request per CTA, splits), whose plans
    and times are appended to ``fixed_rows`` for the fit; else the LPT policies, ``lpt``
    under ``prefill_model`` (fitted to the fixed policies of every batch), ``lpt_default``
    with the wrapper's defaults, ``lpt_spec`` with the paper's limit."""
    qo, kv = mixed_lens(batch, seed=200 + batch)
    q, cache, qo_indptr, indptr, indices, last = prefill_batch(qo, kv, seed=9 + batch, spare_pages=0)
    ws = torch.empty(WS_BYTES, dtype=torch.uint8, device=DEV)
    w = BatchPrefillWithPagedKVCacheWrapper(ws.numpy() if SIMULATOR else ws, "NHD", num_ctas=capacity)
    flops = causal_flops(qo, kv)
    case = dict(workload="mixed", batch=batch, total_kv=int(kv.sum()), total_qo=int(qo.sum()), max_kv=int(kv.max()),
                num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PAGE, dtype="f16", causal=True,
                path="prefill wrapper")
    # The wrapper plans over one wave of CTAs per KV head (prefill_plan_ctas).
    if prefill_model is None:
        pols = {"one_per_cta": dict(chunk_limit=int(kv.max())),
                **{f"split_{n}": dict(chunk_limit=c) for n, c in zip((512, 1024, 2048, 4096), FIXED)}}
    else:
        pols = {"lpt": dict(chunk_limit="auto", cost=prefill_model), "lpt_default": dict(chunk_limit="auto"),
                "lpt_spec": dict(chunk_limit=None)}
    times, info = {}, {}
    for key, kw in pols.items():
        if left() < 20:
            break
        try:
            w.plan(qo_indptr, indptr, indices, last, HQ, HK, D, PAGE, causal=True, **kw)
            p = w.last_plan
            times[key], graphed = bench(lambda: w.run(q, cache))
            if not SIMULATOR and "prefill_resident_per_sm" not in checks:
                part, final, merge = w._bound_now[1]
                checks["prefill_resident_per_sm"] = dict(part=part.resident_per_sm(), final=final.resident_per_sm(),
                                                         merge=merge.resident_per_sm())
            info[key] = dict(num_ctas=p.num_ctas, items=p.num_items, partials=p.num_partials,
                             chunk_limit=p.chunk_limit, tile_q=p.tile_q, placement=p.placement, graphed=graphed)
            if prefill_model is None:
                fixed_rows.append(dict(path="prefill", policy=key, batch=batch, plan=p, t=times[key]))
            elif key == "lpt":
                info[key].update(predicted_us=p.predicted_makespan, model="fitted to the fixed policies")
        except Exception as exc:  # noqa: BLE001
            log("mixed", key, "failed", repr(exc)[:200])
            checks.setdefault("mixed_errors", {})[f"{key}_b{batch}"] = repr(exc)[:300]
    if prefill_model is None:
        peers_sdpa = sdpa_peers(kv, qo) if left() > 25 else {"skipped": "time", "padding_factor": padding_factor(kv)}
        checks.setdefault("sdpa", {})[f"mixed_b{batch}"] = peers_sdpa
    else:
        peers_sdpa = checks.get("sdpa", {}).get(f"mixed_b{batch}", {"padding_factor": padding_factor(kv)})
    sdpa = {k: v for k, v in peers_sdpa.items() if k.startswith("sdpa") and not k.endswith("error")}
    for key, us in times.items():
        peers = dict({k: v for k, v in times.items() if k != key}, **sdpa)
        c = dict(case, policy=key, padding_factor=peers_sdpa["padding_factor"], **info[key])
        if "predicted_us" in info[key]:
            c["prediction_error"] = info[key]["predicted_us"] / us - 1
        records.append(dict(case=c, metric="latency_us", value=us, unit="us", peers=peers))
        records.append(dict(case=dict(case, policy=key), metric="tflops", value=flops / (us * 1e-6) / 1e12,
                            unit="TFLOP/s", peers={k: (flops / (v * 1e-6) / 1e12 if v else None) for k, v in sdpa.items()}))
    log("mixed", batch, {k: round(v, 1) for k, v in times.items()})
    return times


# ---------------------------------------------------------------------------

def plan_times(model, slots) -> dict:
    """CPU time of nbattn.sched.plan() with the fitted model (the search included)."""
    res = {}
    for batch in (64, 1024):
        for name in ("uniform", "skewed"):
            lens = decode_lens(name, batch, seed=5)
            qo = np.ones(batch, np.int64)
            kw = dict(group=GROUP, tile_q=GROUP, cost=model, chunk_limit="auto")
            lpt_plan(qo, lens, slots, **kw)
            ts = []
            for _ in range(30 if not QUICK else 3):
                t = time.perf_counter()
                lpt_plan(qo, lens, slots, **kw)
                ts.append(time.perf_counter() - t)
            res[f"{name}_b{batch}"] = statistics.median(ts) * 1e6
    return res


def main(argv=None):
    global BUDGET_S
    ap = argparse.ArgumentParser(description="Scheduler cost fit and policy sweep in one GPU visit")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/nbattn_out"))
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--budget-s", type=float, default=300.0, help="wall-clock budget, compiles included")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (always on the simulator): a dry run")
    args = ap.parse_args(argv)
    BUDGET_S = float(args.budget_s)
    configure(args.quick)
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(2026)
    records, fit_records, checks = [], [], {"skipped": []}
    if not SIMULATOR:
        torch.zeros(1, device="cuda")
    dev = "simulator" if SIMULATOR else torch.cuda.get_device_name()
    capacity = default_num_ctas()
    versions = {"torch": torch.__version__, "numpy": np.__version__, "python": sys.version.split()[0]}
    try:
        versions["numba_cuda"] = __import__("numba_cuda").__version__
    except Exception:  # noqa: BLE001
        pass
    command = (f"COMMIT={args.commit} PYTHONPATH=$PWD python3 benchmarks/gpu_sched.py --out $OUT "
               f"--commit {args.commit} --budget-s {BUDGET_S:g}" + (" --quick" if QUICK else ""))
    meta = dict(gpu=dev, date=datetime.date.today().isoformat(), command=command, versions=versions,
                commit=args.commit, quick=QUICK)
    bw = copy_bandwidth()
    log("copy bandwidth GB/s", bw)
    state = dict(model=None)

    def save():
        obj = dict(meta, suite="sched", copy_bandwidth_GBps=bw, records=records or [
            dict(case=dict(stage="none"), metric="note", value=0.0, unit="")], checks=checks,
            cost_model=None if state["model"] is None else vars(state["model"]))
        with open(os.path.join(args.out, "sched.json"), "w") as f:
            json.dump(obj, f, indent=1, default=str)

    w = decode_wrapper(capacity)

    # -- 1. correctness of the default plan, poisoned outputs ------------------------
    skew = decode_lens("skewed", 64 if not QUICK else 8, 1)
    corr = {"skewed": skew, "variable_small": rng.integers(1, 4097 if not QUICK else 40, 16 if not QUICK else 6)}
    slots = None
    for name, lens in corr.items():
        q, cache, indptr, indices, last = make_batch(lens, 1)
        ref = golden(q, cache, indptr, indices, last)
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"), device=DEV)
        t = time.time()
        w.plan(indptr, indices, last, HQ, HK, D, PAGE, schedule="lpt")
        res = w.run(q, cache, out=out, lse=lse, return_lse=True)
        sync()
        o, l_ = (out, lse) if not SIMULATOR else res
        rec = compare(o, l_, ref)
        rec.update(first_call_s=time.time() - t, num_ctas=w.last_plan.num_ctas, merges=w.last_plan.num_merges,
                   items=w.last_plan.num_items)
        checks[f"correct_{name}_lpt_default"] = rec
        slots = slots or w.last_plan.num_ctas
        log("correctness", name, rec)
    checks["slots"] = slots
    save()

    # -- 2. determinism and CUDA graphs ---------------------------------------------
    if left() > 60:
        q, cache, indptr, indices, last = make_batch(skew, 3)
        w.plan(indptr, indices, last, HQ, HK, D, PAGE)
        first = as_host(w.run(q, cache)).clone()
        reps = 100 if not QUICK else 2
        same = sum(bool(torch.equal(as_host(w.run(q, cache)), first)) for _ in range(reps))
        w.plan(indptr, indices, last, HQ, HK, D, PAGE)
        again = bool(torch.equal(as_host(w.run(q, cache)), first))
        checks["bitwise_repeats"] = dict(runs=reps, equal=same, replan_equal=again)
        records.append(dict(case=dict(workload="skewed", policy="lpt_default", runs=reps),
                            metric="bitwise_equal_runs", value=float(same), unit="runs"))
        if not SIMULATOR:
            checks["cuda_graph_replan"] = graph_check(w, q, cache, indptr, indices, last, skew)
            records.append(dict(case=dict(workload="skewed->replanned", policy="lpt_default"),
                                metric="graph_replay_after_replan_ok",
                                value=float(checks["cuda_graph_replan"].get("ok", False)), unit="bool"))
        log("bitwise", checks["bitwise_repeats"], checks.get("cuda_graph_replan", {}).get("ok"))
        q = cache = None
        save()
    else:
        checks["skipped"].append("determinism")

    # -- 3. the fit --------------------------------------------------------------------
    model = None
    try:
        model, _ = fit_stage(w, slots, fit_records, checks)
    except Exception:  # noqa: BLE001
        checks["fit_error"] = traceback.format_exc()[-1500:]
        log("fit failed", checks["fit_error"][-300:])
    state["model"] = model
    write_fit(args.out, model, fit_records, dict(meta, copy_bandwidth_GBps=bw), args.commit)
    save()
    if model is not None:
        # the fitted plan is still right (poisoned outputs)
        q, cache, indptr, indices, last = make_batch(skew, 4)
        ref = golden(q, cache, indptr, indices, last)
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"), device=DEV)
        w.plan(indptr, indices, last, HQ, HK, D, PAGE, schedule="lpt", cost=model)
        res = w.run(q, cache, out=out, lse=lse, return_lse=True)
        sync()
        o, l_ = (out, lse) if not SIMULATOR else res
        checks["correct_skewed_lpt_fitted"] = dict(compare(o, l_, ref), chunk_limit=w.last_plan.chunk_limit,
                                                   placement=w.last_plan.placement)
        q = cache = None

    # -- 4. the sweep ------------------------------------------------------------------
    summary = []
    for batch in BATCHES:
        for name in ("skewed", "constant", "uniform", "zipf"):
            if left() < 30:
                checks["skipped"].append(f"{name}_b{batch}")
                continue
            try:
                summary.append((name, batch, decode_case(name, batch, w, slots, model, bw, records, checks)))
            except Exception:  # noqa: BLE001
                checks[f"error_{name}_b{batch}"] = traceback.format_exc()[-1500:]
                log("case failed", name, batch, checks[f"error_{name}_b{batch}"][-300:])
            save()
    # the mixed steps: fixed policies first, the prefill model fitted to them, then LPT under it
    fixed_rows, mixed_times, prefill_model = [], {}, None
    for stage in ("fixed", "lpt"):
        if stage == "lpt":
            try:
                f, prefill_model = fit_cost.fit_prefill_model(fixed_rows)
                checks["prefill_fit"] = dict(rms=f["rms"], records=len(f["errors"]), model=vars(prefill_model))
                log("prefill fit", checks["prefill_fit"])
                write_fit(args.out, model, fit_records, dict(meta, copy_bandwidth_GBps=bw), args.commit,
                          prefill=prefill_model)
            except Exception:  # noqa: BLE001
                checks["prefill_fit_error"] = traceback.format_exc()[-1500:]
                log("prefill fit failed", checks["prefill_fit_error"][-300:])
                break
        for batch in BATCHES:
            if left() < 40:
                checks["skipped"].append(f"mixed_{stage}_b{batch}")
                continue
            try:
                mixed_times.setdefault(batch, {}).update(mixed_case(batch, records, checks, capacity, bw, fixed_rows,
                                                                    prefill_model))
            except Exception:  # noqa: BLE001
                checks[f"error_mixed_{stage}_b{batch}"] = traceback.format_exc()[-1500:]
                log("mixed failed", checks[f"error_mixed_{stage}_b{batch}"][-300:])
            save()
    for batch, times in mixed_times.items():
        summary.append(("mixed", batch, times))
        fixed = {k: v for k, v in times.items() if k == "one_per_cta" or k.startswith("split_")}
        if "lpt" in times and fixed:
            best = min(fixed, key=fixed.get)
            records.append(dict(case=dict(workload="mixed", batch=batch, policy="lpt", baseline=best),
                                metric="slowdown_vs_best_fixed", value=times["lpt"] / fixed[best], unit="x",
                                peers={k: times[k] / fixed[best] for k in ("lpt_default", "lpt_spec") if k in times}))
    save()

    # -- 5. plan time ------------------------------------------------------------------
    if model is not None:
        pt = plan_times(model, slots)
        checks["plan_us_fitted_model"] = pt
        for k, v in pt.items():
            records.append(dict(case=dict(workload=k.rsplit("_b", 1)[0], batch=int(k.rsplit("_b", 1)[1]),
                                          policy="lpt", slots=slots, what="nbattn.sched.plan, CPU"),
                                metric="plan_us", value=v, unit="us"))
    if left() > 30:
        checks["prefill"] = prefill_check()
    else:
        checks["skipped"].append("prefill_check")
    save()

    print("\ncopy bandwidth GB/s:", None if bw is None else round(bw, 1))
    for name, batch, times in summary:
        fixed = {k: v for k, v in times.items() if k == "one_per_cta" or k.startswith("split_")}
        line = "  ".join(f"{k}={v:.1f}" for k, v in times.items())
        tail = f"  lpt/best fixed {times['lpt'] / min(fixed.values()):.3f}" if "lpt" in times and fixed else ""
        print(f"{name:9s} b{batch:<4d} {line}{tail}")
    print("checks:", json.dumps({k: (v.get("ok", v) if isinstance(v, dict) else v) for k, v in checks.items()
                                 if k not in ("sdpa", "fit_residuals")}, default=str)[:3000])
    print(f"total {time.time() - T0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
