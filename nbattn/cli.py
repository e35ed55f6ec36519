"""nbattn's command line: ``nbattn demo | figures | doctor | bench | verify``.

Run ``nbattn <command> --help`` for the options of one command.
"""
from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from datetime import date, datetime
from pathlib import Path

import numpy as np

# The source checkout around this package; a wheel install has none (no
# benchmarks/ scripts beside it).
REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "benchmarks"


# ---------------------------------------------------------------------------
# demo: a three-request paged batch through the golden model
# ---------------------------------------------------------------------------

def dense_pool_attention(q, cache, qo_indptr, pkv, causal=True):
    """Brute force without gathering: every query scores every slot of the
    whole page pool (float64), and a dense boolean mask keeps the request's
    valid, causally visible slots."""
    num_pages, _, ps, hkv, d = cache.shape
    keys = cache[:, 0].reshape(num_pages * ps, hkv, d).astype(np.float64)
    vals = cache[:, 1].reshape(num_pages * ps, hkv, d).astype(np.float64)
    hq = q.shape[1]
    g = hq // hkv
    out = np.zeros(q.shape, np.float64)
    for r in range(pkv.batch_size):
        pages, slots = pkv.token_slots(r)
        flat = pages.astype(np.int64) * ps + slots            # slot of logical token t
        rows = range(int(qo_indptr[r]), int(qo_indptr[r + 1]))
        nq, nk = len(rows), len(flat)
        for i, row in enumerate(rows):
            mask = np.zeros(num_pages * ps, bool)
            visible = flat[: nk - nq + i + 1] if causal else flat
            mask[visible] = True
            for h in range(hq):
                s = keys[:, h // g] @ q[row, h].astype(np.float64) / np.sqrt(d)
                s[~mask] = -np.inf
                w = np.exp(s - s.max())
                out[row, h] = w @ vals[:, h // g] / w.sum()
    return out


def cmd_demo(args) -> int:
    from . import reference as R
    from .plots.layout import causal_visibility, spec4_batch

    qo_indptr, pkv = spec4_batch()
    rng = np.random.default_rng(args.seed)
    heads, kv_heads, d = 4, 2, 16
    cache = rng.standard_normal((pkv.num_pages, 2, pkv.page_size, kv_heads, d)).astype(np.float32)
    q = rng.standard_normal((int(qo_indptr[-1]), heads, d)).astype(np.float32)
    print("three requests, page size", pkv.page_size)
    print("  qo_indptr            ", qo_indptr.tolist())
    print("  paged_kv_indptr      ", pkv.paged_kv_indptr.tolist())
    print("  paged_kv_indices     ", pkv.paged_kv_indices.tolist())
    print("  paged_kv_last_page_len", pkv.paged_kv_last_page_len.tolist())
    print("  KV lengths           ", pkv.kv_lens.tolist())
    page, slot = pkv.locate(2, 5)
    print(f"  R2 token 5 lives in page {int(page)}, slot {int(slot)}")
    page, slot = pkv.locate(2, int(pkv.kv_lens[2]) - 1)
    print(f"  R2's last token lives in page {int(page)}, slot {int(slot)}")
    for r, m in enumerate(causal_visibility(qo_indptr, pkv.kv_lens)):
        print(f"  R{r} visible keys per query row (causal): {m.sum(axis=1).tolist()}")
    o = R.batch_prefill_paged(q, cache, qo_indptr, pkv.paged_kv_indptr, pkv.paged_kv_indices,
                              pkv.paged_kv_last_page_len, causal=True)
    ref = dense_pool_attention(q, cache, qo_indptr, pkv)
    err = float(np.abs(o - ref).max())
    print(f"  golden model vs dense brute force over the whole pool: max |diff| = {err:.2e}")
    return 0 if err < 1e-4 else 1


# ---------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------

def cmd_figures(args) -> int:
    from . import figures
    from .perf import results

    root = Path(args.results) if args.results else results.default_results_root()
    found = sorted(p.stem for p in root.glob("*.json")) if root.is_dir() else []
    if found:
        print(f"measured results: {root} ({len(found)} files)")
    else:
        print(f"nbattn figures: no result files in {root}; every figure is drawn from its model "
              "alone and says \"no measured data yet\" (give --results DIR)", file=sys.stderr)
    paths = figures.build_all(outdir=args.out, results_root=root, progress=not args.quiet)
    print(f"wrote {len(paths)} figures to {Path(args.out).resolve()}")
    return 0


# ---------------------------------------------------------------------------
# doctor
# ---------------------------------------------------------------------------

def cmd_doctor(args) -> int:
    from . import doctor

    print(doctor.report())
    return 0


# ---------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------

GPU_SUITES = ["gpu_decode.py", "gpu_prefill.py", "gpu_prefill_cc.py", "gpu_sched.py"]


def bench_golden_cpu(batch=8, q_len=1024, kv_len=1024, heads=8, head_dim=128, repeats=3):
    """Golden batch prefill FLOP/s beside NumPy's own matmul FLOP/s, same run."""
    from . import reference as R

    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch * q_len, heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((batch * kv_len, heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((batch * kv_len, heads, head_dim)).astype(np.float32)
    qo = np.arange(0, batch * q_len + 1, q_len, dtype=np.int32)
    kv = np.arange(0, batch * kv_len + 1, kv_len, dtype=np.int32)
    R.batch_prefill_ragged(q[:q_len], k[:kv_len], v[:kv_len], qo[:2], kv[:2])  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        R.batch_prefill_ragged(q, k, v, qo, kv)
        times.append(time.perf_counter() - t)
    flops = 4.0 * batch * q_len * kv_len * head_dim * heads
    golden = flops / float(np.median(times))
    # NumPy's matmul at the same operand shapes the golden model uses: [g*Q, D] x [D, K]
    a = rng.standard_normal((heads, q_len, head_dim)).astype(np.float32)
    b = rng.standard_normal((heads, head_dim, kv_len)).astype(np.float32)
    np.matmul(a, b)
    mt = []
    for _ in range(max(5, repeats)):
        t = time.perf_counter()
        np.matmul(a, b)
        mt.append(time.perf_counter() - t)
    matmul = 2.0 * heads * q_len * head_dim * kv_len / float(np.median(mt))
    return golden, matmul


def fresh_bench_dir(base: Path | None = None) -> Path:
    """A new, empty folder ``nbattn-bench-<date>-<time>[-n]`` under ``base`` (default: here)."""
    base = Path.cwd() if base is None else Path(base)
    stem = f"nbattn-bench-{datetime.now():%Y%m%d-%H%M%S}"
    for n in range(1000):
        path = base / (stem if n == 0 else f"{stem}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"no free folder name {stem}-N under {base}")


def bench_out_dir(args) -> Path | None:
    """Where this bench run writes: ``--update-results`` -> the checkout's
    ``benchmarks/results``; ``--out DIR``; else a fresh folder.  None (with a
    message) when ``--update-results`` is asked outside a checkout."""
    if args.update_results:
        if not BENCH_DIR.is_dir():
            print("nbattn bench: --update-results rewrites benchmarks/results/ of a source "
                  "checkout, and this install has none; use --out DIR", file=sys.stderr)
            return None
        return BENCH_DIR / "results"
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        return out
    return fresh_bench_dir()


def cmd_bench(args) -> int:
    import nbattn
    suites = [BENCH_DIR / s for s in GPU_SUITES if (BENCH_DIR / s).exists()]
    if not args.cpu and not suites:
        print(f"nbattn bench: the GPU benchmark scripts are not installed (looked in {BENCH_DIR}); "
              "they live in benchmarks/ of the source repository: run nbattn bench from a clone "
              "(pip install -e .), or use `nbattn bench --cpu`", file=sys.stderr)
        return 2
    if not args.cpu and nbattn.simulator_enabled():
        print("nbattn bench: no CUDA GPU here (the CUDA simulator cannot be timed); "
              "run it on a GPU machine, or use `nbattn bench --cpu`", file=sys.stderr)
        return 2
    out = bench_out_dir(args)
    if out is None:
        return 2
    if args.cpu:
        case = {"batch": 8, "q_len": 1024, "kv_len": 1024, "heads": 8, "head_dim": 128}
        golden, matmul = bench_golden_cpu(**case)
        ratio = golden / matmul
        print(f"golden batch prefill: {golden / 1e9:.1f} GFLOP/s; NumPy matmul: {matmul / 1e9:.1f} GFLOP/s; "
              f"ratio {ratio:.2f}")
        from .perf import results
        path = results.write_suite(
            "golden_cpu", root=out, gpu="none (CPU)", date=str(date.today()),
            command="nbattn bench --cpu",
            versions={"numpy": np.__version__, "python": platform.python_version()},
            copy_bandwidth_GBps=None,
            records=[{"case": case, "metric": "gflops", "value": golden / 1e9, "unit": "GFLOP/s",
                      "peers": {"numpy_matmul": matmul / 1e9}},
                     {"case": case, "metric": "fraction_of_matmul", "value": ratio, "unit": "ratio", "peers": {}}])
        print(f"wrote {path}")
        return 0
    import os

    from tqdm import tqdm
    # Each suite script writes <suite>.json into $OUT.
    env = dict(os.environ, OUT=str(out), PYTHONPATH=str(REPO))
    failed = []
    for script in tqdm(suites, desc="GPU suites", unit="suite"):
        if subprocess.call([sys.executable, str(script)], cwd=REPO, env=env) != 0:
            failed.append(script.name)
    print(f"result files written to {out.resolve()}")
    if failed:
        print(f"nbattn bench: failed suites: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    """The ``nbattn`` parser: one block per subcommand."""
    import nbattn

    p = argparse.ArgumentParser(prog="nbattn", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"nbattn {nbattn.__version__}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND",
                           help="what to do (nbattn COMMAND --help for its options)")

    d = sub.add_parser("demo", help="a three-request paged batch through the golden model, "
                       "checked against a dense brute force")
    d.add_argument("--seed", type=int, default=0, help="seed of the random Q/K/V (default 0)")
    d.set_defaults(fn=cmd_demo)

    f = sub.add_parser("figures", help="draw every figure (models and measured results)")
    f.add_argument("--out", default="figures",
                   help="folder the PNGs are written to (default ./figures)")
    f.add_argument("--results", default=None,
                   help="folder of result files (*.json) to draw measured data from (default: "
                   "benchmarks/results of the checkout, else the copy installed with nbattn)")
    f.add_argument("--quiet", action="store_true", help="no progress bar")
    f.set_defaults(fn=cmd_figures)

    doc = sub.add_parser("doctor", help="versions, CUDA driver, NVVM, GPU or simulator, kernel cache "
                         "(never fails)")
    doc.set_defaults(fn=cmd_doctor)

    b = sub.add_parser("bench", help="run the GPU benchmark suites, or time the golden model (--cpu)")
    b.add_argument("--cpu", action="store_true",
                   help="time the golden model against NumPy's matmul instead (no GPU needed)")
    where = b.add_mutually_exclusive_group()
    where.add_argument("--out", default=None,
                       help="folder for the result files (default: a new nbattn-bench-<date>-<time> "
                       "folder here)")
    where.add_argument("--update-results", action="store_true",
                       help="overwrite the committed benchmarks/results/ of this checkout")
    b.set_defaults(fn=cmd_bench)

    v = sub.add_parser("verify", add_help=False,
                       help="differential test of every kernel against the golden model (nbattn verify --help)")
    v.set_defaults(fn=None)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args, rest = p.parse_known_args(argv)
    if args.cmd == "verify":
        from .verify import main as verify_main
        return verify_main(rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
