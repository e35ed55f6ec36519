"""Which CTA shape suits an fp8 cache on the tensor-core decode path: a sweep of
``DecodeTuning.tc_shape`` (warps a CTA, CTAs an SM) at batch 64 x 4k, group 4,
head_dim 128, page 16, fp16 q, through the decode wrapper (plan once, run()
replayed in a CUDA graph), for the fp16 cache and the e4m3fn cache of the same
values.  An fp8 token is half the bytes of an fp16 one, so a warp holds half as
many bytes in flight per step; shapes with 8 warps an SM or fewer also run K one
step ahead (``decode_tc``), which the default 6 x 2 does not.

    PYTHONPATH=$PWD python3 benchmarks/fp8_tc_shape_ab.py --commit SHA [--out DIR]

writes ``<out>/fp8_tc_shape_ab.json`` (records ``latency_us`` and ``bw_fraction``
with ``case.tc_shape`` and ``case.kv_dtype``; copy bandwidth of the same run).
Under the simulator it is a dry run at tiny shapes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import nbattn.cuda as NC  # noqa: E402
from nbattn.cuda.blocks.primitives import SIMULATOR  # noqa: E402
from nbattn.cuda.tuning import DECODE  # noqa: E402
from _timing import copy_bandwidth  # noqa: E402
from gpu_fp8 import (D, DEV, GROUP, HQ, K_SCALE, KV, PS, V_SCALE, caches, graph_replay_ms, sync,  # noqa: E402
                     write_suite)

SHAPES = [(6, 2), (4, 2), (8, 1), (4, 3), (8, 2), (2, 4)]


def main(argv=None) -> int:
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/nbattn_out"))
    ap.add_argument("--budget-s", type=float, default=150.0)
    args = ap.parse_args(argv)
    batch, kv_len = (2, 24) if SIMULATOR else (64, 4096)
    hkv = HQ // GROUP
    copy_bw = copy_bandwidth(SIMULATOR)
    q, cs, meta, lens = caches(batch, kv_len, hkv, 7)
    recs = []
    for shape in SHAPES[:2] if SIMULATOR else SHAPES:
        if time.perf_counter() - t0 > args.budget_s:
            print(f"time budget spent: skipping {shape}", flush=True)
            continue
        for kv in ("float16", "float8_e4m3fn"):
            fp8 = kv.startswith("float8")
            ws = torch.empty((8 << 20) if SIMULATOR else (256 << 20), dtype=torch.uint8, device=DEV)
            w = NC.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", num_ctas=4 if SIMULATOR else None)
            w.plan(*meta, HQ, hkv, D, PS, q_data_type=torch.float16, kv_data_type=KV[kv] if fp8 else None,
                   tuning=DECODE.replace(tc_shape=shape))
            fn = ((lambda: w.run(q, cs[kv], k_scale=K_SCALE, v_scale=V_SCALE)) if fp8 else
                  (lambda: w.run(q, cs[kv])))
            fn()
            sync()
            ms, graphed = graph_replay_ms(fn)
            nbytes = 2 * int(lens.sum()) * hkv * D * (1 if fp8 else 2) + 2 * 2 * batch * HQ * D
            bw = nbytes / (ms * 1e-3) / 1e9 / copy_bw
            case = {"op": "decode", "batch": batch, "kv_len": kv_len, "num_qo_heads": HQ, "num_kv_heads": hkv,
                    "head_dim": D, "page_size": PS, "q_dtype": "float16", "kv_dtype": kv,
                    "tc_shape": list(shape), "path": w._cfg.path, "mode": "graph_replay", "graphed": graphed}
            recs.append({"case": case, "metric": "latency_us", "value": ms * 1e3, "unit": "us", "peers": {}})
            recs.append({"case": case, "metric": "bw_fraction", "value": bw, "unit": "of copy bandwidth",
                         "peers": {}})
            print(f"tc_shape {shape} {kv:14s} path {w._cfg.path}: {ms * 1e3:8.1f} us, {bw:.3f} of copy "
                  f"bandwidth", flush=True)
            del w, ws
    path = write_suite("fp8_tc_shape_ab", recs, "fp8_tc_shape_ab.py", argv, args, copy_bw)
    print(f"wrote {path} ({len(recs)} records) in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
