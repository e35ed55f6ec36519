"""Is the decode planner better under the model refitted to the wrapper's own step
times than under the committed fit?  (Issue 21: LPT lost to the best fixed split by
7% at skewed batch 16 and 6% at constant batch 16.)

    COMMIT=<sha> PYTHONPATH=$PWD python3 benchmarks/gpu_sched_refit_ab.py --out $OUT --commit <sha>
    PYTHONPATH=$PWD python3 benchmarks/gpu_sched_refit_ab.py --quick --out /tmp/x   # dry run

The refit is ``fit_cost.fit_decode_records`` on the wrapper records of
``benchmarks/results/sched.json`` (``fit_cost.py --analyse`` prints it, with its error
out of sample), given the committed fit's resident CTAs.  For the four decode
workloads of ``gpu_sched.py`` at batch 16 and 64 it times, in one process and with
``gpu_sched.decode_case``: the fixed policies, the wrapper under the committed fit
(``lpt``), under the refit (``lpt_refit``), its default plan and the paper's rule,
beside SDPA on the padded batch.  Before that the refit's plan of a skewed batch is
checked against the golden model with outputs poisoned with NaN.  Writes
``$OUT/sched_refit_ab.json`` (suite ``sched``, the same record layout).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_sched as G  # noqa: E402  (benchmarks/ is the script's folder)
import fit_cost  # noqa: E402
import torch
from nbattn.sched.cost import load_cost_fit

RESULTS = Path(__file__).resolve().parent / "results"


def refit_model(committed):
    """The decode model fitted to the committed sweep's wrapper steps."""
    d = json.loads((RESULTS / "sched.json").read_text())
    rows = [r for r in fit_cost.rebuild_sweep(d, committed) if r["path"] == "wrapper"]
    model, rms, _ = fit_cost.fit_decode_records(rows)
    return model.replace(ctas_per_sm=committed.ctas_per_sm, sm_count=committed.sm_count), rms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/nbattn_out"))
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    G.BUDGET_S = args.budget_s
    G.configure(args.quick)
    os.makedirs(args.out, exist_ok=True)
    committed = load_cost_fit(RESULTS / "cost_fit.json").decode_tc
    refit, rms = refit_model(committed)
    G.log("refit", vars(refit), f"in-sample rms {rms:.3f}")
    bw = G.copy_bandwidth()
    w = G.decode_wrapper(G.default_num_ctas())
    records, checks = [], {"skipped": [], "refit_in_sample_rms": rms}
    obj = dict(gpu="simulator" if G.SIMULATOR else torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
               commit=args.commit, quick=G.QUICK, suite="sched", copy_bandwidth_GBps=bw,
               command=f"COMMIT={args.commit} PYTHONPATH=$PWD python3 benchmarks/gpu_sched_refit_ab.py --out $OUT "
                       f"--commit {args.commit}", cost_model=vars(committed), refit_model=vars(refit),
               records=records, checks=checks)

    def save():
        (Path(args.out) / "sched_refit_ab.json").write_text(json.dumps(obj, indent=1, default=str))

    # the refit's plan is right (poisoned outputs, golden model)
    lens = G.decode_lens("skewed", 16 if not G.QUICK else 8, 1)
    q, cache, indptr, indices, last = G.make_batch(lens, 1)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=G.DEV)
    w.plan(indptr, indices, last, G.HQ, G.HK, G.D, G.PAGE, schedule="lpt", cost=refit)
    res = w.run(q, cache, out=out, lse=lse, return_lse=True)
    G.sync()
    checks["correct_skewed_lpt_refit"] = dict(G.compare(*((out, lse) if not G.SIMULATOR else res),
                                                        G.golden(q, cache, indptr, indices, last)),
                                              chunk_limit=w.last_plan.chunk_limit)
    G.log("correctness", checks["correct_skewed_lpt_refit"])
    save()
    slots = w.last_plan.num_ctas
    summary = []
    for batch in ((16, 64) if not G.QUICK else (8,)):
        for name in ("skewed", "constant", "uniform", "zipf"):
            if G.left() < 30:
                checks["skipped"].append(f"{name}_b{batch}")
                continue
            times = G.decode_case(name, batch, w, slots, committed, bw, records, checks, more={"lpt_refit": refit})
            summary.append((name, batch, times))
            save()
    for name, batch, times in summary:
        fixed = {k: v for k, v in times.items() if k == "one_per_cta" or k.startswith("split_")}
        best = min(fixed, key=fixed.get) if fixed else None
        ratio = {k: round(times[k] / fixed[best], 3) for k in ("lpt", "lpt_refit", "lpt_default") if k in times and best}
        records.append(dict(case=dict(workload=name, batch=batch, baseline=best), metric="slowdown_vs_best_fixed",
                            value=ratio.get("lpt_refit"), unit="x", peers=ratio))
        print(f"{name:9s} b{batch:<3d} best fixed {best} {fixed.get(best, float('nan')):.1f} us  {ratio}")
    save()
    print(f"total {time.time() - G.T0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
