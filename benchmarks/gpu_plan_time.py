"""plan() wall time of the decode wrapper on the GPU machine (median of 30), for
the long-variable batch of gpu_sched.py; prints one JSON line.

    PYTHONPATH=$PWD python3 benchmarks/gpu_plan_time.py
"""
import json
import statistics
import time

import numpy as np

import nbattn  # noqa: F401
import torch
from nbattn.cuda.wrappers import BatchDecodeWithPagedKVCacheWrapper

HQ, HK, D, PAGE = 32, 8, 128, 16
lens = np.random.default_rng(2026).integers(8192, 32769, 64)
n = -(-lens // PAGE)
indptr = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
indices = np.random.default_rng(1).permutation(int(n.sum())).astype(np.int32)
last = (lens - (n - 1) * PAGE).astype(np.int32)
w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD")
w.plan(indptr, indices, last, HQ, HK, D, PAGE)
times = []
for _ in range(30):
    t = time.perf_counter()
    w.plan(indptr, indices, last, HQ, HK, D, PAGE)
    times.append(time.perf_counter() - t)
torch.cuda.synchronize()
print(json.dumps({"plan_us_median": statistics.median(times) * 1e6, "plan_us_min": min(times) * 1e6,
                  "items": w.last_plan.num_items, "num_ctas": w.last_plan.num_ctas}))
