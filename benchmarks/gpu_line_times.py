"""Where one public call's host time goes, statement by statement (GPU only; diagnosis,
not a result file).

    PYTHONPATH=$PWD python3 benchmarks/gpu_line_times.py [--out DIR]

cProfile cannot see time spent in ctypes driver calls or in numba-compiled host
functions (neither is a Python-level call), so it charges them to the caller.  This
script instead recompiles the body of the function under study with a
``perf_counter`` reading after every statement of its top level (and of the top
level of each ``with`` block), calls it many times as a user would (torch CUDA
tensors, NumPy page tables), and prints the median microseconds of each statement.
Writes ``<out>/line_times.txt``.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_eager as E  # noqa: E402
import nbattn.cuda as NC  # noqa: E402
from nbattn.cuda import decode, decode_call, decode_wrapper, plan_run  # noqa: E402


class _Stamp(ast.NodeTransformer):
    """Put ``__T.append((line, perf_counter()))`` after each statement of a body."""

    def stamp(self, body):
        out = []
        for st in body:
            if isinstance(st, (ast.With,)):
                st.body = self.stamp(st.body)
            out.append(st)
            if not isinstance(st, (ast.Return, ast.Raise)):
                out.append(ast.parse(f"__T.append(({st.lineno}, __pc()))").body[0])
        return out


def timed(func, module):
    """``func`` recompiled with a time stamp after each top-level statement; the stamps
    go to the list ``timed.T`` (first entry: the entry time)."""
    src = textwrap.dedent(inspect.getsource(func))
    first = func.__code__.co_firstlineno
    tree = ast.parse(src)
    fn = tree.body[0]
    fn.decorator_list = []
    fn.body = [ast.parse("__T.append((0, __pc()))").body[0]] + _Stamp().stamp(fn.body)
    ast.fix_missing_locations(tree)
    ns = dict(vars(module))
    T: list = []
    ns["__T"], ns["__pc"] = T, time.perf_counter
    exec(compile(tree, f"<timed {func.__qualname__}>", "exec"), ns)
    lines = src.splitlines()
    return ns[fn.name], T, lines, first


def report(name, call, func, module, setattr_on, n, out):
    """Time ``call()`` with ``func`` replaced by its stamped copy on every object of
    ``setattr_on`` (a module that imported it by name holds its own reference)."""
    f, T, lines, first = timed(func, sys.modules[func.__module__])
    targets = setattr_on if isinstance(setattr_on, (list, tuple)) else [setattr_on]
    origs = [getattr(t, func.__name__) for t in targets]
    for t in targets:
        setattr(t, func.__name__, f)
    try:
        call()
        torch.cuda.synchronize()
        per: dict = {}
        totals = []
        for i in range(n):
            T.clear()
            t0 = time.perf_counter()
            call()
            totals.append(time.perf_counter() - t0)
            for (l0, a), (l1, b) in zip(T, T[1:]):
                per.setdefault(l1, []).append(b - a)
            if i % 20 == 19:
                torch.cuda.synchronize()
    finally:
        for t, o in zip(targets, origs):
            setattr(t, func.__name__, o)
    out.write(f"\n##### {name}: median {statistics.median(totals) * 1e6:.1f} us per call ({n} calls)\n")
    for line, ts in sorted(per.items()):
        us = statistics.median(ts) * 1e6
        text = lines[line - 1].strip() if line else "(entry)"
        out.write(f"{us:8.2f} us  L{line + first - 1:<4d} {text[:100]}\n")
    print("timed", name, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/nbattn_out"))
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = open(Path(args.out) / "line_times.txt", "w")
    for batch, kv_len, hkv in ((1, 32768, 8), (64, 4096, 8)):
        q, cache, meta, pkv, _ = E.decode_case(batch, kv_len, hkv, gen)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = NC.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(*meta, E.HQ, hkv, E.D, E.PS)
        tag = f"b{batch} x {kv_len} g{E.HQ // hkv}"
        report(f"{tag} plain: fast_decode", lambda: NC.batch_decode_paged(q, cache, *meta),
               decode_call.fast_decode, decode_call, [decode_call, decode], 300, out)
        plan = type(w).__mro__[[c.__name__ for c in type(w).__mro__].index("BatchDecodeWithPagedKVCacheWrapper")]
        report(f"{tag} run", lambda: w.run(q, cache), plan.run, decode_wrapper, plan, 300, out)
        report(f"{tag} run: _run_inputs", lambda: w.run(q, cache), plan_run.PlanRunWrapper._run_inputs,
               plan_run, plan_run.PlanRunWrapper, 300, out)
        report(f"{tag} plan", lambda: w.plan(*meta, E.HQ, hkv, E.D, E.PS), plan.plan, decode_wrapper, plan,
               200, out)
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
