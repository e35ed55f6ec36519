"""Run every teaching notebook's code cells top to bottom on the GPU.

Each notebook runs in a fresh Python process (as a student's kernel would), its
code cells executed in order in one namespace, with matplotlib's Agg backend.
Jupyter is not needed: where IPython is missing, ``IPython.display`` is a
small stand-in that prints what would be displayed.  The first failing cell
stops its notebook and is recorded with its error.

    PYTHONPATH=$PWD python3 benchmarks/gpu_notebooks.py --commit SHA [--out DIR]

writes ``<out>/notebooks_gpu.json`` (a result file: per notebook, metric ``ok``
(1 or 0), ``seconds`` and ``cells_run``; the failing cell's index and error are
in the ``ok`` record's case).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_STUB = '''
import sys, types
try:
    import IPython.display  # noqa: F401
except ImportError:
    ip = types.ModuleType("IPython"); disp = types.ModuleType("IPython.display")
    class Image:
        def __init__(self, *a, **k): self.args = (a, k)
        def __repr__(self): return f"<Image {self.args}>"
    disp.Image = Image
    disp.display = lambda *objs, **k: print(*objs)
    ip.display = disp
    ip.get_ipython = lambda: None          # matplotlib asks; None: not inside IPython
    ip.version_info = (8, 30, 0)
    sys.modules["IPython"] = ip; sys.modules["IPython.display"] = disp
import matplotlib
matplotlib.use("Agg")
'''

_RUNNER = '''
import json, sys, time, traceback
cells = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
exec(compile(STUB, "<stub>", "exec"), ns)
exec("from IPython.display import display", ns)      # a builtin inside Jupyter
report = {"cells": len(cells), "cells_run": 0, "failed_cell": -1, "error": ""}
t0 = time.perf_counter()
for i, src in enumerate(cells):
    try:
        exec(compile(src, f"<cell {i}>", "exec"), ns)
    except BaseException:
        report["failed_cell"] = i
        report["error"] = traceback.format_exc(limit=-6)[-3000:]
        break
    report["cells_run"] = i + 1
report["seconds"] = time.perf_counter() - t0
print("@@REPORT@@" + json.dumps(report))
'''


def code_cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def run_notebook(path: Path, tmp: Path, timeout: float) -> dict:
    cells_file = tmp / (path.stem + ".cells.json")
    cells_file.write_text(json.dumps(code_cells(path)))
    script = tmp / "run_cells.py"
    script.write_text(f"STUB = {_STUB!r}\n" + _RUNNER)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               MPLBACKEND="Agg")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(script), str(cells_file)], cwd=ROOT / "notebooks", env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"cells": -1, "cells_run": -1, "failed_cell": -1, "error": f"timed out after {timeout} s",
                "seconds": time.perf_counter() - t0, "wall": time.perf_counter() - t0}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("@@REPORT@@")), None)
    if line is None:
        rep = {"cells": -1, "cells_run": -1, "failed_cell": -1,
               "error": f"rc={proc.returncode}: {proc.stderr[-3000:]}", "seconds": 0.0}
    else:
        rep = json.loads(line[len("@@REPORT@@"):])
    rep["wall"] = time.perf_counter() - t0
    rep["stderr_tail"] = proc.stderr[-1500:]
    rep["grid_warnings"] = (proc.stderr + proc.stdout).count("will likely result in GPU under-utilization")
    return rep


def _numba_cuda_version() -> str:
    try:
        from importlib.metadata import version
        return version("numba-cuda")
    except Exception:  # noqa: BLE001
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", required=True, help="the nbattn commit being run (recorded in the file)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/nbattn_out"), help="directory for the result file")
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds per notebook")
    ap.add_argument("--jobs", type=int, default=6, help="notebooks run at once (one process each)")
    ap.add_argument("--only", nargs="*", default=None, help="notebook name prefixes (e.g. 03 06)")
    args = ap.parse_args(argv)

    import numba
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT))
    from nbattn.perf import results

    tmp = Path(args.out) / "nb_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    paths = [p for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
             if not args.only or any(p.name.startswith(o) for o in args.only)]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:     # each notebook is its own process
        reports = list(pool.map(lambda p: run_notebook(p, tmp, args.timeout), paths))
    recs = []
    ok_all = True
    for path, rep in zip(paths, reports):
        ok = rep["failed_cell"] == -1 and rep["cells_run"] == rep["cells"]
        ok_all &= ok
        print(f"{path.name}: {'ok' if ok else 'FAILED'} ({rep['cells_run']}/{rep['cells']} cells, "
              f"{rep['wall']:.1f} s)", flush=True)
        if not ok:
            print(rep["error"], rep.get("stderr_tail", ""), sep="\n", flush=True)
        case = {"notebook": path.stem, "failed_cell": rep["failed_cell"], "error": rep["error"][-600:]}
        recs.append({"case": case, "metric": "ok", "value": 1.0 if ok else 0.0, "unit": "bool"})
        recs.append({"case": {"notebook": path.stem}, "metric": "seconds", "value": round(rep["wall"], 2),
                     "unit": "s"})
        recs.append({"case": {"notebook": path.stem}, "metric": "grid_size_warnings",
                     "value": rep.get("grid_warnings", 0), "unit": "count"})
        recs.append({"case": {"notebook": path.stem}, "metric": "cells_run", "value": rep["cells_run"],
                     "unit": "cells"})
    results.write_suite(
        "notebooks_gpu", recs, gpu=torch.cuda.get_device_name(),
        command=f"PYTHONPATH=$PWD python3 benchmarks/gpu_notebooks.py --commit {args.commit}",
        versions={"nbattn_commit": args.commit, "numba": numba.__version__, "numpy": np.__version__,
                  "numba_cuda": _numba_cuda_version(), "torch": torch.__version__,
                  "python": platform.python_version()},
        date=datetime.date.today().isoformat(), root=args.out)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
