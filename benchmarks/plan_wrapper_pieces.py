"""Where the decode wrapper's plan() spends its host time on the machine it runs on:
the wrapper's own plan() and, with the arguments that plan() passed on, each piece
alone (the page-table check, the planner, the staging of the arrays), batch 1 / 64 /
1024, lengths 1..8191, page 16, 32/8 heads, head_dim 128 (the cases of
``plan_tree_ab.py``).  It also records the planner's CTA count and chunk limit, which
depend on the GPU (its SM count and the decode path).

    PYTHONPATH=$PWD python3 benchmarks/plan_wrapper_pieces.py [--commit SHA] [--out FILE]

Median of 200 calls after 20.  In the simulator the copies are skipped, as in
``plan_tree_ab.py``.  Prints (and writes) one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import host_us  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch
    import nbattn.cuda as NC
    import nbattn.cuda.decode_wrapper as DW
    from nbattn import layout as L
    from nbattn.cuda.host import hostwork as HW
    import importlib
    SP = importlib.import_module("nbattn.sched.plan")

    gpu = torch.cuda.is_available()
    res = {"commit": args.commit, "device": torch.cuda.get_device_name() if gpu else "cpu (simulator, copies skipped)",
           "cases": {}}
    rng = np.random.default_rng(5)
    seen = {}
    real = SP.plan_lengths

    def spy(qo, kv, num_ctas, tile_q=None, **kw):        # the planner's arguments, as plan() passed them
        seen.update(qo=qo, kv=kv, num_ctas=num_ctas, tile_q=tile_q, kw=kw)
        return real(qo, kv, num_ctas, tile_q, **kw)

    for batch in (1, 64, 1024):
        pkv = L.PagedKV.allocate(rng.integers(1, 8192, size=batch), 16, rng=rng)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda" if gpu else "cpu")
        w = NC.BatchDecodeWithPagedKVCacheWrapper(ws if gpu else ws.numpy(), "NHD")
        if not gpu:
            w._h2d.copy = lambda *a, **k: None
        args_ = (pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len, 32, 8, 128, 16)
        DW.plan_lengths = spy
        w.plan(*args_)
        DW.plan_lengths = real
        p = w._plan
        case = {"num_ctas": int(p.num_ctas), "chunk_limit": int(p.chunk_limit), "num_items": int(p.num_items),
                "pages": int(pkv.paged_kv_indices.size),
                "plan_us": host_us(lambda: w.plan(*args_), 200, 20)}
        if seen:
            case["planner_us"] = host_us(lambda: real(seen["qo"], seen["kv"], seen["num_ctas"], seen["tile_q"],
                                                      **seen["kw"]), 200, 20)
        case["page_table_us"] = host_us(lambda: HW.checked_page_table(*args_[:3], 16, SP.INT32_MAX), 200, 20)
        case["kv_lengths_us"] = host_us(lambda: HW.kv_lengths(pkv.paged_kv_indptr, pkv.paged_kv_last_page_len, 16),
                                        200, 20)
        res["cases"][f"b{batch}"] = case
        seen.clear()
        print(f"b{batch}", json.dumps(case), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
