"""compute-sanitizer sweep over small cases of every kernel family and path (GPU only).

    PYTHONPATH=$PWD python3 benchmarks/gpu_sanitizer.py                 # all families, all four tools
    PYTHONPATH=$PWD python3 benchmarks/gpu_sanitizer.py --family decode_tc --tool racecheck

For each (family, tool) a child process runs the family's small cases under
``compute-sanitizer --tool <tool>``; the parent reads the tool's summary line
(``ERROR SUMMARY: N errors`` for memcheck, initcheck and synccheck;
``RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)`` for racecheck)
and writes ``benchmarks/results/sanitizer.json`` in the result-file format of
:mod:`nbattn.perf.results`: one record per (family, tool), metric
``sanitizer_errors`` (count), with the hazard count as a peer for racecheck.
Host API errors are in that summary too; those of the driver binding's entry-point probes
(``cuGetProcAddress`` answering CUDA_ERROR_INVALID_VALUE for a symbol this driver lacks) are
taken out of the count and recorded as the peer ``api_probes``, every other one counts.
A child that fails outside the sanitizer's findings (exception, no summary)
is recorded with value -1 and its log tail in the case, so it cannot pass
silently.

Each family first runs once without the sanitizer to fill its own numba cache
directory (compiling is the slow part, and it is host work the sanitizer does
not look at); the sanitized children then load those kernels from the cache.
compute-sanitizer instruments a kernel when its module is loaded, so every
kernel's first launch is still checked.  Children run ``--jobs`` at a time;
``--deadline`` stops starting new ones, and the file is rewritten after each
child, so a run cut short keeps what it checked (missing pairs are listed in
the run's output, never recorded as clean).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")


# ---------------------------------------------------------------------------
# The child: small cases of one family
# ---------------------------------------------------------------------------

def _paged(rng, torch, dtype, lens, page, hk, d, layout="NHD"):
    import numpy as np
    n = [-(-int(x) // page) for x in lens]
    pool = sum(n) + 2
    perm = rng.permutation(pool).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    indices = perm[: sum(n)].copy()
    last = np.array([0 if k == 0 else int(x) - (k - 1) * page for k, x in zip(n, lens)], np.int32)
    shape = (pool, 2, page, hk, d) if layout == "NHD" else (pool, 2, hk, page, d)
    cache = torch.randn(shape, device="cuda", dtype=dtype)
    return cache, indptr, indices, last


def run_family(family: str) -> None:
    import numpy as np
    import torch

    import nbattn  # noqa: F401
    import nbattn.cuda as C
    from nbattn import layout as L
    from nbattn.cuda import merge as M
    from nbattn.cuda.tuning import DECODE, MERGE
    from numba import cuda

    rng = np.random.default_rng(0)
    f16 = torch.float16
    hk, group, d = 2, 4, 128
    hq = hk * group
    lens = [37, 0, 300, 5]

    def q_of(rows, dtype=f16, dd=d):
        return torch.randn((rows, hq, dd), device="cuda", dtype=dtype)

    if family.startswith("decode_") and family != "decode_split_merge":
        tuning = DECODE.replace(path=family.split("_", 1)[1])
        for dtype, layout, var in ((f16, "NHD", {}), (torch.bfloat16, "HND", {"window_left": 64}),
                                   (f16, "NHD", {"logits_soft_cap": 30.0})):
            if tuning.path == "smem" or dtype != torch.float32:
                cache, ip, ix, la = _paged(rng, torch, dtype, lens, 16, hk, d, layout)
                C.batch_decode_paged(q_of(len(lens), dtype), cache, ip, ix, la, kv_layout=layout,
                                     return_lse=True, tuning=tuning, **var)
        if tuning.path == "smem":
            cache, ip, ix, la = _paged(rng, torch, torch.float32, lens, 3, hk, 64)
            C.batch_decode_paged(q_of(len(lens), torch.float32, 64), cache, ip, ix, la, use_sigmoid=True,
                                 tuning=tuning)
    elif family == "decode_split_merge":
        cache, ip, ix, la = _paged(rng, torch, f16, [4000, 17], 16, hk, d)
        C.batch_decode_paged(q_of(2), cache, ip, ix, la, return_lse=True)      # long request: split + merge
        v = torch.randn((5, 7, hq, d), device="cuda", dtype=f16)
        s = torch.randn((5, 7, hq), device="cuda", dtype=torch.float32)
        C.merge_states(v, s)
        mmap = M.MergeMap(*(cuda.to_device(np.asarray(x, np.int32)) for x in ([0, 7, 14], [1, 0], np.arange(14))))
        po, pl = cuda.to_device(rng.standard_normal((14, hq, d), np.float32)), cuda.to_device(
            rng.standard_normal((14, hq), np.float32))
        for few in (False, True):       # the two-pass and the one-round split-KV merge
            M.run_merge_partials(po, pl, mmap, cuda.device_array((2, hq, d), np.uint16),
                                 cuda.device_array((2, hq), np.float32), code="f16", max_partials=7,
                                 tuning=MERGE.replace(few_form=few))
        C.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
        C.merge_state_in_place(v[:, 0].contiguous(), s[:, 0].contiguous(), v[:, 1].contiguous(),
                               s[:, 1].contiguous(), mask=torch.tensor([1, 0, 1, 1, 0], dtype=torch.bool))
    elif family.startswith(("prefill_cuda_core_d", "prefill_tensor_core_d")):
        # one head dim per family, so the families compile side by side
        tc = family.startswith("prefill_tensor_core")
        dd = int(family.rsplit("_d", 1)[1])
        dtype = {64: f16, 128: torch.bfloat16, 256: f16}[dd]
        cache, ip, ix, la = _paged(rng, torch, dtype, lens, 16, hk, dd)
        qo = np.array([0, 9, 9, 70, 75], np.int32)
        C.batch_prefill_paged(q_of(75, dtype, dd), cache, qo, ip, ix, la, causal=True, return_lse=True,
                              tensor_cores=tc)
        k = torch.randn((90, hk, dd), device="cuda", dtype=dtype)
        C.single_prefill(q_of(33, dtype, dd), k, k.clone(), causal=True, window_left=20, tensor_cores=tc)
        C.batch_prefill_ragged(q_of(12, dtype, dd), k, k.clone(), np.array([0, 5, 12], np.int32),
                               np.array([0, 40, 90], np.int32), tensor_cores=tc)
        if not tc and dd == 64:
            k = torch.randn((50, hk, 64), device="cuda", dtype=torch.float32)
            C.single_prefill(q_of(20, torch.float32, 64), k, k.clone(), use_sigmoid=True)
    elif family == "append":
        cache, ip, ix, la = _paged(rng, torch, f16, lens, 16, hk, d)
        kv_lens = np.array([37, 0, 300, 5])
        new = torch.randn((9, hk, d), device="cuda", dtype=f16)
        batch = np.array([0, 0, 2, 2, 2, 3, 3, 3, 3], np.int32)
        pos = np.array([35, 36, 296, 297, 298, 1, 2, 3, 4], np.int32)
        C.append_paged_kv_cache(new, new.clone(), batch, pos, cache, ip, ix, la)
    elif family == "block_sparse":
        for tc in (False, True):
            m, n = 96, 160
            mask = rng.random((m // 16, n // 32)) < 0.5
            bsr = L.BSR.from_block_mask(mask, (16, 32), (m, n))
            k = torch.randn((n, hk, d), device="cuda", dtype=f16)
            C.block_sparse(q_of(m), k, k.clone(), bsr, return_lse=True, tensor_cores=tc)
    elif family == "cascade":
        cache, ip, ix, la = _paged(rng, torch, f16, [80, 80, 80], 16, hk, d)
        ix[5:10] = ix[0:5]                    # a shared prefix of five pages
        ix[10:15] = ix[0:5]
        qo = np.array([0, 3, 8, 9], np.int32)
        pkv = L.PagedKV.validate(ip, ix, la, 16, cache.shape[0])
        levels = L.cascade_decompose(qo, pkv)
        for tc in (False, True):
            C.cascade(q_of(9), levels, cache, causal=True, return_lse=True, tensor_cores=tc, kv_chunk=32)
        k = torch.randn((70, hk, d), device="cuda", dtype=f16)
        C.split_kv(q_of(2), k, k.clone(), np.array([0, 20, 20, 70], np.int32), causal=True)
    elif family == "wrappers":
        ws = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
        cache, ip, ix, la = _paged(rng, torch, f16, lens, 16, hk, d)
        w = C.BatchDecodeWithPagedKVCacheWrapper(ws, num_ctas=8)
        for nb in (4, 2):
            w.plan(ip[:nb + 1], ix[: ip[nb]], la[:nb], hq, hk, d, 16, chunk_overhead=0.0, chunk_limit=None)
            w.run(q_of(nb), cache, return_lse=True)
        w = C.BatchPrefillWithPagedKVCacheWrapper(ws, num_ctas=8)
        qo = np.array([0, 9, 9, 70, 75], np.int32)
        for nb in (4, 1):
            w.plan(qo[:nb + 1], ip[:nb + 1], ix[: ip[nb]], la[:nb], hq, hk, d, 16, causal=True)
            w.run(q_of(int(qo[nb])), cache, return_lse=True)
    else:
        raise SystemExit(f"--family: unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    torch.cuda.synchronize()
    print(f"family {family}: done")


FAMILIES = ("decode_smem", "decode_warp", "decode_tc", "decode_split_merge",
            *(f"prefill_{path}_d{d}" for path in ("cuda_core", "tensor_core") for d in (64, 128, 256)),
            "append", "block_sparse", "cascade", "wrappers")
# rough kernel counts per family (each a compilation of seconds to tens of seconds on a GPU)
WARM_COST = {"cascade": 5, "wrappers": 4, **{f: 3 for f in FAMILIES if f.startswith("prefill_")}, "block_sparse": 2}


# ---------------------------------------------------------------------------
# The parent: one sanitized child per (family, tool)
# ---------------------------------------------------------------------------

PRINT_LIMIT = 1000
ERROR_RE = re.compile(r"ERROR SUMMARY:\s+(\d+)\s+error")
RACE_RE = re.compile(r"RACECHECK SUMMARY:\s+(\d+)\s+hazards? displayed\s+\((\d+)\s+errors?,\s+(\d+)\s+warnings?\)")


# A host API call that returned an error is counted in the tool's ERROR SUMMARY too.  The driver
# binding that numba-cuda uses asks the driver for entry points by version (cuGetProcAddress), and
# an entry point this driver lacks comes back CUDA_ERROR_INVALID_VALUE: that is a probe, not a fault
# of a kernel.  Those calls are counted apart (``api_probes``); every other API error counts.
API_RE = re.compile(r"Program hit (\w+) \(error \d+\).*? on CUDA API call to (\w+)")
PROBE_CALLS = ("cuGetProcAddress", "cuGetProcAddress_v2")


def api_errors(text: str) -> dict:
    """``{"CALL: ERROR": count}`` of the host API errors the log prints."""
    out: dict = {}
    for err, call in API_RE.findall(text):
        out[f"{call}: {err}"] = out.get(f"{call}: {err}", 0) + 1
    return out


def record(family: str, tool: str, text: str, rc: int, seconds: float) -> dict:
    """The result record of one sanitized child, from its log and exit status."""
    errors, hazards = parse_summary(tool, text)
    api = api_errors(text)
    probes = sum(n for k, n in api.items() if k.split(":")[0] in PROBE_CALLS)
    if errors is not None:
        # every error must be printed to be classified; beyond the limit none is excused
        errors = errors - probes if errors <= PRINT_LIMIT else errors
    child_ok = f"family {family}: done" in text
    rec = {"case": {"family": family, "tool": tool, "child_exit": rc, "child_completed": child_ok,
                    "seconds": round(seconds, 1)},
           "metric": "sanitizer_errors", "unit": "count",
           "value": float(errors) if errors is not None and child_ok else -1.0,
           "peers": {"hazards": float(hazards) if hazards is not None else None, "api_probes": float(probes)}}
    if api:
        rec["case"]["api_errors"] = [f"{k} x{n}" for k, n in sorted(api.items())]
    if errors is None or not child_ok or errors:
        rec["case"]["log_tail"] = text[-3000:]
    print(f"{family:22s} {tool:10s} errors={errors} hazards={hazards} completed={child_ok} "
          f"({rec['case']['seconds']} s)", flush=True)
    return rec


def parse_summary(tool: str, text: str) -> tuple[int | None, int | None]:
    """``(errors, hazards)`` from a compute-sanitizer log; None where the line is missing."""
    if tool == "racecheck":
        m = RACE_RE.search(text)
        if m:
            return int(m.group(2)), int(m.group(1))
        m = ERROR_RE.search(text)
        return (int(m.group(1)), 0) if m else (None, None)
    m = ERROR_RE.search(text)
    return (int(m.group(1)), None) if m else (None, None)


def _env(cache_dir: str) -> dict:
    return dict(os.environ, NUMBA_CACHE_DIR=cache_dir, PYTHONPATH=str(REPO) + os.pathsep
                + os.environ.get("PYTHONPATH", ""))


def warm(family: str, cache_dir: str, timeout: float) -> str:
    """Compile a family's kernels into ``cache_dir`` (no sanitizer); '' or the error's tail."""
    try:
        r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", family], capture_output=True,
                           text=True, timeout=timeout, env=_env(cache_dir))
    except subprocess.TimeoutExpired:
        return f"warm-up timed out after {timeout} s"
    return "" if r.returncode == 0 else (r.stdout + r.stderr)[-2000:]


def sanitize(family: str, tool: str, sanitizer: str, timeout: float, cache_dir: str | None = None) -> dict:
    own = cache_dir is None
    cache_dir = tempfile.mkdtemp(prefix="nbattn_sanitizer_cache_") if own else cache_dir
    env = _env(cache_dir)
    cmd = [sanitizer, "--tool", tool, "--target-processes", "all", "--print-limit", str(PRINT_LIMIT)]
    cmd += [sys.executable, str(Path(__file__).resolve()), "--child", family]
    t = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        text, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = f"timeout after {timeout} s: {(e.stdout or b'')[-2000:]!r}", -9
    finally:
        if own:
            shutil.rmtree(cache_dir, ignore_errors=True)
    return record(family, tool, text, rc, time.time() - t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", action="append", choices=FAMILIES, help="families to check (default all)")
    p.add_argument("--tool", action="append", choices=TOOLS, help="tools to run (default all four)")
    p.add_argument("--sanitizer", default=shutil.which("compute-sanitizer") or "compute-sanitizer",
                   help="path of compute-sanitizer")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per (family, tool) child")
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--jobs", type=int, default=4, help="sanitized children at once")
    p.add_argument("--deadline", type=float, default=None, help="start no child after this many seconds")
    p.add_argument("--commit", default=None, help="the nbattn commit being run (recorded in the file)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        run_family(args.child)
        return 0
    import torch

    from nbattn.perf.results import write_suite

    from concurrent.futures import ThreadPoolExecutor

    t0 = time.time()
    families, tools = args.family or FAMILIES, args.tool or TOOLS
    caches = {f: tempfile.mkdtemp(prefix=f"nbattn_sanitizer_{f}_") for f in families}
    # longest compilations first (the prefill tiles), so the warm-up ends soonest
    by_cost = sorted(families, key=lambda f: -WARM_COST.get(f, 1))
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        warm_err = dict(zip(by_cost, pool.map(lambda f: warm(f, caches[f], args.timeout), by_cost)))
    print(f"warm-up done in {time.time() - t0:.0f} s", flush=True)
    pairs = [(f, t) for t in tools for f in families]        # every family under memcheck first, and so on
    records: list = []
    lock = threading.Lock()

    def one(pair):
        f, t = pair
        if args.deadline and time.time() - t0 > args.deadline:
            return None                                        # not started: reported as missing below
        rec = sanitize(f, t, args.sanitizer, args.timeout, caches[f])
        if warm_err[f]:
            rec["case"]["warm_up_error"] = warm_err[f][-1000:]
        with lock:
            records.append(rec)
            try:
                write()
            except Exception as exc:             # keep checking; the raw records still land
                print(f"could not write sanitizer.json: {exc}", flush=True)
                Path(args.results, "sanitizer_raw.json").write_text(json.dumps(records, indent=1))
        return rec

    def write():
        return write_suite("sanitizer", sorted(records, key=lambda r: (r["case"]["family"], r["case"]["tool"])),
                           gpu=torch.cuda.get_device_name(),
                           command="PYTHONPATH=$PWD python3 benchmarks/gpu_sanitizer.py " + " ".join(argv or sys.argv[1:]),
                           versions={"torch": torch.__version__, "python": sys.version.split()[0],
                                     **({"nbattn_commit": args.commit} if args.commit else {})},
                           root=args.results)

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(one, pairs))
    for d in caches.values():
        shutil.rmtree(d, ignore_errors=True)
    done = {(r["case"]["family"], r["case"]["tool"]) for r in records}
    missing = [p for p in pairs if p not in done]
    path = write() if records else None
    bad = [r for r in records if r["value"] != 0 or (r["peers"]["hazards"] or 0) > 0]
    print(f"wrote {path}; {len(bad)} of {len(records)} (family, tool) runs with findings or failures; "
          f"{len(missing)} not run before the deadline: {missing}")
    return 1 if bad or missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
