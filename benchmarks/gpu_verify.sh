#!/usr/bin/env bash
# The next device session, in priority order: what changed after the last GPU runs
# (session 3 ended with these untested on a GPU) first, then the re-measurements the
# committed result files need.
#   t_heads     the group-of-3 head test (tensor-core tiles' head fix) + the prefill GPU tests
#   decode      benchmarks/gpu_decode.py on the final code (merge launch at batch 1,
#               split_runner, 8-warp small-batch shape)           -> $OUT/decode*.json
#   prefill_cc  benchmarks/gpu_prefill_cc.py with the 'wide' lane shape beside the default
#                                                                  -> $OUT/prefill_cuda_core.json
#   prefill     benchmarks/gpu_prefill.py (cascade at the committed CTAs/SM default,
#               flat decode through split_runner, _timing helpers) -> $OUT/prefill.json, cascade.json
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
    grep -E "passed|failed|error|rc=|TFLOP|speedup|correctness|total" "$OUT/$name.log" | tail -10
}
step t_heads 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_prefill.py \
    -k "group_of_three or gpu_pipelined"
step decode 240 env NBATTN_BUDGET_S=220 NBATTN_QUICK=1 python3 benchmarks/gpu_decode.py
step prefill_cc 200 env BUDGET_S=180 ALT=1 ALT_POLICY=wide python3 benchmarks/gpu_prefill_cc.py
step prefill 300 python3 benchmarks/gpu_prefill.py
