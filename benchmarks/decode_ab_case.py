"""One decode case timed with a source tree's own benchmark code (the bisect half of gpu_decode_ab.sh).

    cd TREE && PYTHONPATH=$PWD python3 /path/to/decode_ab_case.py OUT.json [BATCH KV_LEN KV_HEADS]

Imports TREE/benchmarks/gpu_decode.py (every tree since 2026-11-29 has its
``copy_bandwidth()`` and ``bench_case(batch, kv_len, hkv, copy_bw, gen)``), times the
default path, the shared-memory path and the CUDA-core warp path of one case with
CUDA-graph replays, and writes the records with the copy bandwidth of the same run.
"""
import importlib.util
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
spec = importlib.util.spec_from_file_location("gd", os.path.join(os.getcwd(), "benchmarks", "gpu_decode.py"))
gd = importlib.util.module_from_spec(spec)
sys.argv = [sys.argv[0]] + sys.argv[1:]
out = sys.argv[1]
batch, kv_len, hkv = (int(x) for x in (sys.argv[2:5] if len(sys.argv) >= 5 else (64, 4096, 8)))
sys.argv = [sys.argv[0]]
spec.loader.exec_module(gd)
import torch  # noqa: E402

t0 = time.time()
copies = gd.copy_bandwidth()
bw = max(copies.values())
recs, peers, nbytes = gd.bench_case(batch, kv_len, hkv, bw, torch.Generator().manual_seed(0))
res = {"tree": os.getcwd(), "case": [batch, kv_len, hkv], "copy_bandwidth_GBps": bw, "peers": peers,
       "runs": [{k: (v if isinstance(v, (int, float, str, type(None))) else str(v)) for k, v in r.items()}
                for r in recs], "wall_s": time.time() - t0}
with open(out, "w") as f:
    json.dump(res, f, indent=1)
print(os.path.basename(os.getcwd()), " ".join(f"{r['path']}/{r['mode']}={r['bw']:.3f}" for r in recs),
      {k: (round(v, 3) if v else v) for k, v in peers.items()})
