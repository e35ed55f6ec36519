"""Does a second process start without recompiling?  (issue 3: on-disk cache)

    PYTHONPATH=$PWD python3 benchmarks/gpu_cache_check.py     # writes $OUT/cache.json

A fresh NUMBA_CACHE_DIR; the same small decode call (tensor-core path, fp16,
d128, group 4) and a prefill call (pipelined tensor-core kernel, d128) in
three processes in a row: the first compiles and writes the cache, the next
two should load.  Each child reports its first-call wall time (including the
kernel load or compile) and numba's cache hit/miss counts.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, time
import numpy as np
import nbattn, torch
from nbattn.cuda import batch_decode_paged, batch_prefill_paged
from nbattn.cuda import decode as DEC, merge as M, prefill as P
torch.zeros(1, device="cuda")
rng = np.random.default_rng(0)
page, hk, hq, d = 16, 8, 32, 128
lens = np.array([300, 41, 1000])
n = -(-lens // page)
indptr = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
indices = np.arange(n.sum(), dtype=np.int32)
last = (lens - (n - 1) * page).astype(np.int32)
cache = torch.randn((int(n.sum()), 2, page, hk, d), device="cuda", dtype=torch.float16)
q = torch.randn((3, hq, d), device="cuda", dtype=torch.float16)
t = time.time()
batch_decode_paged(q, cache, indptr, indices, last)
torch.cuda.synchronize()
decode_s = time.time() - t
qo = np.array([0, 64, 100, 164], np.int32)
qp = torch.randn((164, hq, d), device="cuda", dtype=torch.float16)
t = time.time()
batch_prefill_paged(qp, cache, qo, indptr, indices, last, causal=True)
torch.cuda.synchronize()
prefill_s = time.time() - t
kernels = list(DEC.KERNELS.values()) + list(M.KERNELS.values()) + list(P.KERNELS.values())
hits = sum(sum(k._cache_hits.values()) for k in kernels if hasattr(k, "_cache_hits"))
misses = sum(sum(k._cache_misses.values()) for k in kernels if hasattr(k, "_cache_misses"))
print(json.dumps(dict(decode_first_call_s=decode_s, prefill_first_call_s=prefill_s,
                      cache_hits=hits, cache_misses=misses)))
"""


def main():
    out = os.environ.get("OUT", "/tmp/nbattn_out")
    os.makedirs(out, exist_ok=True)
    cache_dir = tempfile.mkdtemp(prefix="nbattn_cache_")
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    runs = []
    for i in range(3):
        t = time.time()
        r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=240, env=env)
        line = [x for x in r.stdout.splitlines() if x.startswith("{")]
        rec = json.loads(line[-1]) if line else {"error": (r.stderr or r.stdout)[-1500:]}
        rec["process_wall_s"] = time.time() - t
        runs.append(rec)
        print(f"process {i + 1}:", json.dumps(rec)[:600], flush=True)
    import torch
    records = []
    for i, rec in enumerate(runs):
        for metric in ("decode_first_call_s", "prefill_first_call_s"):
            if metric in rec:
                records.append(dict(case=dict(process=i + 1, cache_dir="fresh NUMBA_CACHE_DIR",
                                              cache_hits=rec.get("cache_hits"),
                                              cache_misses=rec.get("cache_misses")),
                                    metric=metric, value=rec[metric], unit="s",
                                    peers={"first_process": runs[0].get(metric)}))
    obj = {"suite": "cache", "gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "command": "PYTHONPATH=$PWD python3 benchmarks/gpu_cache_check.py",
           "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
           "copy_bandwidth_GBps": None, "records": records}
    with open(os.path.join(out, "cache.json"), "w") as f:
        json.dump(obj, f, indent=1)


if __name__ == "__main__":
    main()
