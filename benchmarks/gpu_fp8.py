"""fp16 against fp8 decode through the public API: the decode wrapper planned once,
then run() eager and run() replayed in a CUDA graph (issue 19, item 5, "fp8 vs fp16
decode bandwidth").

Decode cases: batch 64 x {4k, 16k} keys and batch 1 x 32k, 32 query heads, group 4,
page 16, head_dim 128, fp16 q; and batch 64 x 4k with bf16 q, and with fp16 q
and the fp8 caches on the warp path (``path`` in the case; the default picks
the tensor-core path for these shapes).  For each, the
cache in q's dtype and the same values as ``float8_e4m3fn`` and ``float8_e5m2``
caches with ``k_scale`` / ``v_scale``.  Prefill case: ``batch_prefill_paged``,
4 requests of 2048 query rows over 2048 keys, causal, over the same three caches
(the fp8 ones widened to fp16 by the call), and the widening alone.
Records (suite ``fp8``):

* ``bw_fraction``: the bytes the call reads -- K and V in the cache's own
  element size (1 byte for fp8), plus q and the output -- over the time, as a
  fraction of the same run's device-to-device copy bandwidth; ``case.mode`` is
  ``eager_run`` (CUDA events around 20 back-to-back run() calls) or
  ``graph_replay`` (a graph of 20 run() calls);
* ``latency_us``: microseconds of one call, same modes; the fp8 records have the
  16-bit cache's time (q's dtype) of the same case and mode as peer ``fp16`` (the issue's target:
  fp8 at most 0.6x of it, and at least 0.85 of copy bandwidth at batch 64);
* ``max_abs_err``: the largest difference between run() and the golden model
  in float64 (``nbattn.reference.batch_decode_paged``) on a small case
  (batch 8 x up to 1000 keys), per fp8 format, over the output elements where
  both are finite; ``nonfinite_mismatches``: the output elements where exactly
  one of the two is finite, or they are non-finite in different ways (0 when
  the kernel keeps the NaN rule).  Finite data only: the fp8 caches are
  ``x / scale`` saturated at the fp8 maximum (the golden model's quantize; a
  plain torch cast of an out-of-range value gives NaN in some torch versions).

    PYTHONPATH=$PWD python3 benchmarks/gpu_fp8.py --commit SHA [--out DIR] [--quick]

writes ``<out>/fp8.json`` and the figure ``<out>/fp8.png`` (``--replot``: the figure
again from the file, no GPU).  ``--quick`` leaves out batch 64 x 16k.  Under numba's CUDA
simulator (no GPU) it is a dry run at tiny shapes, timed with the host clock:
it checks that the script works, not how fast anything is.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import nbattn  # noqa: E402,F401
import nbattn.cuda as NC  # noqa: E402
from nbattn import layout as L  # noqa: E402
from nbattn import reference as R  # noqa: E402
from nbattn.cuda.blocks.primitives import SIMULATOR  # noqa: E402
from nbattn.cuda.tuning import DECODE  # noqa: E402
from _timing import copy_bandwidth, eager_ms  # noqa: E402

HQ, D, PS, GROUP = (4, 32, 4, 2) if SIMULATOR else (32, 128, 16, 4)
REPS = 20
DEV = "cpu" if SIMULATOR else "cuda"
KV = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn,
      "float8_e5m2": torch.float8_e5m2}
K_SCALE, V_SCALE = 1 / 64, 1 / 128          # keys ~ N(0, 1) stored as N(0, 64), values as N(0, 128)
BUDGET_S = 200.0                             # stop starting new cases after this (the run must end by 240 s)


def sync():
    if not SIMULATOR:
        torch.cuda.synchronize()


def timed_ms(fn) -> float:
    """Median milliseconds per call of ``REPS`` back-to-back calls (``_timing.eager_ms``;
    a dry run times one call with the host clock)."""
    return eager_ms(fn, REPS, SIMULATOR)


def graph_replay_ms(fn) -> tuple[float, bool]:
    if SIMULATOR:
        return timed_ms(fn), False
    from _timing import graph_ms
    return graph_ms(fn, iters=10, rep=REPS)


def caches(batch: int, kv_len: int, hkv: int, seed: int, qdt: str = "float16"):
    """The page table and the same K/V values as a ``qdt`` cache and as both fp8 caches
    (fp8 = x / scale); q in ``qdt``."""
    lens = np.full(batch, kv_len)
    pkv = L.PagedKV.allocate(lens, PS, rng=np.random.default_rng(seed))
    gen = torch.Generator(device=DEV).manual_seed(seed)
    base = torch.randn((pkv.num_pages, 2, PS, hkv, D), dtype=torch.float16, device=DEV, generator=gen).to(KV[qdt])
    q = torch.randn((batch, HQ, D), dtype=torch.float16, device=DEV, generator=gen).to(KV[qdt])
    out = {qdt: base}
    for name in ("float8_e4m3fn", "float8_e5m2"):
        c = torch.empty(base.shape, dtype=KV[name], device=DEV)
        top = float(torch.finfo(KV[name]).max)             # saturate, as the golden model's quantize does
        c[:, 0] = (base[:, 0].float() / K_SCALE).clamp_(-top, top).to(KV[name])
        c[:, 1] = (base[:, 1].float() / V_SCALE).clamp_(-top, top).to(KV[name])
        out[name] = c
    meta = (pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len)
    return q, out, meta, lens


def wrapper_for(kv: str, meta, hkv: int, qdt: str = "float16", path: str = "auto"):
    ws = torch.empty((8 << 20) if SIMULATOR else (256 << 20), dtype=torch.uint8, device=DEV)
    w = NC.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", num_ctas=4 if SIMULATOR else None)
    w.plan(*meta, HQ, hkv, D, PS, q_data_type=KV[qdt], kv_data_type=None if kv == qdt else KV[kv],
           tuning=DECODE.replace(path=path))
    return w


def run_fn(w, q, cache, kv: str):
    if not kv.startswith("float8"):
        return lambda: w.run(q, cache)
    return lambda: w.run(q, cache, k_scale=K_SCALE, v_scale=V_SCALE)


def bench_case(recs, batch, kv_len, copy_bw, seed, qdt="float16", path="auto"):
    """The ``qdt`` cache, then both fp8 caches with ``qdt`` q (on decode path ``path``);
    an fp8 record's peer ``fp16`` is the 16-bit cache's time in the same mode (bf16 when
    ``qdt`` is)."""
    hkv = HQ // GROUP
    q, cs, meta, lens = caches(batch, kv_len, hkv, seed, qdt)
    base = {"op": "decode", "batch": batch, "kv_len": kv_len, "num_qo_heads": HQ, "num_kv_heads": hkv,
            "group": GROUP, "head_dim": D, "page_size": PS, "q_dtype": qdt}
    fp16_us: dict = {}
    for kv in (qdt, "float8_e4m3fn", "float8_e5m2"):
        elem = 1 if kv.startswith("float8") else 2
        nbytes = 2 * int(lens.sum()) * hkv * D * elem + 2 * 2 * batch * HQ * D     # K+V, q+out
        w = wrapper_for(kv, meta, hkv, qdt, "auto" if kv == qdt else path)
        fn = run_fn(w, q, cs[kv], kv)
        fn()
        sync()
        case = dict(base, kv_dtype=kv, bytes_read=nbytes, path=w._cfg.path)
        eager = timed_ms(fn)
        replay, graphed = graph_replay_ms(fn)
        for mode, ms in (("eager_run", eager), ("graph_replay", replay)):
            c = dict(case, mode=mode, graphed=graphed if mode == "graph_replay" else False)
            peers = {} if kv == qdt else {"fp16": fp16_us[mode]}
            if kv == qdt:
                fp16_us[mode] = ms * 1e3
            recs.append({"case": c, "metric": "latency_us", "value": ms * 1e3, "unit": "us", "peers": peers})
            recs.append({"case": c, "metric": "bw_fraction", "value": nbytes / (ms * 1e-3) / 1e9 / copy_bw,
                         "unit": "of copy bandwidth", "peers": {}})
        print(f"b{batch} x {kv_len} {kv:14s} path {w._cfg.path}: eager {eager * 1e3:8.1f} us, "
              f"replay {replay * 1e3:8.1f} us ({'graph' if graphed else 'plain'}), "
              f"{recs[-1]['value']:.3f} of copy bandwidth", flush=True)
        del w
    del cs
    if not SIMULATOR:
        torch.cuda.empty_cache()


def bench_error(recs, seed: int):
    """max |run() - golden float64| on a small case, per fp8 format (an empty request, ragged lengths)."""
    rng = np.random.default_rng(seed)
    hkv = HQ // GROUP
    lens = rng.integers(1, 40 if SIMULATOR else 1000, size=4 if SIMULATOR else 8)
    lens[1] = 0
    pkv = L.PagedKV.allocate(lens, PS, rng=rng)
    meta = (pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len)
    x = torch.from_numpy(rng.standard_normal((pkv.num_pages, 2, PS, hkv, D)).astype(np.float32))
    q = torch.from_numpy(rng.standard_normal((len(lens), HQ, D)).astype(np.float32)).half()
    scales = np.array([K_SCALE, V_SCALE]).reshape(1, 2, 1, 1, 1)
    for kv in ("float8_e4m3fn", "float8_e5m2"):
        cache = R.fp8.quantize(x.numpy() / scales, 1.0, kv)    # saturating: finite codes only
        want = R.batch_decode_paged(q, cache, *meta, k_scale=K_SCALE, v_scale=V_SCALE, dtype=np.float64)
        w = wrapper_for(kv, meta, hkv)
        got = w.run(q.to(DEV), cache.to(DEV), k_scale=K_SCALE, v_scale=V_SCALE)
        sync()
        err, bad, n = compare(got.detach().cpu().double().numpy(), np.asarray(want, np.float64))
        print(f"max |run - golden float64| {kv}: {err:.2e} over {n} finite elements; "
              f"non-finite mismatches: {bad}", flush=True)
        case = {"op": "decode", "kv_dtype": kv, "batch": int(len(lens)), "max_kv_len": int(lens.max()),
                "num_qo_heads": HQ, "num_kv_heads": hkv, "head_dim": D, "page_size": PS, "q_dtype": "float16",
                "reference": "nbattn.reference float64", "compared_finite": n}
        recs.append({"case": case, "metric": "max_abs_err", "value": err, "unit": "", "peers": {}})
        recs.append({"case": case, "metric": "nonfinite_mismatches", "value": bad, "unit": "elements",
                     "peers": {}})


def bench_prefill(recs, seed: int):
    """``batch_prefill_paged`` (plain call, causal) over the fp16 cache and the same values
    as fp8 caches, which the prefill forms widen to fp16 first; and the widening alone.
    Records ``latency_us`` (eager, events around back-to-back calls), the fp8 ones with
    the fp16 time as peer ``fp16``."""
    from nbattn.cuda import fp8 as F
    from nbattn.cuda.blocks.fp8 import FP8_CODES
    batch, n = (2, 12) if SIMULATOR else (4, 2048)
    hkv = HQ // GROUP
    q1, cs, meta, lens = caches(batch, n, hkv, seed)
    q = torch.randn((batch * n, HQ, D), dtype=torch.float16, device=DEV)
    qo_indptr = np.arange(batch + 1, dtype=np.int32) * n
    base = {"op": "prefill", "batch": batch, "qo_len": n, "kv_len": n, "causal": True, "num_qo_heads": HQ,
            "num_kv_heads": hkv, "head_dim": D, "page_size": PS, "q_dtype": "float16"}
    fp16_us = None
    for kv in ("float16", "float8_e4m3fn", "float8_e5m2"):
        scales = {} if kv == "float16" else dict(k_scale=K_SCALE, v_scale=V_SCALE)
        fn = (lambda kv=kv, scales=scales: NC.batch_prefill_paged(q, cs[kv], qo_indptr, *meta, causal=True,
                                                                   **scales))
        fn()
        sync()
        us = timed_ms(fn) * 1e3
        peers = {} if fp16_us is None else {"fp16": fp16_us}
        fp16_us = us if fp16_us is None else fp16_us
        recs.append({"case": dict(base, kv_dtype=kv, mode="eager_plain"), "metric": "latency_us", "value": us,
                     "unit": "us", "peers": peers})
        line = f"prefill {batch} x {n} causal {kv:14s}: {us:9.1f} us"
        if kv != "float16":
            pages = np.asarray(meta[1])
            widen_us = timed_ms(lambda kv=kv: F.widen(cs[kv], "paged_kv_cache", FP8_CODES[kv], "f16", K_SCALE,
                                                     V_SCALE, 0, not SIMULATOR, pages=pages)) * 1e3
            recs.append({"case": dict(base, kv_dtype=kv, mode="widen_only", pages=int(pages.size)),
                         "metric": "latency_us", "value": widen_us, "unit": "us", "peers": {"fp16": fp16_us}})
            line += f" (widening alone {widen_us:.1f} us)"
        print(line, flush=True)
    del cs


def compare(got: np.ndarray, want: np.ndarray) -> tuple[float, int, int]:
    """``(max |got - want|, mismatches, n)``: the largest difference over the ``n`` elements
    where both are finite (0.0 when there are none), and the count of elements where they
    are not both finite and not the same non-finite value (NaN and NaN agree, as do
    equal infinities).  Never NaN."""
    fin = np.isfinite(got) & np.isfinite(want)
    same = fin | (np.isnan(got) & np.isnan(want)) | (np.isinf(got) & (got == want))
    err = float(np.abs(got[fin] - want[fin]).max()) if fin.any() else 0.0
    return err, int((~same).sum()), int(fin.sum())


def write_suite(suite: str, recs: list, script: str, argv, args, copy_bw: float) -> Path:
    """``<args.out>/<suite>.json`` with the records, this machine's GPU and versions, the
    commit ``args.commit`` and the same run's copy bandwidth."""
    from nbattn.perf import results
    return results.write_suite(
        suite, recs, gpu="numba CUDA simulator (dry run)" if SIMULATOR else torch.cuda.get_device_name(),
        command=f"PYTHONPATH=$PWD python3 benchmarks/{script} " + " ".join(argv or sys.argv[1:]),
        versions={"nbattn_commit": args.commit, "torch": torch.__version__, "numpy": np.__version__,
                  "python": platform.python_version()},
        date=datetime.date.today().isoformat(), root=Path(args.out), copy_bandwidth_GBps=copy_bw)


def figure(recs, path):
    """``fp8.png``: per decode case, the graph-replayed share of copy bandwidth of each
    cache (left) and the fp8 time over the 16-bit cache's time (right; the target 0.6)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def key(c):                 # a case: its shape, q's dtype and the fp8 caches' path
        return (c["batch"], c["kv_len"], c["q_dtype"], c["path"])

    sel = [r for r in recs if r["case"].get("op") == "decode" and r["case"].get("mode") == "graph_replay"]
    fp8 = [r for r in sel if r["case"]["kv_dtype"].startswith("float8")]
    cases = list(dict.fromkeys(key(r["case"]) for r in fp8))
    names = [f"b{b} x {k // 1024}k" + ("" if q == "float16" else f", {q.replace('loat', '')} q") + (", warp" if p == "warp" else "")
             for b, k, q, p in cases]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    x = np.arange(len(cases))
    for j, (kv, color) in enumerate((("16-bit cache", "C0"), ("float8_e4m3fn", "C1"), ("float8_e5m2", "C2"))):
        bw, ratio = [], []
        for b, k, q, p in cases:
            same = [r for r in (fp8 if kv != "16-bit cache" else sel) if r["case"]["batch"] == b
                    and r["case"]["kv_len"] == k and r["case"]["q_dtype"] == q
                    and (r["case"]["kv_dtype"] == kv if kv != "16-bit cache" else r["case"]["kv_dtype"] == q)
                    and (kv == "16-bit cache" or r["case"]["path"] == p)]
            bw.append(next((r["value"] for r in same if r["metric"] == "bw_fraction"), np.nan))
            lat = next((r for r in same if r["metric"] == "latency_us"), None)
            ratio.append(lat["value"] / lat["peers"]["fp16"] if lat and lat["peers"].get("fp16") else np.nan)
        axes[0].bar(x + (j - 1) * 0.27, bw, 0.27, label=kv, color=color)
        if kv != "16-bit cache":
            axes[1].bar(x + (j - 1.5) * 0.35, ratio, 0.35, label=kv, color=color)
    axes[0].axhline(0.85, color="k", lw=0.8, ls="--")
    axes[0].set_ylabel("share of copy bandwidth (graph replay)")
    axes[0].set_title("decode: bytes read (fp8 as 1 byte) over time; goal 0.85")
    axes[1].axhline(0.6, color="k", lw=0.8, ls="--")
    axes[1].set_ylabel("fp8 time / 16-bit cache time")
    axes[1].set_title("decode: fp8 against the 16-bit cache, same run; goal 0.6")
    for ax in axes:
        ax.set_xticks(x, names, fontsize=8)
        ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", required=True, help="the nbattn commit measured (recorded in the file)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/nbattn_out"))
    ap.add_argument("--quick", action="store_true", help="two cases (b64 x 4k, b1 x 32k)")
    ap.add_argument("--replot", action="store_true", help="only draw <out>/fp8.png again from <out>/fp8.json")
    args = ap.parse_args(argv)
    if args.replot:
        import json
        figure(json.loads((Path(args.out) / "fp8.json").read_text())["records"], Path(args.out) / "fp8.png")
        return 0
    copy_bw = copy_bandwidth(SIMULATOR)
    print(f"copy bandwidth {copy_bw:.0f} GB/s{' (simulator dry run: host memory)' if SIMULATOR else ''}",
          flush=True)
    recs: list = []

    def save():
        return write_suite("fp8", recs, "gpu_fp8.py", argv, args, copy_bw)

    bench_error(recs, 19)
    save()
    bench_prefill(recs, 23)
    save()
    cases = [(64, 4096, "float16", "auto"), (64, 4096, "bfloat16", "auto"), (64, 4096, "float16", "warp"),
             (1, 32768, "float16", "auto"), (64, 16384, "float16", "auto")]
    if args.quick:
        cases = cases[:4]
    if SIMULATOR:
        cases = [(2, 24, "float16", "auto"), (2, 24, "bfloat16", "auto"), (1, 40, "float16", "auto")]
    for i, (b, k, qdt, path) in enumerate(cases):
        if time.perf_counter() - t0 > BUDGET_S:
            print(f"time budget spent: skipping b{b} x {k} {qdt} {path}", flush=True)
            continue
        bench_case(recs, b, k, copy_bw, 100 + i, qdt, path)
        save()
    path = save()
    figure(recs, Path(args.out) / "fp8.png")
    print(f"wrote {path} ({len(recs)} records) and fp8.png in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
