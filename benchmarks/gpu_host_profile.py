"""Where the host time of a public call goes (GPU only; diagnosis, not a result file).

    PYTHONPATH=$PWD python3 benchmarks/gpu_host_profile.py [--out DIR]

cProfile over many calls of each public entry point as a user makes it (torch
CUDA tensors, NumPy page tables): the plain decode, the decode wrapper's run()
and plan(), the prefill wrapper's run() and plan(), and single_prefill.  Writes
``<out>/host_profile.txt``: per call, the functions with the most own time and
the most cumulative time.  The timings themselves live in ``gpu_eager.py``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_eager as E  # noqa: E402
import nbattn.cuda as NC  # noqa: E402
from nbattn import layout as L  # noqa: E402


def profile(name, fn, n, out):
    fn()
    torch.cuda.synchronize()
    us = E.host_us(fn, n, 20)
    out.write(f"\n##### {name}: {us:.1f} us per call without the profiler (median)\n")
    pr = cProfile.Profile()
    pr.enable()
    for i in range(n):
        fn()
        if i % 20 == 19:
            torch.cuda.synchronize()
    pr.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(22)
        out.write(f"\n===== {name}: {n} calls, sorted by {key}\n" + s.getvalue().split("\n", 4)[-1])
    print("profiled", name, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/nbattn_out"))
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = open(Path(args.out) / "host_profile.txt", "w")
    for batch, kv_len, hkv in ((64, 4096, 8), (64, 16384, 8), (1, 32768, 8), (1, 32768, 4)):
        q, cache, meta, pkv, _ = E.decode_case(batch, kv_len, hkv, gen)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = NC.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(*meta, E.HQ, hkv, E.D, E.PS)
        tag = f"decode b{batch} x {kv_len} g{E.HQ // hkv}"
        profile(f"{tag} plain", lambda: NC.batch_decode_paged(q, cache, *meta), 200, out)
        profile(f"{tag} run", lambda: w.run(q, cache), 400, out)
        profile(f"{tag} plan", lambda: w.plan(*meta, E.HQ, hkv, E.D, E.PS), 200, out)
    rng = np.random.default_rng(5)
    pkv = L.PagedKV.allocate(rng.integers(1, 8192, size=1024), E.PS, rng=rng)
    w = NC.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    profile("decode plan b1024", lambda: w.plan(pkv.paged_kv_indptr, pkv.paged_kv_indices,
                                                pkv.paged_kv_last_page_len, E.HQ, 8, E.D, E.PS), 100, out)
    n = 2048
    q, k, v = (torch.randn((n, E.HQ, E.D), dtype=torch.float16, device="cuda", generator=gen) for _ in range(3))
    pkv = L.PagedKV.allocate([n], E.PS)
    cache = torch.stack([k, v], 1).reshape(n // E.PS, E.PS, 2, E.HQ, E.D).transpose(1, 2).contiguous()
    ws = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    w = NC.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    indptr = np.array([0, n], np.int32)
    plan = lambda: w.plan(indptr, pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len,  # noqa: E731
                          E.HQ, E.HQ, E.D, E.PS, causal=True)
    plan()
    profile("prefill 2k causal single_prefill", lambda: NC.single_prefill(q, k, v, causal=True), 60, out)
    profile("prefill 2k causal run", lambda: w.run(q, cache), 200, out)
    profile("prefill 2k causal plan", plan, 100, out)
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
