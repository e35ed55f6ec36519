#!/usr/bin/env bash
# One device session after CPU-side changes, in priority order (a time-out keeps the
# earlier steps' files):
#   t_gpu       GPU tests of the merge (one-round form), decode, sparse/cascade and the
#               prefill launch order
#   decode_b1   benchmarks/gpu_decode_b1.py: batch-1 split decode taken apart
#               (kernel, merge forms, totals)                      -> $OUT/decode_b1.json
#   decode      benchmarks/gpu_decode.py, quick                     -> $OUT/decode*.json
#   prefill     benchmarks/gpu_prefill.py (tensor-core prefill with longest-first
#               causal order, page size, cascade with the one-round merge)
#                                                                  -> $OUT/prefill.json, cascade.json
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
    grep -E "passed|failed|error|rc=|TFLOP|speedup|correctness|total| us " "$OUT/$name.log" | tail -14
}
STEPS=${STEPS:-"t_gpu decode_b1 decode prefill decode_correct"}    # the device tool allows 600 s a call: split them
has() { [[ " $STEPS " == *" $1 "* ]]; }
has t_gpu && step t_gpu 180 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_merge.py tests/test_cuda_decode.py \
    tests/test_cuda_sparse_cascade.py "tests/test_cuda_prefill.py::test_causal_work_starts_longest_first"
has decode_b1 && step decode_b1 140 python3 benchmarks/gpu_decode_b1.py
has decode && step decode 220 env NBATTN_BUDGET_S=190 NBATTN_QUICK=1 python3 benchmarks/gpu_decode.py
has prefill && step prefill 300 python3 benchmarks/gpu_prefill.py
# correctness cases start while 200 s of the budget are left: 385 - 200 = 185 s of cases
has decode_correct && step decode_correct 195 env NBATTN_BUDGET_S=385 NBATTN_QUICK=1 python3 benchmarks/gpu_decode.py correct
