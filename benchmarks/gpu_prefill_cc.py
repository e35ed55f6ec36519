"""The register-tiled CUDA-core prefill path (nbattn.cuda.kernels.prefill_cc) on the GPU,
beside the fp32 FMA roof measured in the same run.

    PYTHONPATH=$PWD python3 benchmarks/gpu_prefill_cc.py [--out DIR] [--budget-s S] [--no-checks]
        [--alts "longest_first=0;policy=keys"]     (writes --out, default $OUT or benchmarks/results)

One run, in this order (so a time-out still leaves the most useful part):
1. fp32 FMA roof: a numba kernel of 16 independent FMA chains per thread over
   a grid that fills the device, and cuBLAS SGEMM (torch fp32 matmul, TF32
   off) 8192^3 as a library peer;
2. GPU differential checks of the CUDA-core path (``tensor_cores=False``)
   against the golden model (nbattn.reference) on fresh random inputs,
   outputs poisoned with NaN first: fp16/bf16/fp32, head_dim 64/128, causal
   and not, paged page sizes 1/5/16, GQA 4, variants, the timed kernel at a
   smaller length, the plan/run wrapper (persistent entry);
3. timings (CUDA events around the recorded launches, warm-up, median) at
   batch 1 x 8k x 8k, 32 query / 8 KV heads, head_dim 128, fp16, contiguous
   KV, causal and not; alternative tunings (``--alts``); the teaching tile
   ``core_tile`` at 2k x 2k beside the register-tiled path at 2k x 2k.

Every alternative is a :class:`nbattn.cuda.tuning.PrefillTuning` passed as
``tuning=`` (:func:`alternative`); the kernels of each are their own builds.

FLOPs: 4 * l_q * l_kv * head_dim per query head, halved for causal.
Writes ``prefill_cuda_core.json`` (result-file format, docs/gpu.md) and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import math
import os
import platform
import time
import traceback
import zlib

import numpy as np
import torch
from numba import cuda, float32

import nbattn  # noqa: F401  (compat shim before numba.cuda kernels)
from nbattn import layout as L

from _timing import events_ms  # noqa: E402  (benchmarks/ is the script's folder)
from nbattn import reference as R
from nbattn.cuda import prefill as P
from nbattn.cuda.host.driver import launch as launch_kernel
from nbattn.cuda.kernels import prefill_cc as CC
from nbattn.cuda.tuning import PREFILL
from nbattn.perf import results

OUT = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")   # --out's default
T0 = time.time()
BUDGET_S = 330.0                                          # optional parts stop past this (--budget-s)
DATASHEET_FP32 = 67.0                                     # H200 SXM fp32 (non-tensor) TFLOP/s
RECORDS: list = []
LOG: list = []


def say(*a):
    msg = " ".join(str(x) for x in a)
    LOG.append(msg)
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def left() -> float:
    return BUDGET_S - (time.time() - T0)


def save():
    """Write what we have (called after every stage: a time-out keeps the rest)."""
    roof = next((r["value"] for r in RECORDS if r["metric"] == "tflops"
                 and r["case"].get("kernel") == "numba_fma_chains"), None)
    results.write_suite(
        "prefill_cuda_core", RECORDS, gpu=torch.cuda.get_device_name(),
        command="PYTHONPATH=$PWD python3 benchmarks/gpu_prefill_cc.py",
        versions={"torch": torch.__version__, "numpy": np.__version__,
                  "numba_cuda": importlib.metadata.version("numba-cuda"), "python": platform.python_version()},
        date=datetime.date.today().isoformat(), root=OUT)
    return roof


# ---------------------------------------------------------------------------
# 1. fp32 FMA roof
# ---------------------------------------------------------------------------
CHAINS, ROUNDS, ITERS = 16, 32, 1250


def _fma_kernel():
    """``fma_chains(out, b, c, iters)``: per thread CHAINS independent chains
    ``x = fma(x, b, c)``, ROUNDS rounds written out per loop trip (a loop over
    them was not fully unrolled), float32 throughout."""
    src = ["def fma_chains(out, b, c, iters):",
           "    i = cuda.grid(1)",
           "    one = float32(1.0)",
           "    x0 = float32(i) * float32(1e-9)"]
    src += [f"    x{k} = x{k - 1} + one" for k in range(1, CHAINS)]
    src += ["    for _ in range(iters):"]
    src += [f"        x{k} = cuda.fma(x{k}, b, c)" for _ in range(ROUNDS) for k in range(CHAINS)]
    src += ["    out[i] = " + " + ".join(f"x{k}" for k in range(CHAINS))]
    env = {"cuda": cuda, "float32": float32}
    exec(compile("\n".join(src), "<fma_chains>", "exec"), env)
    return cuda.jit(env["fma_chains"])


fma_chains = _fma_kernel()


def fp32_roof():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    threads, blocks = 256, sms * 8 * 4          # 8 blocks of 256 fill an SM's 2048 threads; 4 waves
    out = torch.empty(threads * blocks, dtype=torch.float32, device="cuda")
    d_out = cuda.as_cuda_array(out)
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    run = lambda: fma_chains[blocks, threads, stream](d_out, np.float32(0.9999), np.float32(1e-4), ITERS)
    t = time.time()
    run()
    torch.cuda.synchronize()
    compile_s = time.time() - t
    ms = events_ms(run, 7, warm=1)
    flops = 2.0 * CHAINS * ROUNDS * ITERS * threads * blocks
    roof = flops / (ms * 1e-3) / 1e12
    assert torch.isfinite(out).all()
    RECORDS.append(dict(case={"kernel": "numba_fma_chains", "chains": CHAINS, "threads": threads * blocks},
                        metric="tflops", value=roof, unit="TFLOP/s", peers={},
                        ms=ms, compile_s=compile_s, datasheet_tflops=DATASHEET_FP32))
    say(f"fp32 FMA roof (numba, {CHAINS} chains): {roof:.1f} TFLOP/s ({roof / DATASHEET_FP32:.2f} of datasheet 67)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.float32)
    bm = torch.randn(n, n, device="cuda", dtype=torch.float32)
    c = torch.empty(n, n, device="cuda", dtype=torch.float32)
    ms = events_ms(lambda: torch.matmul(a, bm, out=c), 7, warm=2)
    sgemm = 2.0 * n ** 3 / (ms * 1e-3) / 1e12
    ref = (a[:64].double() @ bm.double())
    err = float((c[:64].double() - ref).abs().max() / ref.abs().max())
    RECORDS.append(dict(case={"kernel": "cublas_sgemm", "n": n, "tf32": False}, metric="tflops", value=sgemm,
                        unit="TFLOP/s", peers={}, ms=ms, rel_err_fp64=err))
    say(f"cuBLAS SGEMM {n}^3 (TF32 off): {sgemm:.1f} TFLOP/s, rel err {err:.1e}")
    return roof, sgemm


# ---------------------------------------------------------------------------
# 2. Differential checks
# ---------------------------------------------------------------------------

def paged_case(rng, qo_lens, kv_lens, page_size, hq, hk, d, layout="NHD"):
    pool = int(sum(-(-k // page_size) for k in kv_lens)) + 3
    pkv = L.PagedKV.allocate(kv_lens, page_size, num_pages=pool, rng=rng)
    shape = (pool, 2, page_size, hk, d) if layout == "NHD" else (pool, 2, hk, page_size, d)
    cache = rng.standard_normal(shape).astype(np.float32)
    q = rng.standard_normal((sum(qo_lens), hq, d)).astype(np.float32)
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    return q, cache, qo, pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len


def compare(name, o, lse, ref, tol, case):
    """Poisoned outputs fully written, close to the golden model, -inf LSE where it is."""
    o = o.float().cpu().numpy()
    written = bool(np.isfinite(o).all())
    if isinstance(ref, tuple):
        o_r, lse_r = ref
        lse = lse.cpu().numpy()
        same_inf = bool(np.array_equal(np.isneginf(lse), np.isneginf(lse_r)))
        fin = np.isfinite(lse_r)
        lse_err = float(np.abs(lse[fin] - lse_r[fin]).max()) if fin.any() else 0.0
    else:
        o_r, same_inf, lse_err = ref, True, 0.0
    err = float(np.abs(o - o_r).max()) if written else float("inf")
    ok = written and same_inf and err <= tol and lse_err <= tol
    RECORDS.append(dict(case=dict(case, check=name), metric="ok", value=1.0 if ok else 0.0, unit="",
                        peers={}, max_abs_err=err if math.isfinite(err) else -1.0, lse_max_abs_err=lse_err,
                        all_written=written, tol=tol))
    say(f"check {name}: {'OK' if ok else 'FAIL'} max|err| {err:.2e} lse {lse_err:.2e} written {written}")
    return ok


def check_paged(name, dtype, d, page, causal, layout="NHD", tol=2e-2, **kw):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    hk, group = 2, 4
    q, cache, qo, ip, ix, lp = paged_case(rng, [1, 17, 300, 64, 0, 130], [1, 300, 1000, 2048, 40, 130], page,
                                          hk * group, hk, d, layout)
    tdt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    tq, tcache = torch.from_numpy(q).to("cuda", tdt), torch.from_numpy(cache).to("cuda", tdt)
    out = torch.full_like(tq, float("nan"))
    want_lse = not kw.get("use_sigmoid")
    lse = torch.full(tq.shape[:2], float("nan"), device="cuda") if want_lse else None
    t = time.time()
    P.batch_prefill_paged(tq, tcache, qo, ip, ix, lp, kv_layout=layout, causal=causal, return_lse=want_lse,
                          out=out, lse=lse, tensor_cores=False, **kw)
    torch.cuda.synchronize()
    first = time.time() - t
    ref = R.batch_prefill_paged(tq.float().cpu().numpy(), tcache.float().cpu().numpy(), qo, ip, ix, lp,
                                kv_layout=layout, causal=causal, return_lse=want_lse, **kw)
    case = dict(dtype=dtype, head_dim=d, page_size=page, causal=causal, layout=layout, group=group,
                variant=",".join(sorted(kw)) or "none", compile_s=round(first, 2))
    return compare(name, out, lse, ref, tol, case)


def check_single(name, n, causal, tol=2e-2):
    """The timed kernel (contiguous KV, fp16, 32/8 heads, head_dim 128) at a shorter length."""
    rng = np.random.default_rng(7 + causal)
    q = torch.from_numpy(rng.standard_normal((n, 32, 128)).astype(np.float32)).to("cuda", torch.float16)
    k = torch.from_numpy(rng.standard_normal((n + 37, 8, 128)).astype(np.float32)).to("cuda", torch.float16)
    v = torch.from_numpy(rng.standard_normal((n + 37, 8, 128)).astype(np.float32)).to("cuda", torch.float16)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device="cuda")
    P.single_prefill(q, k, v, causal=causal, return_lse=True, out=out, lse=lse, tensor_cores=False)
    torch.cuda.synchronize()
    ref = R.single_prefill(q.float().cpu().numpy(), k.float().cpu().numpy(), v.float().cpu().numpy(),
                           causal=causal, return_lse=True)
    return compare(name, out, lse, ref, tol, dict(dtype="f16", head_dim=128, q_len=n, kv_len=n + 37,
                                                  causal=causal, mode="contig"))


def check_wrapper(name):
    """The plan/run wrapper: persistent entry, split chunks written as f32 partials and merged."""
    from nbattn.cuda.wrappers import BatchPrefillWithPagedKVCacheWrapper
    rng = np.random.default_rng(77)
    hq, hk, d, page = 8, 2, 128, 16
    q, cache, qo, ip, ix, lp = paged_case(rng, [300, 1, 77, 134], [2000, 700, 77, 1500], page, hq, hk, d)
    tq, tcache = torch.from_numpy(q).to("cuda", torch.float16), torch.from_numpy(cache).to("cuda", torch.float16)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    w = BatchPrefillWithPagedKVCacheWrapper(ws, num_ctas=64)
    w.plan(qo, ip, ix, lp, hq, hk, d, page, causal=True, tensor_cores=False)
    out = torch.full_like(tq, float("nan"))
    lse = torch.full(tq.shape[:2], float("nan"), device="cuda")
    w.run(tq, tcache, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    ref = R.batch_prefill_paged(tq.float().cpu().numpy(), tcache.float().cpu().numpy(), qo, ip, ix, lp,
                                causal=True, return_lse=True)
    return compare(name, out, lse, ref, 2e-2, dict(dtype="f16", head_dim=d, page_size=page, causal=True,
                                                   mode="wrapper_persistent"))


# ---------------------------------------------------------------------------
# 3. Timings
# ---------------------------------------------------------------------------

def flops(n_q, n_kv, heads, d, causal):
    return 4.0 * n_q * n_kv * d * heads * (0.5 if causal else 1.0)


def time_single(n, causal, reps, label, n_kv=None, tuning=PREFILL):
    """(TFLOP/s, ms, compile_s, all_written) of single_prefill on the CUDA-core path
    under ``tuning``, ``n`` queries over ``n_kv`` (default ``n``) keys."""
    n_kv = n_kv or n
    torch.manual_seed(n + causal)
    q = torch.randn((n, 32, 128), device="cuda", dtype=torch.float16)
    k = torch.randn((n_kv, 8, 128), device="cuda", dtype=torch.float16)
    v = torch.randn((n_kv, 8, 128), device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    torch.cuda.synchronize()
    t = time.time()
    P.single_prefill(q, k, v, causal=causal, out=out, tensor_cores=False, tuning=tuning)      # compiles
    torch.cuda.synchronize()
    first = time.time() - t
    with P.recording() as rec:
        P.single_prefill(q, k, v, causal=causal, out=out, tensor_cores=False, tuning=tuning)
    launches = rec.launches

    def run():
        s = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        for kernel, grid, threads, args in launches:
            launch_kernel(kernel, grid, threads, s, args)     # passes a tile's dynamic shared memory

    out.fill_(float("nan"))
    run()
    torch.cuda.synchronize()
    written = bool(torch.isfinite(out).all())
    ms = events_ms(run, reps, warm=1)
    tf = flops(n, n_kv, 32, 128, causal) / (ms * 1e-3) / 1e12
    say(f"{label}: 1 x {n} x {n_kv} {'causal' if causal else 'full  '} {ms:8.2f} ms {tf:6.2f} TFLOP/s "
        f"(compile {first:.1f} s, written {written}, tiles {launches[0][1]} x {launches[0][2]} threads)")
    return tf, ms, first, written


def alternative(alt: str):
    """``(tuning, q_len, kv_len, modes)`` of one ``--alts`` entry: '+'-joined settings of
    PrefillTuning fields -- ``policy=rows|keys``, ``smem=BYTES`` (smem_budget),
    ``max_tile_k=N``, ``longest_first=0|1`` -- or ``shape=QxK`` (full only: the same
    FLOPs in another grid, e.g. 16384x4096 = twice the CTAs at half the keys each)."""
    settings = dict(kv.split("=") for kv in alt.split("+"))
    unknown = set(settings) - {"policy", "smem", "max_tile_k", "longest_first", "shape"}
    if unknown:
        raise ValueError(f"--alts: unknown settings {sorted(unknown)} in {alt!r}")
    changes = {}
    if "policy" in settings:
        changes["policy"] = settings["policy"]
    if "smem" in settings:
        changes["smem_budget"] = int(settings["smem"])
    if "max_tile_k" in settings:
        changes["max_tile_k"] = int(settings["max_tile_k"])
    if "longest_first" in settings:
        changes["longest_first"] = settings["longest_first"] == "1"
    nq, nk = (int(x) for x in settings.get("shape", "8192x8192").split("x"))
    modes = (True,) if "longest_first" in settings else (False,) if "shape" in settings else (False, True)
    return PREFILL.replace(**changes), nq, nk, modes


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=OUT, help="folder for prefill_cuda_core.json (default $OUT or benchmarks/results)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds after which optional parts stop")
    ap.add_argument("--no-checks", action="store_true",
                    help="skip the checks and the 2k comparison (a run that times alternatives only)")
    ap.add_argument("--alts", default="longest_first=0;policy=keys",
                    help="';'-separated alternatives, each '+'-joined settings (see alternative())")
    return ap.parse_args(argv)


def main(argv=None):
    global OUT, BUDGET_S
    args = parse_args(argv)
    OUT, BUDGET_S = args.out, args.budget_s
    os.makedirs(OUT, exist_ok=True)
    say("device", torch.cuda.get_device_name(), "| lane grids", PREFILL.lane_grids, "policy", PREFILL.policy,
        "unroll", PREFILL.unroll, "longest_first", PREFILL.longest_first,
        "| tiles d128 f16", CC.cuda_core_tiles(128, "f16"))
    roof, sgemm = fp32_roof()
    save()

    target = dict(batch=1, q_len=8192, kv_len=8192, num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype="fp16",
                  kv="contig")
    # The timed kernels first (the point of the run), then the checks.
    timed = {}
    for causal in (False, True):
        try:
            tf, ms, first, written = time_single(8192, causal, 10, "cuda-core tiled")
            timed[causal] = tf
            RECORDS.append(dict(case=dict(target, causal=causal, path="cuda_cores_tiled"), metric="tflops",
                                value=tf, unit="TFLOP/s",
                                peers={"fp32_fma_roof": roof, "cublas_sgemm_fp32": sgemm},
                                ms=ms, compile_s=first, all_written=written,
                                fraction_of_measured_fp32_roof=tf / roof,
                                fraction_of_datasheet_fp32=tf / DATASHEET_FP32,
                                tiles=list(CC.cuda_core_tiles(128, "f16"))))
            RECORDS.append(dict(case=dict(target, causal=causal, path="cuda_cores_tiled"),
                                metric="fp32_peak_fraction", value=tf / roof, unit="",
                                peers={"datasheet_67": tf / DATASHEET_FP32, "cublas_sgemm_fp32": tf / sgemm}))
        except Exception:  # noqa: BLE001
            say("timing failed:\n" + traceback.format_exc()[-1500:])
    save()

    checks = [
        lambda: check_single("timed_kernel_1k_causal", 1000, True),
        lambda: check_single("timed_kernel_1k_full", 1000, False),
        lambda: check_paged("f16_d128_page16_full", "f16", 128, 16, False),
        lambda: check_paged("f16_d128_page16_causal", "f16", 128, 16, True),
        lambda: check_paged("bf16_d64_page1_causal_hnd", "bf16", 64, 1, True, layout="HND"),
        lambda: check_paged("bf16_d128_page16_causal_window_sinks_alibi_cap", "bf16", 128, 16, True,
                            window_left=70, sink_size=3, pos_encoding_mode="ALIBI", logits_soft_cap=20.0),
        lambda: check_paged("f32_d128_page5_mask_mod", "f32", 128, 5, False, tol=2e-3,
                            mask_mod=lambda b, h, qi, kj: (qi + kj) % 3 != 0),
        lambda: check_paged("f16_d64_page16_sigmoid", "f16", 64, 16, True, use_sigmoid=True, sigmoid_bias=-1.0),
        lambda: check_wrapper("wrapper_f16_d128_page16_causal"),
    ]
    quick = args.no_checks
    for fn in ([] if quick else checks):
        if left() < 60:
            say("skipping the remaining checks (time)")
            break
        try:
            fn()
        except Exception:  # noqa: BLE001
            say("check raised:\n" + traceback.format_exc()[-1500:])
            RECORDS.append(dict(case={"check": "raised"}, metric="ok", value=0.0, unit="", peers={}))
        save()

    # The teaching tile and the register-tiled one at 2k x 2k (the teaching one is slow at 8k).
    if left() > 40 and not quick:
        try:
            tf_new, ms_new, _, _ = time_single(2048, False, 5, "cuda-core tiled")
            tf_old, ms_old, first_old, w_old = time_single(2048, False, 3, "core_tile (scalar)",
                                                           tuning=PREFILL.replace(cuda_core=False))
            case = dict(target, q_len=2048, kv_len=2048, causal=False)
            RECORDS.append(dict(case=dict(case, path="cuda_cores_tiled"), metric="tflops", value=tf_new,
                                unit="TFLOP/s", peers={"core_tile": tf_old, "fp32_fma_roof": roof}, ms=ms_new))
            RECORDS.append(dict(case=dict(case, path="cuda_cores_tiled"), metric="speedup", value=tf_new / tf_old,
                                unit="x", peers={}, over="core_tile", core_tile_ms=ms_old,
                                core_tile_all_written=w_old))
        except Exception:  # noqa: BLE001
            say("core_tile comparison failed:\n" + traceback.format_exc()[-1500:])
        save()

    # Alternatives beside the default, each at 8k x 8k full and causal (or as alternative() says),
    # e.g. --alts "policy=keys;longest_first=0;shape=16384x4096".
    alts = [a for a in args.alts.split(";") if a]
    for alt in alts:
        if left() < 40:
            say("skipping the remaining alternatives (time)")
            break
        try:
            tuning, nq, nk, modes = alternative(alt)
            for causal in modes:
                tf_alt, ms_alt, _, w_alt = time_single(nq, causal, 5, f"cuda-core tiled {alt}", n_kv=nk,
                                                       tuning=tuning)
                RECORDS.append(dict(case=dict(target, q_len=nq, kv_len=nk, causal=causal,
                                              path="cuda_cores_tiled_alt", alt=alt),
                                    metric="tflops", value=tf_alt, unit="TFLOP/s",
                                    peers={"fp32_fma_roof": roof,
                                           **({"default": timed[causal]} if causal in timed else {})}, ms=ms_alt,
                                    all_written=w_alt, tiles=list(CC.cuda_core_tiles(128, "f16", tuning))))
        except Exception:  # noqa: BLE001
            say(f"alternative {alt} failed:\n" + traceback.format_exc()[-1500:])
        save()

    oks = [r for r in RECORDS if r["metric"] == "ok"]
    print("\n| case | TFLOP/s | of measured fp32 roof | of datasheet 67 |")
    print("|---|---|---|---|")
    print(f"| fp32 FMA roof (numba) | {roof:.1f} | 1.00 | {roof / DATASHEET_FP32:.2f} |")
    print(f"| cuBLAS SGEMM (TF32 off) | {sgemm:.1f} | {sgemm / roof:.2f} | {sgemm / DATASHEET_FP32:.2f} |")
    for causal, tf in timed.items():
        print(f"| CUDA-core tiled, 1x8kx8k {'causal' if causal else 'full'} | {tf:.1f} | {tf / roof:.2f} | "
              f"{tf / DATASHEET_FP32:.2f} |")
    print(f"\nchecks: {sum(r['value'] == 1.0 for r in oks)}/{len(oks)} passed; total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
