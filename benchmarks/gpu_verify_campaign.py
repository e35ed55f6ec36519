"""The GPU campaign of ``nbattn verify``: several seeds side by side, one process
each, merged into ``benchmarks/results/verify.json`` (GPU only).

    PYTHONPATH=$PWD python3 benchmarks/gpu_verify_campaign.py --commit SHA \\
        [--seeds 1 2 3 4] [--cases 3000] [--per-config 120] [--time-budget 300] [--out DIR]
        [--job SEED:CASES:KERNEL,KERNEL ...]

``--job`` runs one process on a kernel subset with its own case count (repeat
it; it replaces ``--seeds``): the decode-side kernels compile in seconds and
can run thousands of cases in the time one prefill process compiles its tiles.

On a GPU the cost of a campaign is compiling each new kernel configuration, so
every process draws few configurations with many cases each (``--per-config``);
the seeds give the campaign its spread of configurations.  Each process gets
its own numba cache directory (no two compilers write one file).

The result file has one record per kernel: metric ``mismatches`` (count), with
``cases`` in the case; a record ``kernel: all`` with the totals; and one record
per failing case (metric ``failure``) with its configuration, what differed
and the command line that reproduces it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def failure_records(fails: list) -> list:
    """One result record per failing case (metric ``failure``)."""
    recs = []
    for f in fails:
        cfg = f.get("config") or {}
        nan_case = (f.get("case_inputs") or {}).get("nan_case")
        recs.append({"case": {"seed": f.get("seed"), "case": f.get("case"), **{k: cfg[k] for k in sorted(cfg)},
                              "nan_case": bool(nan_case) if nan_case is not None else None,
                              "detail": str(f.get("detail", ""))[:300], "reproduce": f.get("reproduce", "")},
                     "metric": "failure", "value": 1.0, "unit": "case"})
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", required=True, help="the nbattn commit being run (recorded in the file)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--cases", type=int, default=3000, help="cases per seed")
    ap.add_argument("--per-config", type=int, default=120, help="cases per configuration")
    ap.add_argument("--time-budget", type=float, default=300.0, help="seconds per seed process")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/nbattn_out"), help="directory for the result files")
    ap.add_argument("--job", action="append", default=[],
                    help="SEED:CASES:KERNELS, one process on a comma-separated kernel subset (repeatable)")
    args = ap.parse_args(argv)
    jobs = []
    for j in args.job:
        seed, cases, kernels = j.split(":", 2)
        jobs.append((int(seed), int(cases), kernels))
    if not jobs:
        jobs = [(s, args.cases, None) for s in args.seeds]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="nbattn_verify_"))
    procs = []
    t0 = time.time()
    for s, n_cases, kernels in jobs:
        env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp / f"cache{s}"),
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "nbattn.verify", "--seed", str(s), "--cases", str(n_cases),
               "--per-config", str(args.per_config), "--time-budget", str(args.time_budget),
               "--no-progress", "--out", str(tmp / f"seed{s}.json")] + (["--kernel", kernels] if kernels else [])
        log = open(tmp / f"seed{s}.log", "w")
        procs.append((s, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), log))
    reports = []
    for s, p, log in procs:
        rc = p.wait()
        log.close()
        path = tmp / f"seed{s}.json"
        if path.exists():
            reports.append(json.loads(path.read_text()))
        else:                                   # a process that died is a failure, not a silent gap
            reports.append({"seed": s, "cases_run": 0, "mismatches": 1, "per_kernel": {}, "configurations": 0,
                            "failures": [{"detail": f"process exit {rc}: " + (tmp / f"seed{s}.log").read_text()[-2000:]}]})
        print((tmp / f"seed{s}.log").read_text()[-600:], flush=True)

    import numba
    import numpy as np
    import torch

    from nbattn.perf.results import write_suite

    kernels: dict = {}
    for rep in reports:
        for k, pk in rep.get("per_kernel", {}).items():
            agg = kernels.setdefault(k, {"cases": 0, "mismatches": 0, "worst_error_ratio": 0.0})
            agg["cases"] += pk["cases"]
            agg["mismatches"] += pk["mismatches"]
            agg["worst_error_ratio"] = max(agg["worst_error_ratio"], pk["worst_error_ratio"])
    configs = {rep["seed"]: rep.get("configurations", 0) for rep in reports}
    records = [{"case": {"kernel": k, "cases": v["cases"], "worst_error_ratio": round(v["worst_error_ratio"], 4)},
                "metric": "mismatches", "value": float(v["mismatches"]), "unit": "count"}
               for k, v in sorted(kernels.items())]
    total_cases = sum(r.get("cases_run", 0) for r in reports)
    total_bad = sum(r.get("mismatches", 0) for r in reports)
    records.append({"case": {"kernel": "all", "cases": total_cases, "configurations": sum(configs.values()),
                             "seeds": " ".join(str(s) for s, _, _ in jobs), "per_config": args.per_config,
                             "cases_skipped_for_time": sum(r.get("cases_skipped_for_time", 0) for r in reports),
                             "seconds": round(time.time() - t0, 1)},
                    "metric": "mismatches", "value": float(total_bad), "unit": "count"})
    records += failure_records([dict(f, seed=r.get("seed")) for r in reports for f in r.get("failures", [])])
    which = (" ".join(f"--job {s}:{n}:{k}" for s, n, k in jobs) if args.job
             else f"--seeds {' '.join(map(str, args.seeds))} --cases {args.cases}")
    cmd = ("PYTHONPATH=$PWD python3 benchmarks/gpu_verify_campaign.py --commit " + args.commit
           + f" {which} --per-config {args.per_config} --time-budget {args.time_budget:g}")
    path = write_suite("verify", records, gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "CUDA simulator", command=cmd,
                       versions={"nbattn_commit": args.commit, "numba": numba.__version__,
                                 "numpy": np.__version__, "torch": torch.__version__,
                                 "python": platform.python_version()}, root=out)
    print(f"wrote {path}: {total_cases} cases, {sum(configs.values())} configurations, {total_bad} mismatches")
    return 1 if total_bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
