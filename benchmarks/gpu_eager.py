"""What a user's call costs: the public API, eager first, CUDA-graph replay second.

Each case is called as a user calls it -- torch CUDA tensors in, host (NumPy)
page-table metadata -- beside torch SDPA (cuDNN and flash backends, eager) on
the same data in the same process:

* ``host_us`` (``case.call`` in plain / run / plan): ``perf_counter`` around one
  call, no synchronization; median of many calls, the queue drained between
  batches of calls so it never fills;
* ``bw_fraction`` (decode) or ``tflops`` (prefill) with ``case.mode`` in
  eager_plain / eager_run / graph_replay: CUDA events around 20 back-to-back
  calls (eager) or around the replay of a graph holding 20 calls;
* ``plan_us`` at batch 1, 64 and 1024;
* ``first_call_s``: the first call of a new kernel configuration in a fresh
  process, with an empty kernel cache (cold) and with the cache the cold run
  left (warm).

    PYTHONPATH=$PWD python3 benchmarks/gpu_eager.py --commit SHA [--out DIR] [--quick]

writes ``<out>/eager.json`` and ``<out>/eager.png``, and the ``first_call_s`` records
to ``<out>/first_call.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
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
from _timing import back_to_back_ms, graph_ms  # noqa: E402

HQ, D, PS = 32, 128, 16
REPS = 20


def copy_bandwidth() -> float:
    n = 1 << 30
    a = torch.empty(n // 4, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    ms, _ = graph_ms(lambda: b.copy_(a), iters=10, rep=5, graph=False)
    return 2 * n / (ms * 1e-3) / 1e9


def eager_ms(fn, reps: int = REPS) -> float:
    """Events around ``reps`` back-to-back calls; median per call over 5 rounds."""
    return back_to_back_ms(fn, reps)


def host_us(fn, n: int = 200, batch: int = 20) -> float:
    """Median host microseconds of one call, no synchronization inside a batch."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n // batch):
        for _ in range(batch):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def decode_case(batch: int, kv_len: int, hkv: int, gen):
    lens = np.full(batch, kv_len)
    pkv = L.PagedKV.allocate(lens, PS, rng=np.random.default_rng(batch + kv_len + hkv))
    cache = torch.randn((pkv.num_pages, 2, PS, hkv, D), dtype=torch.float16, device="cuda", generator=gen)
    q = torch.randn((batch, HQ, D), dtype=torch.float16, device="cuda", generator=gen)
    meta = (pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len)
    nbytes = 2 * D * (batch * HQ * 2 + 2 * int(lens.sum()) * hkv)
    return q, cache, meta, pkv, nbytes


def sdpa_peers(q, cache, pkv, hkv, batch, kv_len, seconds_to_metric):
    """SDPA cuDNN and flash, eager, on the dense equivalent of the paged batch."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    idx = torch.from_numpy(pkv.paged_kv_indices.astype(np.int64)).cuda()
    k = cache[idx, 0].reshape(batch, -1, hkv, D)[:, :kv_len].transpose(1, 2).contiguous()
    v = cache[idx, 1].reshape(batch, -1, hkv, D)[:, :kv_len].transpose(1, 2).contiguous()
    qd = q.reshape(batch, HQ, 1, D)
    peers, out = {}, {}
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        try:
            def f(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qd, k, v, enable_gqa=True)
            out[name] = f().reshape(batch, HQ, D)
            peers[name] = seconds_to_metric(eager_ms(f) * 1e-3)
        except Exception as exc:  # noqa: BLE001
            print(name, "failed:", repr(exc)[:160], flush=True)
            peers[name] = None
    return peers, out


def bench_decode(recs, batch, kv_len, hkv, copy_bw, gen, quick):
    q, cache, meta, pkv, nbytes = decode_case(batch, kv_len, hkv, gen)
    case = {"op": "decode", "batch": batch, "kv_len": kv_len, "num_kv_heads": hkv, "group": HQ // hkv,
            "head_dim": D, "page_size": PS, "dtype": "float16"}
    bw = lambda s: nbytes / s / 1e9 / copy_bw  # noqa: E731
    peers, dense = sdpa_peers(q, cache, pkv, hkv, batch, kv_len, bw)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = NC.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    plan = lambda: w.plan(*meta, HQ, hkv, D, PS)  # noqa: E731
    plan()
    plain = lambda: NC.batch_decode_paged(q, cache, *meta)  # noqa: E731
    run = lambda: w.run(q, cache)  # noqa: E731
    o_plain, o_run = plain(), run()
    torch.cuda.synchronize()
    ref = dense.get("sdpa_cudnn", dense.get("sdpa_flash"))
    err = {k: float((o.float() - ref.float()).abs().max()) if ref is not None else None
           for k, o in (("plain", o_plain), ("run", o_run))}
    print(f"decode b{batch} x {kv_len} g{HQ // hkv}: max |nbattn - sdpa| plain {err['plain']} run {err['run']}",
          flush=True)
    if ref is not None:
        assert max(err.values()) < 2e-2, f"decode output disagrees with SDPA: {err}"
    for call, fn in (("plain", plain), ("run", run), ("plan", plan)):
        recs.append({"case": dict(case, call=call), "metric": "host_us", "value": host_us(fn), "unit": "us",
                     "peers": {}})
    for mode, fn in (("eager_plain", plain), ("eager_run", run)):
        recs.append({"case": dict(case, mode=mode), "metric": "bw_fraction", "value": bw(eager_ms(fn) * 1e-3),
                     "unit": "of copy bandwidth", "peers": peers})
    ms, graphed = graph_ms(run, iters=10, rep=REPS)
    recs.append({"case": dict(case, mode="graph_replay", graphed=graphed), "metric": "bw_fraction",
                 "value": bw(ms * 1e-3), "unit": "of copy bandwidth", "peers": peers})
    print("  ", [(r["case"].get("call") or r["case"].get("mode"), round(r["value"], 3)) for r in recs[-6:]],
          peers, flush=True)


def bench_prefill(recs, n, causal, gen):
    q, k, v = (torch.randn((n, HQ, D), dtype=torch.float16, device="cuda", generator=gen) for _ in range(3))
    flops = 4.0 * n * n * HQ * D * (0.5 if causal else 1.0)
    tf = lambda s: flops / s / 1e12  # noqa: E731
    case = {"op": "prefill", "q_len": n, "kv_len": n, "causal": causal, "num_kv_heads": HQ, "head_dim": D,
            "dtype": "float16", "batch": 1}
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    peers = {}
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        try:
            def f(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            peers[name] = tf(eager_ms(f, 5) * 1e-3)
        except Exception as exc:  # noqa: BLE001
            print(name, "failed:", repr(exc)[:160], flush=True)
            peers[name] = None
    plain = lambda: NC.single_prefill(q, k, v, causal=causal)  # noqa: E731
    indptr = np.array([0, n], np.int32)
    pkv = L.PagedKV.allocate([n], PS)
    cache = torch.stack([k, v], 1).reshape(n // PS, PS, 2, HQ, D).transpose(1, 2).contiguous()
    ws = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    w = NC.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    plan = lambda: w.plan(indptr, pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len,  # noqa: E731
                          HQ, HQ, D, PS, causal=causal)
    plan()
    run = lambda: w.run(q, cache)  # noqa: E731
    for call, fn in (("plain", plain), ("run", run), ("plan", plan)):
        recs.append({"case": dict(case, call=call), "metric": "host_us", "value": host_us(fn, 40, 10),
                     "unit": "us", "peers": {}})
    for mode, fn in (("eager_plain", plain), ("eager_run", run)):
        recs.append({"case": dict(case, mode=mode), "metric": "tflops", "value": tf(eager_ms(fn, 5) * 1e-3),
                     "unit": "TFLOP/s", "peers": peers})
    ms, graphed = graph_ms(run, iters=5, rep=5)
    recs.append({"case": dict(case, mode="graph_replay", graphed=graphed), "metric": "tflops",
                 "value": tf(ms * 1e-3), "unit": "TFLOP/s", "peers": peers})
    print(f"prefill {n} causal={causal}:", [(r["case"].get("call") or r["case"].get("mode"), round(r["value"], 2))
                                           for r in recs[-6:]], peers, flush=True)


def bench_plan(recs):
    rng = np.random.default_rng(5)
    for batch in (1, 64, 1024):
        pkv = L.PagedKV.allocate(rng.integers(1, 8192, size=batch), PS, rng=rng)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = NC.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        fn = lambda: w.plan(pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len,  # noqa: E731
                            HQ, 8, D, PS)
        fn()
        recs.append({"case": {"op": "decode_plan", "batch": batch, "num_kv_heads": 8, "schedule": w._mode},
                     "metric": "plan_us", "value": host_us(fn, 200, 20), "unit": "us", "peers": {}})
        print("plan", batch, round(recs[-1]["value"], 1), "us", flush=True)


_FIRST = r'''
import sys, time, json
t0 = time.perf_counter()
import numpy as np, torch
import nbattn, nbattn.cuda as NC
from nbattn import layout as L
t1 = time.perf_counter()
kind, code, group, d, variant = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
dt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[code]
hkv = 2
if kind == "decode":
    pkv = L.PagedKV.allocate([300, 17], 16)
    cache = torch.randn((pkv.num_pages, 2, 16, hkv, d), dtype=dt, device="cuda")
    q = torch.randn((2, hkv * group, d), dtype=dt, device="cuda")
prof = None
if len(sys.argv) > 6:                  # a profile of the call, written to that file
    import cProfile
    prof = cProfile.Profile()
if kind == "decode":
    call = lambda: NC.batch_decode_paged(q, cache, pkv.paged_kv_indptr, pkv.paged_kv_indices,
                                         pkv.paged_kv_last_page_len, **variant)
else:
    q = torch.randn((100, hkv * group, d), dtype=dt, device="cuda")
    k, v = (torch.randn((300, hkv, d), dtype=dt, device="cuda") for _ in range(2))
    call = lambda: NC.single_prefill(q, k, v, **variant)
t2 = time.perf_counter()
if prof is not None:
    prof.enable()
call()
torch.cuda.synchronize()
t3 = time.perf_counter()
if prof is not None:
    import io, pstats
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    open(sys.argv[6], "w").write(f"first call {t3 - t2:.3f} s under the profiler\n" + text.getvalue())
print("@@" + json.dumps({"import_s": t1 - t0, "first_call_s": t3 - t2}))
'''


def bench_first_call(recs, quick, save=None, profile_dir=None):
    """First-call latency of each configuration in a new process, cold and from the
    on-disk cache; with ``profile_dir``, one more cached call of each runs under
    cProfile and writes ``first_profile_<op>_<dtype>.txt`` there (not a record)."""
    configs = [("decode", "f16", 4, 128, {}), ("decode", "bf16", 1, 64, {"logits_soft_cap": 30.0}),
               ("prefill", "f16", 4, 128, {"causal": True}), ("prefill", "f32", 1, 64, {"window_left": 64})]
    if quick:
        configs = configs[:1] + configs[2:3]
    cache_dir = tempfile.mkdtemp(prefix="nbattn-kcache-")
    script = Path(cache_dir) / "first.py"
    script.write_text(_FIRST)
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, PYTHONPATH=str(ROOT))
    for kind, code, group, d, variant in configs:
        for state in ("cold", "warm"):
            out = subprocess.run([sys.executable, str(script), kind, code, str(group), str(d), json.dumps(variant)],
                                 env=env, capture_output=True, text=True, timeout=300)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("@@")), None)
            if line is None:
                print("first call failed:", out.stderr[-600:], flush=True)
                continue
            res = json.loads(line[2:])
            case = {"op": kind, "dtype": code, "group": group, "head_dim": d, "variant": json.dumps(variant),
                    "cache": state}
            recs.append({"case": case, "metric": "first_call_s", "value": res["first_call_s"], "unit": "s",
                         "peers": {}})
            print("first call", kind, code, group, d, variant, state, round(res["first_call_s"], 2), "s", flush=True)
            if save is not None:
                save(recs)             # a visit cut short keeps what ran
        if profile_dir is not None:
            path = Path(profile_dir) / f"first_profile_{kind}_{code}.txt"
            subprocess.run([sys.executable, str(script), kind, code, str(group), str(d), json.dumps(variant),
                            str(path)], env=env, capture_output=True, text=True, timeout=300)


def figure(recs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dec = [r for r in recs if r["metric"] == "bw_fraction"]
    labels = sorted({(r["case"]["batch"], r["case"]["kv_len"], r["case"]["group"]) for r in dec},
                    key=lambda x: (x[0], x[1], x[2]))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    modes = ["eager_plain", "eager_run", "graph_replay", "sdpa_cudnn", "sdpa_flash"]
    wd = 0.16
    for j, m in enumerate(modes):
        vals = []
        for lab in labels:
            sel = [r for r in dec if (r["case"]["batch"], r["case"]["kv_len"], r["case"]["group"]) == lab]
            if m.startswith("sdpa"):
                v = next((r["peers"].get(m) for r in sel if r["peers"].get(m) is not None), None)
            else:
                v = next((r["value"] for r in sel if r["case"]["mode"] == m), None)
            vals.append(np.nan if v is None else v)
        ax.bar(np.arange(len(labels)) + (j - 2) * wd, vals, wd, label=m.replace("_", " "))
    ax.set_xticks(np.arange(len(labels)), [f"b{b} x {k // 1024}k\ngroup {g}" for b, k, g in labels], fontsize=8)
    ax.set_ylabel("fraction of copy bandwidth")
    ax.set_title("decode through the public API (measured, same run)")
    ax.legend(fontsize=7, ncol=3)
    host = [r for r in recs if r["metric"] == "host_us" and r["case"]["op"] == "decode"]
    if not host:                      # a run of the plan() part alone: no per-call host records
        fig.tight_layout()
        fig.savefig(path, dpi=130)
        return
    labs = [f"b{r['case']['batch']}x{r['case']['kv_len'] // 1024}k g{r['case']['group']} {r['case']['call']}"
            for r in host]
    ax2.barh(np.arange(len(host)), [r["value"] for r in host], color="#4477aa")
    ax2.set_yticks(np.arange(len(host)), labs, fontsize=6)
    ax2.set_xscale("log")
    from matplotlib.ticker import NullFormatter
    ticks = [t for t in (10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
             if min(r["value"] for r in host) / 2 <= t <= max(r["value"] for r in host) * 2]
    ax2.set_xticks(ticks, [str(t) for t in ticks])
    ax2.xaxis.set_minor_formatter(NullFormatter())      # the minor labels overlap
    ax2.set_xlabel("host microseconds per call (no sync)")
    ax2.set_title("host cost of a call")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", required=True, help="the nbattn commit measured (recorded in the file)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/nbattn_out"))
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--profile-first", default=None, metavar="DIR",
                    help="also profile one cached first call per configuration into DIR")
    ap.add_argument("--skip", nargs="*", default=[], help="parts to skip: decode prefill plan first")
    ap.add_argument("--prefill", choices=("both", "full", "causal"), default="both",
                    help="which 8k prefill cases to run (default both)")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    recs: list = []

    def save(recs):
        """Write eager.json and first_call.json with what has run so far (a visit cut short
        keeps it)."""
        from nbattn.perf import results
        for suite, part in (("eager", [r for r in recs if r["metric"] != "first_call_s"]),
                            ("first_call", [r for r in recs if r["metric"] == "first_call_s"])):
            if part:
                results.write_suite(
                    suite, part, gpu=torch.cuda.get_device_name(),
                    command="PYTHONPATH=$PWD python3 benchmarks/gpu_eager.py " + " ".join(argv or sys.argv[1:]),
                    versions={"nbattn_commit": args.commit, "torch": torch.__version__, "numpy": np.__version__,
                              "python": platform.python_version()},
                    date=datetime.date.today().isoformat(), root=Path(args.out), copy_bandwidth_GBps=copy_bw)
    cases = [(64, 4096, 8), (64, 4096, 4), (64, 16384, 8), (64, 16384, 4), (1, 32768, 8), (1, 32768, 4),
             (16, 2048, 8)]
    if args.quick:
        cases = [(64, 4096, 8), (1, 32768, 8), (1, 32768, 4)]
    if "decode" not in args.skip:
        for b, k, h in cases:
            bench_decode(recs, b, k, h, copy_bw, gen, args.quick)
            torch.cuda.empty_cache()
            save(recs)
    if "prefill" not in args.skip:
        for causal in {"both": (False, True), "full": (False,), "causal": (True,)}[args.prefill]:
            bench_prefill(recs, 8192, causal, gen)
            save(recs)
    if "plan" not in args.skip:
        bench_plan(recs)
        save(recs)
    if "first" not in args.skip:
        bench_first_call(recs, args.quick, save, args.profile_first)
    save(recs)
    figure(recs, Path(args.out) / "eager.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
