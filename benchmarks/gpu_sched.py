"""One GPU session for the scheduler's run side (issue 5).

    PYTHONPATH=$PWD python3 benchmarks/gpu_sched.py        # writes $OUT/sched.json

1. Correctness first: :class:`BatchDecodeWithPagedKVCacheWrapper` against the
   golden model (outputs poisoned with NaN, every element checked) on the
   skewed batch and a variable batch; a prefill wrapper check at the end if
   time is left.
2. Kernel time (CUDA events around CUDA-graph replays of 10 calls, warm-up,
   median of 15) of three policies on the same inputs (fp16, head_dim 128,
   32 query / 8 KV heads, page 16):
     * ``one_per_cta``  -- one CTA per request, no split (``split_work(lens, None)``);
     * ``split_<n>``    -- FlashDecoding fixed KV chunks of n tokens, one CTA per
       chunk, merged in KV order (``split_work``; ``split_auto`` is the decode
       module's own heuristic ``choose_chunk``);
     * ``lpt``          -- the wrapper's default plan (persistent decode + fixed-grid
       merge): C = one resident wave of CTAs per KV head, a per-item price,
       ``chunk_limit="auto"``; ``lpt_spec_*`` -- the scheduler's base rule exactly
       (no price, L = ceil(W/C)) on that C and on one CTA per SM per KV head.
   The decode kernel's per-item price is fitted in the same run
   (``item_overhead_tokens``).
   Workloads: skewed (1 x 32k + 63 x 512), long-variable (64 x uniform
   8k-32k), constant (64 x 4k).
3. Plan time (CPU, this run) vs run time; break-even ``L*(u-v) > p+h``
   for L = 32 layers (h = 0: the wrapper adds no per-layer work).
4. 100 repeated runs bitwise equal; run() captured in a CUDA graph and replayed
   after a new plan() with different lengths.
5. Device-to-device copy bandwidth (1 GiB) in the same run.

On the simulator (no GPU) it runs tiny shapes end to end as a dry run.
"""
from __future__ import annotations

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
from nbattn.sched import plan as lpt_plan

from _timing import graph_ms  # noqa: E402  (benchmarks/ is the script's folder)

OUT = os.environ.get("OUT", "/tmp/nbattn_out")
T0 = time.time()
BUDGET_S = float(os.environ.get("NBATTN_BUDGET_S", "200"))
DEV = "cpu" if SIMULATOR else "cuda"
HQ, HK, D, PAGE = (32, 8, 128, 16) if not SIMULATOR else (4, 2, 16, 4)
LAYERS = 32
WS_BYTES = (256 << 20) if not SIMULATOR else (1 << 20)


def left() -> float:
    return BUDGET_S - (time.time() - T0)


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def sync():
    if not SIMULATOR:
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------

def workloads(rng):
    if SIMULATOR:
        return {"skewed": np.array([64] + [4] * 7), "constant": np.full(8, 16),
                "long_variable": rng.integers(16, 48, 8)}
    return {"skewed": np.array([32768] + [512] * 63), "constant": np.full(64, 4096),
            "long_variable": rng.integers(8192, 32769, 64)}


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


def golden(q, cache, indptr, indices, last):
    return R.batch_decode_paged(q.cpu().numpy(), cache.cpu().numpy(), indptr, indices, last,
                                return_lse=True)


def compare(o, lse, ref, tol=3e-3) -> dict:
    o = o.float().cpu().numpy()
    lse = lse.cpu().numpy()
    ro, rl = ref
    fin = np.isfinite(rl)
    err_o = float(np.abs(o - ro).max())
    err_l = float(np.abs(lse[fin] - rl[fin]).max()) if fin.any() else 0.0
    ok = (not np.isnan(o).any() and not np.isnan(lse).any() and np.allclose(o, ro, atol=tol, rtol=tol)
          and np.array_equal(np.isneginf(lse), np.isneginf(rl)) and err_l < tol)
    return dict(ok=bool(ok), max_abs_err_o=err_o, max_abs_err_lse=err_l,
                unwritten=int(np.isnan(o).sum()))


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------

def bench(fn, iters=15, rep=10):
    """Median microseconds per call and whether it was graphed: CUDA-graph
    replays of `rep` calls (:func:`_timing.graph_ms`) on a GPU; one wall-clock
    call on the simulator."""
    if SIMULATOR:
        fn()
        sync()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6, False
    ms, graphed = graph_ms(fn, iters, rep, log=log)
    return ms * 1e3, graphed


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


# ---------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------

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


def lpt_wrapper(num_ctas):
    ws = torch.empty(WS_BYTES, dtype=torch.uint8, device=DEV)
    if SIMULATOR:
        ws = ws.numpy()
    return BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", num_ctas=num_ctas)


def lpt_policies(sms):
    """name -> keyword arguments of wrapper.plan().  ``lpt`` is the wrapper's
    default (C = one resident wave, per-item price, chunk_limit="auto"); the
    ``lpt_spec_*`` rows are the scheduler's base rule exactly (no item price,
    L = ceil(W/C)) on that C and on one CTA per SM per KV head, as in session 1."""
    if SIMULATOR:
        return {"lpt": {}, "lpt_spec_C4": dict(num_ctas=4, chunk_overhead=0.0, chunk_limit=None)}
    return {"lpt": {},
            "lpt_spec_resident": dict(chunk_overhead=0.0, chunk_limit=None),
            f"lpt_spec_C{sms}": dict(num_ctas=sms, chunk_overhead=0.0, chunk_limit=None)}


def plan_time_us(w, indptr, indices, last, lens, kw, runs=30):
    """Median wall time of wrapper.plan() (planner + copies into the workspace)
    and of the planner alone, with the plan's own settings."""
    full, core = [], []
    for _ in range(runs):
        t = time.perf_counter()
        w.plan(indptr, indices, last, HQ, HK, D, PAGE, **kw)
        full.append(time.perf_counter() - t)
        p = w.last_plan
        t = time.perf_counter()
        lpt_plan(np.ones(len(lens), np.int64), lens, p.num_ctas, tile_q=HQ // HK, group=HQ // HK,
                 chunk_overhead=p.chunk_overhead, chunk_limit=kw.get("chunk_limit", "auto"))
        core.append(time.perf_counter() - t)
    return statistics.median(full) * 1e6, statistics.median(core) * 1e6


def plan_profile(w, indptr, indices, last, runs=20) -> list:
    """Where wrapper.plan() spends its time (cProfile, cumulative, top entries)."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(runs):
        w.plan(indptr, indices, last, HQ, HK, D, PAGE)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(14)
    return [line for line in text.getvalue().splitlines() if line.strip()][-16:]


def item_overhead_fit(q, cache, indptr, indices, last, out, lse, plan_ctas):
    """The decode kernel's fixed price per work item, in KV tokens: the same
    64 x 4096 keys on ``plan_ctas`` (= 64) planner CTAs, cut into n = 1, 4, 16, 64
    items per CTA (forced chunk limits); kernel time T(n) = a + b*n, and the
    price is b / (a / 4096) tokens (b: us per item, a / 4096: us per token of
    one CTA's stream).  Decode kernel only: the merge pass is not timed."""
    meta = [torch.from_numpy(x).to(DEV) for x in (indptr, indices, last)]
    p = DEC.prepare_decode(q, cache, *meta, return_lse=True, out=out, lse=lse)
    lens = p.kv_lens
    per_cta = int(lens.sum()) // plan_ctas
    up = lambda a: cuda.to_device(np.ascontiguousarray(a, np.int32))  # noqa: E731
    ns, ts = [], []
    for n in (1, 4, 16, 64):
        limit = max(1, per_cta // n)
        pl = lpt_plan(np.ones(len(lens), np.int64), lens, plan_ctas, tile_q=HQ // HK, group=HQ // HK,
                      chunk_limit=limit)
        work = DEC.WorkList(up(pl.cta_indptr), up(pl.request), up(pl.kv_start), up(pl.kv_end),
                            up(pl.out_slot))
        slots = max(pl.num_partials, 1)
        po = cuda.device_array((slots, HQ, D), np.float32)
        pls = cuda.device_array((slots, HQ), np.float32)

        def run(work=work, po=po, pls=pls):
            if not SIMULATOR:
                p.stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
            DEC.run_decode_work(p, work, po, pls)
        us, _ = bench(run)
        ns.append(float(np.diff(pl.cta_indptr).max()))
        ts.append(us)
    b, a = np.polyfit(ns, ts, 1)
    return dict(items_per_cta=ns, kernel_us=ts, us_per_item=float(b), us_fixed=float(a),
                tokens_per_cta=per_cta, overhead_tokens=float(b / (a / per_cta)) if a > 0 else None)


# ---------------------------------------------------------------------------

def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(2026)
    records, checks, table = [], {}, []
    if not SIMULATOR:
        torch.zeros(1, device="cuda")
    dev = "simulator" if SIMULATOR else torch.cuda.get_device_name()
    sms = default_num_ctas()
    policies = lpt_policies(sms)
    primary = "lpt"
    versions = {"torch": torch.__version__, "numpy": np.__version__, "python": sys.version.split()[0]}
    try:
        versions["numba_cuda"] = __import__("numba_cuda").__version__
    except Exception:  # noqa: BLE001
        pass

    bw = copy_bandwidth()
    log("copy bandwidth GB/s", bw)

    def save():
        obj = {"suite": "sched", "gpu": dev, "date": datetime.date.today().isoformat(),
               "command": "PYTHONPATH=$PWD python3 benchmarks/gpu_sched.py", "versions": versions,
               "copy_bandwidth_GBps": bw, "records": records, "checks": checks}
        with open(os.path.join(OUT, "sched.json"), "w") as f:
            json.dump(obj, f, indent=1, default=str)

    wrappers = {name: lpt_wrapper(sms) for name in policies}

    # -- 1. correctness vs golden, poisoned outputs ------------------------------------
    wl = workloads(rng)
    corr_cases = {"skewed": wl["skewed"],
                  "variable_small": rng.integers(1, 4097 if not SIMULATOR else 40, 16)}
    for name, lens in corr_cases.items():
        q, cache, indptr, indices, last = make_batch(lens, 1)
        ref = golden(q, cache, indptr, indices, last)
        for c, w in wrappers.items():
            out = torch.full_like(q, float("nan"))
            lse = torch.full(q.shape[:2], float("nan"), device=DEV)
            t = time.time()
            w.plan(indptr, indices, last, HQ, HK, D, PAGE, **policies[c])
            res = w.run(q, cache, out=out, lse=lse, return_lse=True)
            sync()
            first = time.time() - t
            if SIMULATOR:
                out, lse = res
            rec = compare(out, lse, ref)
            rec.update(first_call_s=first, num_ctas=w.last_plan.num_ctas, merges=w.last_plan.num_merges,
                       items=w.last_plan.num_items)
            checks[f"correct_{name}_{c}"] = rec
            log("correctness", name, c, rec)
        del q, cache
    save()

    # -- 4. determinism and CUDA graphs ---------------------------------------------------
    if left() > 30:
        lens = wl["skewed"]
        q, cache, indptr, indices, last = make_batch(lens, 3)
        w = wrappers[primary]
        w.plan(indptr, indices, last, HQ, HK, D, PAGE)
        first = w.run(q, cache)
        first = (first if not SIMULATOR else torch.as_tensor(np.asarray(first))).clone()
        reps = 100 if not SIMULATOR else 2
        same = 0
        for _ in range(reps):
            o = w.run(q, cache)
            o = o if not SIMULATOR else torch.as_tensor(np.asarray(o))
            same += bool(torch.equal(o, first))
        w.plan(indptr, indices, last, HQ, HK, D, PAGE)   # a fresh plan of the same lengths
        o = w.run(q, cache)
        o = o if not SIMULATOR else torch.as_tensor(np.asarray(o))
        checks["bitwise_repeats"] = dict(runs=reps, equal=same, replan_equal=bool(torch.equal(o, first)))
        records.append(dict(case=dict(workload="skewed", policy=primary, runs=reps),
                            metric="bitwise_equal_runs", value=float(same), unit="runs"))
        log("bitwise", checks["bitwise_repeats"])
        if not SIMULATOR:
            checks["cuda_graph_replan"] = graph_check(w, q, cache, indptr, indices, last, lens)
            log("graph", checks["cuda_graph_replan"])
            records.append(dict(case=dict(workload="skewed->replanned", policy=primary),
                                metric="graph_replay_after_replan_ok",
                                value=float(checks["cuda_graph_replan"].get("ok", False)), unit="bool"))
        del q, cache
        save()

    # -- 2./3. timing of the policies, plan time, break-even ---------------------------
    for name, lens in wl.items():
        if left() < 40:
            log("skip", name, "(time)")
            checks[f"skipped_{name}"] = "time"
            continue
        q, cache, indptr, indices, last = make_batch(lens, 2)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], device=DEV)
        nbytes = 2 * D * (len(lens) * HQ * 2 + 2 * int(lens.sum()) * HK)
        case = dict(workload=name, batch=len(lens), total_kv=int(lens.sum()), max_kv=int(lens.max()),
                    num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PAGE, dtype="f16")
        times, info = {}, {}
        for chunk in (None, "auto", 1024, 4096):
            key = "one_per_cta" if chunk is None else f"split_{chunk}"
            try:
                fn, meta, _ = baseline_runner(q, cache, indptr, indices, last, out, lse, chunk)
                if chunk is not None and meta["chunk"] is None:
                    continue          # the heuristic chose not to split: same as one_per_cta
                times[key], _ = bench(fn)
                info[key] = meta
            except Exception as exc:  # noqa: BLE001
                log(key, "failed", repr(exc)[:200])
        for key, w in wrappers.items():
            w.plan(indptr, indices, last, HQ, HK, D, PAGE, **policies[key])
            times[key], graphed = bench(lambda w=w: w.run(q, cache, out=out, lse=lse))
            pl = w.last_plan
            info[key] = dict(num_ctas=pl.num_ctas, items=pl.num_items, partials=pl.num_partials,
                             merges=pl.num_merges, chunk_limit=pl.chunk_limit,
                             chunk_overhead=pl.chunk_overhead, graphed=graphed)
            p_full, p_core = plan_time_us(w, indptr, indices, last, lens, policies[key],
                                          runs=30 if not SIMULATOR else 2)
            info[key].update(plan_us=p_full, planner_only_us=p_core)
            if key == primary and name == "long_variable":
                checks["plan_profile"] = plan_profile(w, indptr, indices, last)
        if name == "constant" and left() > 40:
            # one planner CTA per request (64 <= one resident wave): n items of 4096/n keys each
            fit = item_overhead_fit(q, cache, indptr, indices, last, out, lse, len(lens))
            checks["item_overhead_fit"] = fit
            log("item overhead fit", fit)
            if fit["overhead_tokens"] is not None:
                records.append(dict(case=dict(case, policy="forced_chunks", items_per_cta=fit["items_per_cta"],
                                              kernel_us=fit["kernel_us"],
                                              planner_chunk_overhead=wrappers[primary].last_plan.chunk_overhead),
                                    metric="item_overhead_tokens", value=fit["overhead_tokens"], unit="KV tokens"))
        for key, us in times.items():
            peers = {k: v for k, v in times.items() if k != key}
            records.append(dict(case=dict(case, policy=key, **{k: v for k, v in info.get(key, {}).items()
                                                               if v is not None}),
                                metric="latency_us", value=us, unit="us", peers=peers))
            if bw:
                records.append(dict(case=dict(case, policy=key), metric="bw_fraction",
                                    value=nbytes / (us * 1e-6) / 1e9 / bw, unit="fraction of copy bw"))
        lpt = primary
        base = times.get("one_per_cta")
        best_other = min(v for k, v in times.items() if not k.startswith("lpt"))
        best_all = min(times.values())
        if lpt in times and base:
            records.append(dict(case=dict(case, policy=lpt, baseline="one_per_cta"), metric="speedup",
                                value=base / times[lpt], unit="x",
                                peers={k: base / v for k, v in times.items() if k != lpt}))
            records.append(dict(case=dict(case, policy=lpt, baseline="best_policy"),
                                metric="slowdown_vs_best", value=times[lpt] / best_all, unit="x"))
            p_us = info[lpt]["plan_us"]
            for bname, u in (("one_per_cta", base), ("best_non_lpt", best_other)):
                gain = u - times[lpt]
                records.append(dict(case=dict(case, policy=lpt, baseline=bname, layers=LAYERS, h_us=0.0,
                                              u_us=u, v_us=times[lpt], p_us=p_us),
                                    metric="break_even_net_us", value=LAYERS * gain - p_us, unit="us",
                                    peers={}))
                records.append(dict(case=dict(case, policy=lpt, baseline=bname), metric="break_even_layers",
                                    value=(p_us / gain) if gain > 0 else -1.0, unit="layers (-1: never)"))
            records.append(dict(case=dict(case, policy=lpt), metric="plan_us", value=p_us, unit="us",
                                peers={"planner_only": info[lpt]["planner_only_us"]}))
        table.append((name, times, info))
        log(name, {k: round(v, 1) for k, v in times.items()})
        q = cache = out = lse = None      # free the batch (rebinding, not del: see copy_bandwidth)
        if not SIMULATOR:
            torch.cuda.empty_cache()
        save()

    # -- 5. prefill wrapper vs golden (if time is left) -----------------------------------
    if left() > 30:
        checks["prefill"] = prefill_check()
        log("prefill", checks["prefill"])
    save()

    # -- table ------------------------------------------------------------------------------
    print("\ncopy bandwidth GB/s:", None if bw is None else round(bw, 1))
    for name, times, info in table:
        lpt = times.get(primary)
        base = times.get("one_per_cta")
        print(f"{name:14s} " + "  ".join(f"{k}={v:8.1f}us" for k, v in times.items()))
        if lpt and base:
            i = info[primary]
            print(f"{'':14s} LPT(C={i['num_ctas']}, L={i['chunk_limit']}) speedup vs one_per_cta "
                  f"{base / lpt:.2f}x, vs best {min(times.values()) / lpt:.3f}x, plan {i['plan_us']:.0f}us")
    print("checks:", json.dumps({k: (v.get("ok", v) if isinstance(v, dict) else v)
                                 for k, v in checks.items()}, default=str))
    print(f"total {time.time() - T0:.0f}s")


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


def prefill_check() -> dict:
    res = {}
    qo = np.array([100, 1, 37, 300]) if not SIMULATOR else np.array([3, 1, 5])
    kv = np.array([2000, 5000, 37, 300]) if not SIMULATOR else np.array([20, 9, 5])
    n_pages = -(-kv // PAGE)
    pool = int(n_pages.sum()) + 3
    rng = np.random.default_rng(9)
    indices = rng.permutation(pool)[:int(n_pages.sum())].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    last = (kv - (n_pages - 1) * PAGE).astype(np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    gen = torch.Generator(device=DEV).manual_seed(9)
    cache = torch.randn((pool, 2, PAGE, HK, D), generator=gen, device=DEV, dtype=torch.float16)
    q = torch.randn((int(qo.sum()), HQ, D), generator=gen, device=DEV, dtype=torch.float16)
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


if __name__ == "__main__":
    main()
