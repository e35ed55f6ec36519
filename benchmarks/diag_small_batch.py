"""Where the decode wrapper's LPT plans lose to a fixed split at batch 16 (issue 21), a
diagnosis on the GPU; also where plan() spends its host time (issue 16).

    PYTHONPATH=$PWD python3 benchmarks/diag_small_batch.py --out $OUT --commit <sha>

For each step (the sweep's lengths, ``gpu_sched.decode_lens``) and a chunk size, runs
of the *same items*:

* ``fixed``: the FlashDecoding baseline of ``gpu_sched.py`` (one CTA per item, the
  split merge only when a request is split);
* ``wrapper``: the decode wrapper's ``run()`` with an LPT plan forced to that chunk
  size over the sweep's 33 planner CTAs per head block;
* ``wrapper_no_merge``: the same bound decode launch without the merge launch
  (diagnosis only: right only where the plan has no partials);
* ``wrapper_split``: the wrapper's ``schedule="split"``;
* ``wrapper_auto``: the wrapper's default plan (``schedule="auto"``).

Each is timed in CUDA-graph replays (``gpu_sched.bench``), and the kernels of 20 eager
calls are read with ``torch.profiler`` (device time per kernel name).  ``plan()`` of the
decode wrapper at batch 64 and 1024 runs under ``cProfile``; the top entries are written
as text.  Writes ``diag_small_batch.json`` and ``plan_profile.txt``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_sched as G  # noqa: E402
from _timing import host_us  # noqa: E402

import torch  # noqa: E402



STEPS = (("constant", 16, 4096), ("zipf", 16, 1024), ("skewed", 16, 2048), ("uniform", 16, 4096),
         ("zipf", 64, 2048))


def kernel_times(fn, calls=20):
    """Device microseconds per call of each kernel name over ``calls`` eager calls."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t:
            out[e.key[:80]] = dict(us_per_call=t / calls, count=e.count / calls)
    return out


def step(name, batch, chunk, w, slots):
    lens = G.decode_lens(name, batch, seed=100 + batch)
    q, cache, indptr, indices, last = G.make_batch(lens, 2)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=G.DEV)
    res = dict(workload=name, batch=batch, chunk=chunk, max_kv=int(lens.max()), total_kv=int(lens.sum()))
    fixed, meta, _ = G.baseline_runner(q, cache, indptr, indices, last, out, lse, chunk)
    w.plan(indptr, indices, last, G.HQ, G.HK, G.D, G.PAGE, schedule="lpt", num_ctas=slots, chunk_limit=int(chunk),
           chunk_overhead=0.0)
    p = w.last_plan
    run = lambda: w.run(q, cache, out=out, lse=lse)  # noqa: E731
    run()
    dec, merge, ix = w._bound_now

    def no_merge():        # run()'s decode launch alone, on torch's current stream (q, cache, out bound above)
        dec(torch.cuda.current_stream().cuda_stream)

    res["plan"] = dict(items=p.num_items, partials=p.num_partials, merges=p.num_merges, num_ctas=p.num_ctas,
                       fixed_items=meta["items"], fixed_partials=meta["partials"])
    times = {"fixed": G.bench(fixed)[0], "wrapper": G.bench(run)[0], "wrapper_no_merge": G.bench(no_merge)[0]}
    kern = {"fixed": kernel_times(fixed), "wrapper": kernel_times(run)}
    fixed()
    torch.cuda.synchronize()
    a = out.clone()
    run()
    torch.cuda.synchronize()
    res["max_abs_diff_wrapper_vs_fixed"] = float((out.float() - a.float()).abs().max())
    w.plan(indptr, indices, last, G.HQ, G.HK, G.D, G.PAGE, schedule="split")
    sp = w.last_plan
    run_split = lambda: w.run(q, cache, out=out, lse=lse)  # noqa: E731
    times["wrapper_split"] = G.bench(run_split)[0]
    kern["wrapper_split"] = kernel_times(run_split)
    res["split_plan"] = dict(items=sp.num_items, partials=sp.num_partials)
    w.plan(indptr, indices, last, G.HQ, G.HK, G.D, G.PAGE)          # what a user gets: schedule="auto"
    res["auto_mode"] = w._mode
    times["wrapper_auto"] = G.bench(run_split)[0]
    res["us"], res["kernels"] = times, kern
    G.log(name, batch, chunk, {k: round(v, 1) for k, v in times.items()}, res["plan"])
    for k, v in kern.items():
        G.log("   ", k, {n[:40]: round(x["us_per_call"], 1) for n, x in v.items()})
    return res


def plan_profile(path):
    rng = np.random.default_rng(5)
    text = io.StringIO()
    from nbattn import layout as L
    for batch in (64, 1024):
        pkv = L.PagedKV.allocate(rng.integers(1, 8192, size=batch), 16, rng=rng)
        w = G.decode_wrapper(G.default_num_ctas())
        fn = lambda: w.plan(pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len,  # noqa: E731
                            32, 8, 128, 16)
        text.write(f"batch {batch}: plan() median {host_us(fn, 100):.1f} us over 100 calls\n")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(100):
            fn()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        text.write(s.getvalue())
    # the staging write alone: 1 MB of page ids into the pinned image and into pageable memory
    from numba import cuda
    from nbattn.cuda.host import hostwork as HW
    src = rng.integers(0, 1 << 20, size=262144).astype(np.int32)
    offsets = np.array([0], np.int64)
    for name, host in (("pinned", cuda.pinned_array(262144 + 4096, np.int32)),
                       ("pageable", np.zeros(262144 + 4096, np.int32))):
        for what, fn in (("stage_arrays", lambda: HW.stage_arrays(host, offsets, (src,), 4096)),  # noqa: B023
                         ("np.copyto", lambda: np.copyto(host[:262144], src))):             # noqa: B023
            text.write(f"{what} of 1 MB into {name} memory: median {host_us(fn, 200, 1):.1f} us\n")
    with open(path, "w") as f:
        f.write(text.getvalue())
    print("\n".join(ln for ln in text.getvalue().splitlines() if "median" in ln))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/nbattn_out"))
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args(argv)
    G.configure(False)
    G.BUDGET_S = 1e9
    os.makedirs(args.out, exist_ok=True)
    torch.zeros(1, device="cuda")
    capacity = G.default_num_ctas()
    w = G.decode_wrapper(capacity)
    slots = 33
    rec = dict(gpu=torch.cuda.get_device_name(), commit=args.commit, date=time.strftime("%Y-%m-%d"),
               command=f"PYTHONPATH=$PWD python3 benchmarks/diag_small_batch.py --out $OUT --commit {args.commit}",
               steps=[])
    for name, batch, chunk in STEPS:
        try:
            rec["steps"].append(step(name, batch, chunk, w, slots))
        except Exception as exc:  # noqa: BLE001
            rec["steps"].append(dict(workload=name, batch=batch, error=repr(exc)[:300]))
            G.log("failed", name, batch, repr(exc)[:300])
        with open(os.path.join(args.out, "diag_small_batch.json"), "w") as f:
            json.dump(rec, f, indent=1, default=str)
    plan_profile(os.path.join(args.out, "plan_profile.txt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
