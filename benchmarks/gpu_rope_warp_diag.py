"""The warp decode path with RoPE under other register budgets (issue 19, a diagnosis).

RoPE decode runs on the warp path, whose launch bounds ask for 4 CTAs an SM (128
registers a thread) with 3 tokens in flight a row at 4 heads a CTA; turning each key
adds registers, and ptxas (``benchmarks/ptx_without_gpu.py``) reports spills there.
This times the decode wrapper's ``run()`` (public API, ``tuning=`` of ``plan()``) under
each (``warp_unroll``, ``warp_min_blocks``) pair, replayed in a CUDA graph and eager,
at batch 64 x 4k and 1 x 32k, group 4 and 8, with the copy bandwidth of the same run.

    PYTHONPATH=$PWD python3 benchmarks/gpu_rope_warp_diag.py --commit SHA [--out FILE]

Prints one line per record and writes one JSON object.  Runs only on a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import copy_bandwidth, eager_ms, graph_ms  # noqa: E402

HQ, D, PS = 32, 128, 16
SHAPES = ((3, 4), (2, 4), (2, 3), (3, 3))       # (tokens in flight, CTAs an SM); (3, 4) is the default


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import nbattn.cuda as NC
    from nbattn import layout as L
    from nbattn.cuda.tuning import DECODE
    bw = copy_bandwidth()
    recs = []
    for batch, kv_len in ((64, 4096), (1, 32768)):
        for hkv in (8, 4):
            pkv = L.PagedKV.allocate(np.full(batch, kv_len), PS, rng=np.random.default_rng(1))
            gen = torch.Generator(device="cuda").manual_seed(1)
            cache = torch.randn((pkv.num_pages, 2, PS, hkv, D), dtype=torch.float16, device="cuda", generator=gen)
            q = torch.randn((batch, HQ, D), dtype=torch.float16, device="cuda", generator=gen)
            nbytes = batch * kv_len * hkv * D * 2 * 2
            first = None
            for unroll, mb in SHAPES:
                ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
                w = NC.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
                w.plan(pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len, HQ, hkv, D, PS,
                       pos_encoding_mode="ROPE_LLAMA",
                       tuning=DECODE.replace(warp_unroll=unroll, warp_min_blocks=mb))
                run = lambda: w.run(q, cache)  # noqa: E731
                o = run()
                torch.cuda.synchronize()
                first = o.clone() if first is None else first
                ms, graphed = graph_ms(run)
                rec = {"batch": batch, "kv_len": kv_len, "group": HQ // hkv, "warp_unroll": unroll,
                       "warp_min_blocks": mb, "graph_us": ms * 1e3, "graphed": graphed,
                       "eager_us": eager_ms(run, 20) * 1e3,
                       "graph_bw_fraction": nbytes / (ms * 1e-3) / 1e9 / bw,
                       "max_abs_diff_to_default": float((o.float() - first.float()).abs().max())}
                recs.append(rec)
                print(json.dumps(rec), flush=True)
            torch.cuda.empty_cache()
    text = json.dumps({"commit": args.commit, "gpu": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw,
                       "records": recs}, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
