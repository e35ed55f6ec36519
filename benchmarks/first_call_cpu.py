"""The first compiled call of a new process, with and without
:func:`nbattn._jit.import_without_scipy` (numba's arraymath imported without
SciPy's BLAS probe), on the machine it runs on.

Each sample is a fresh process that imports the planner and times its first call
(the planner's compiled code comes from numba's on-disk cache; one warm-up
process fills it).  The two forms alternate, ``--reps`` processes each; the form
without the hook replaces it with a no-op before the call.  Only meaningful
where SciPy is installed (without it there is nothing to skip).

    PYTHONPATH=$PWD python3 benchmarks/first_call_cpu.py [--reps 7] [--out FILE] [--commit SHA]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys

PROBE = """
import sys, time, importlib
import numpy as np
if sys.argv[1] == "off":
    import nbattn._jit as J
    J.import_without_scipy = lambda module: None
plan = importlib.import_module("nbattn.sched.plan")
qo, kv = np.ones(64, np.int64), np.arange(1, 65, dtype=np.int64) * 100
t = time.perf_counter()
plan.plan_lengths(qo, kv, 33, tile_q=4, group=4, chunk_limit="auto")
print(time.perf_counter() - t, "scipy.linalg" in sys.modules)
"""


def _scipy_version() -> str | None:
    if importlib.util.find_spec("scipy") is None:
        return None
    out = subprocess.run([sys.executable, "-c", "import scipy; print(scipy.__version__)"], capture_output=True,
                         text=True)
    return out.stdout.strip() or None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args(argv)
    res = {"commit": args.commit, "python": platform.python_version(), "cpu": platform.processor() or "unknown",
           "scipy": _scipy_version(), "first_call_s": {"on": [], "off": []},
           "scipy_linalg_imported": {}}
    subprocess.run([sys.executable, "-c", PROBE, "on"], check=True, capture_output=True)      # fill the cache
    for _ in range(args.reps):
        for form in ("off", "on"):
            out = subprocess.run([sys.executable, "-c", PROBE, form], check=True, capture_output=True, text=True)
            secs, linalg = out.stdout.split()
            res["first_call_s"][form].append(float(secs))
            res["scipy_linalg_imported"][form] = linalg == "True"
    res["median_s"] = {k: statistics.median(v) for k, v in res["first_call_s"].items()}
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
