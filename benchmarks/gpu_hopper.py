"""The first Hopper attention tile (``nbattn/cuda/kernels/prefill_wgmma.py``) timed
beside SDPA flash and cuDNN in the same run (issue 20; GPU only, compute
capability 9.0).

One request, fp16, head_dim 128, 32 query and 8 KV heads, q and K/V of
``--lens`` tokens (default 8192), full and causal.  Per case: the tile's output
against SDPA's (max |difference|, after the tile's own check against the golden
model in ``tests/test_wgmma.py``), and TFLOP/s (causal FLOPs halved) from CUDA
events around single calls (``_timing.events_ms``), with the SDPA backends as
peers.  The tile is launched directly (it is not behind a public form yet):
this measures the kernel, not the public path.

    PYTHONPATH=$PWD python3 benchmarks/gpu_hopper.py --commit SHA [--out DIR]

writes ``<out>/prefill_hopper.json``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import nbattn  # noqa: E402,F401
from _timing import events_ms  # noqa: E402
from numba import cuda  # noqa: E402

HQ, HKV, D = 32, 8, 128


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", required=True, help="the nbattn commit measured (recorded in the file)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/nbattn_out"))
    ap.add_argument("--lens", type=int, nargs="*", default=[8192])
    args = ap.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    from nbattn.cuda.kernels.prefill_wgmma import BLOCK_M, THREADS, prefill_wgmma_kernel
    from nbattn.perf import results
    gen = torch.Generator(device="cuda").manual_seed(0)
    recs = []
    for n in args.lens:
        q = torch.randn((n, HQ, D), dtype=torch.float16, device="cuda", generator=gen)
        k, v = (torch.randn((n, HKV, D), dtype=torch.float16, device="cuda", generator=gen) for _ in range(2))
        qd, kd, vd = (cuda.as_cuda_array(x.view(torch.int16)).view(np.uint16) for x in (q, k, v))
        o = torch.empty((n, HQ, D), dtype=torch.float32, device="cuda")
        lse = torch.empty((n, HQ), dtype=torch.float32, device="cuda")
        od, ld = cuda.as_cuda_array(o), cuda.as_cuda_array(lse)
        stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        for causal in (False, True):
            kern = prefill_wgmma_kernel(causal)
            grid = ((n + BLOCK_M - 1) // BLOCK_M, HQ)
            scale = np.float32(np.log2(np.e) / np.sqrt(D))
            run = lambda: kern[grid, THREADS, stream](qd, kd, vd, od, ld, scale, HQ // HKV)  # noqa: E731
            flops = 4.0 * n * n * HQ * D * (0.5 if causal else 1.0)
            tf = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
            run()
            torch.cuda.synchronize()
            peers, err = {}, None
            for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                                  ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    def f(backend=backend):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
                    ref = f()[0].transpose(0, 1)
                    if err is None:
                        err = float((o - ref.float()).abs().max())
                    peers[name] = tf(events_ms(f, 5))
                except Exception as exc:  # noqa: BLE001
                    print(name, "failed:", repr(exc)[:160], flush=True)
                    peers[name] = None
            value = tf(events_ms(run, 5))
            case = {"op": "single_prefill", "kernel": "prefill_wgmma", "q_len": n, "kv_len": n, "causal": causal,
                    "num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "dtype": "float16"}
            recs.append({"case": case, "metric": "tflops", "value": value, "unit": "TFLOP/s", "peers": peers})
            if err is not None:
                recs.append({"case": dict(case, compared="nbattn vs sdpa"), "metric": "max_abs_err",
                             "value": err, "unit": "", "peers": {}})
            print(f"n={n} causal={causal}: {value:.1f} TFLOP/s, peers {peers}, max |o - sdpa| {err}", flush=True)
    path = results.write_suite(
        "prefill_hopper", recs, gpu=torch.cuda.get_device_name(),
        command="PYTHONPATH=$PWD python3 benchmarks/gpu_hopper.py " + " ".join(argv or sys.argv[1:]),
        versions={"nbattn_commit": args.commit, "torch": torch.__version__, "numpy": np.__version__,
                  "python": platform.python_version()},
        date=datetime.date.today().isoformat(), root=Path(args.out))
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
