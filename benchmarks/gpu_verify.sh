#!/usr/bin/env bash
# One device session for the changes since the last GPU runs, in priority order:
#   sched        benchmarks/gpu_sched.py on the current default decode path  -> $OUT/sched.json
#   t_wrappers   GPU tests of the plan/run wrappers (persistent prefill, CUDA graphs) and the cache key
#   cache        benchmarks/gpu_cache_check.py (second process vs first)       -> $OUT/cache.json
#   t_prefill    the pipelined tensor-core prefill tests a previous session's time limit cut
# Usage on the device:  bash benchmarks/gpu_verify.sh   (OUT set by the device tool)
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/nbattn_out}
mkdir -p "$OUT"
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T))"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "rc=$?" >> "$OUT/$name.log"
    grep -E "passed|failed|error|rc=|LPT|total|process [0-9]" "$OUT/$name.log" | tail -8
}
step sched 120 env NBATTN_BUDGET_S=100 python3 benchmarks/gpu_sched.py
step t_wrappers 100 python3 -m pytest -q -x tests/test_cuda_wrappers.py tests/test_driver.py
step cache 60 python3 benchmarks/gpu_cache_check.py
step t_prefill 80 env NBATTN_TEST_PATHS=tc python3 -m pytest -q \
    "tests/test_cuda_prefill.py::test_gpu_pipelined_variants" \
    "tests/test_cuda_sparse_cascade.py::test_gpu_pipelined_sparse_and_cascade"
