"""Host time of the pieces of a decode plan() that run on the CPU, for an A/B of two
trees on one machine (no GPU needed): the page-table check, the LPT planner with
``chunk_limit="auto"``, the staging copy and a plain decode call's work list, at batch 64
and 1024 x 4096 keys, page 16.

    PYTHONPATH=<tree> python benchmarks/plan_pieces_cpu.py --label <name> [--out FILE]

Median of 300 calls after a warm-up; prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import host_us  # noqa: E402


def median_us(f, n=300):
    return host_us(f, n, warm=1)


def call_work(indptr, indices, last, buf):
    """What ``nbattn.cuda.decode_call`` does on the host per plain decode call (64 planner
    CTAs a wave of 264 slots, no window): the checked work list, then the page ids."""
    from nbattn.cuda.host import hostwork as HW
    info = HW.decode_call_work(indptr, indices, last, 16, 2**31 - 1, (len(indptr) - 1) * 8, 264, 16, 64, -1, buf)
    o, n = int(info[7]), int(info[18])
    np.copyto(buf[o:o + n], indices)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import nbattn  # noqa: F401
    from nbattn.cuda.host import hostwork as HW
    from nbattn.sched.plan import plan

    rec = {"label": args.label, "cpu": platform.processor() or platform.machine(), "cases": {}}
    for batch in (64, 1024):
        pages = batch * 256
        indptr = np.arange(0, pages + 1, 256, dtype=np.int32)
        indices = np.random.default_rng(0).permutation(pages).astype(np.int32)
        last = np.full(batch, 16, np.int32)
        kv, qo = np.full(batch, 4096, np.int64), np.ones(batch, np.int64)
        host = np.zeros(pages + 4096, np.int32)
        offsets = np.array([0, pages + 8], np.int64)
        rec["cases"][f"b{batch}"] = {
            "page_table_us": median_us(lambda: HW.page_table(indptr, indices, last, 16, 2**31 - 1)),
            "plan_auto_us": median_us(lambda: plan(qo, kv, 33, tile_q=4, group=4, chunk_overhead=64.0,
                                                   chunk_limit="auto")),
            "stage_us": median_us(lambda: HW.stage_arrays(host, offsets, (indices, indptr), 4096)),
            # a plain decode call's compiled work list plus its copy of the page ids
            "call_work_us": median_us(lambda: call_work(indptr, indices, last, host)),
        }
    text = json.dumps(rec, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
