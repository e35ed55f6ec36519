"""The decode wrapper's plan() host time of several source trees, alternated on one
machine (host timings of the lent machines vary up to 2x between visits, so an A/B
runs in one visit): each round runs every tree in a fresh process, batch 1 / 64 / 1024,
lengths 1..8191, page 16, 32/8 heads, head_dim 128; median of 200 calls after 20.

    PYTHONPATH=$PWD python3 benchmarks/plan_tree_ab.py --trees _ab/<old> . --rounds 3 [--prefill] [--out FILE]

``--prefill`` adds the prefill wrapper's plan() of one 8k x 8k causal request (32/32
heads, head_dim 128, page 16; on the CPU over a 132-CTA grid).

On a GPU the workspace is a torch CUDA tensor and the copies are real. In the
simulator the copies are skipped (staging still runs) and the planner balances over
33 CTAs a KV head, as on an H100/H200 at 32/8 heads, so a CPU run compares the trees'
host work without the driver calls, not what a GPU host measures.  Prints (and writes) one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_ONE = r'''
import json, sys, os
sys.path.append(os.environ["NBATTN_AB_HERE"])          # _timing
import numpy as np, torch
import nbattn, nbattn.cuda as NC
from nbattn import layout as L
from _timing import host_us
rng = np.random.default_rng(5)
res = {"nbattn": os.path.dirname(nbattn.__file__),      # which tree was imported
       "device": "gpu" if torch.cuda.is_available() else "cpu (simulator, copies skipped)"}
for batch in (1, 64, 1024):
    pkv = L.PagedKV.allocate(rng.integers(1, 8192, size=batch), 16, rng=rng)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    # on the CPU: a grid of 33 CTAs a KV head, what the H100/H200 plans for at 32/8 heads
    w = (NC.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD") if dev == "cuda"
         else NC.BatchDecodeWithPagedKVCacheWrapper(ws.numpy(), "NHD", num_ctas=33))
    if dev == "cpu":                # the simulator's copies are Python loops: time the host work alone
        w._h2d.copy = lambda *a, **k: None
    fn = lambda: w.plan(pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len, 32, 8, 128, 16)
    fn()
    res[str(batch)] = host_us(fn, 200, 20)
if os.environ.get("NBATTN_AB_PREFILL"):        # the prefill wrapper: 8k x 8k causal, 32/32 heads (eager.json's case)
    n, dev = 8192, ("cuda" if torch.cuda.is_available() else "cpu")
    pkv = L.PagedKV.allocate([n], 16)
    ws = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    w = (NC.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD") if dev == "cuda"
         else NC.BatchPrefillWithPagedKVCacheWrapper(ws.numpy(), "NHD", num_ctas=132))
    if dev == "cpu":
        w._h2d.copy = lambda *a, **k: None
    qo_indptr = np.array([0, n], np.int32)
    fn = lambda: w.plan(qo_indptr, pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len,
                        32, 32, 128, 16, causal=True)
    fn()
    res["prefill_8k_causal"] = host_us(fn, 200, 20)
print("@@" + json.dumps(res))
'''


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs="+", required=True, help="source trees, each holding an nbattn/ package")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None, help="the commit measured (default: git HEAD here)")
    ap.add_argument("--prefill", action="store_true",
                    help="also the prefill wrapper's plan(), 8k x 8k causal, 32/32 heads, page 16")
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    runs = []
    for r in range(args.rounds):
        for tree in args.trees:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), NBATTN_AB_HERE=here,
                       NBATTN_AB_PREFILL="1" if args.prefill else "")
            out = subprocess.run([sys.executable, "-c", _ONE], env=env, cwd=os.path.abspath(tree),  # "" on sys.path is the tree
                                 capture_output=True, text=True, timeout=300)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("@@")), None)
            if line is None:
                print("failed:", tree, out.stderr[-800:], flush=True)
                continue
            rec = dict(json.loads(line[2:]), tree=tree, round=r)
            runs.append(rec)
            print(json.dumps(rec), flush=True)
    result = {"what": "decode wrapper plan() host us, median of 200", "runs": runs,
              "commit": args.commit or _commit()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
