#!/usr/bin/env bash
# Re-verify and re-measure everything on the GPU, in priority order (a time-out keeps the
# earlier steps' files).  Session 5 ran every step below on its final library
# code (see benchmarks/logs/gpu_tests.txt).  Steps:
#   decode_b1   benchmarks/gpu_decode_b1.py with B1_STREAM=both: the evict-first K/V stream
#               against plain loads, batch 1 x 32k, group 4        -> $OUT/decode_b1.json
#   t_gpu       GPU tests of sparse/cascade, the CUDA-core prefill tile, merge and decode
#   prefill_cc  benchmarks/gpu_prefill_cc.py at the default tuning and its default
#               alternatives (--alts)                             -> $OUT/prefill_cuda_core.json
#   decode      benchmarks/gpu_decode.py correct, then bench     -> $OUT/decode*.json
#   prefill     benchmarks/gpu_prefill.py                        -> $OUT/prefill.json, cascade.json
#   floor       benchmarks/gpu_read_floor.py (bare-read ceiling)  -> $OUT/decode_read_floor.json
# A device call allows 600 s: pick steps with STEPS, e.g.
#   STEPS="decode_b1 t_gpu" bash benchmarks/gpu_verify.sh;  STEPS="prefill_cc decode" ...
# (OUT is set by the device tool.)
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
STEPS=${STEPS:-"decode_b1 t_gpu prefill_cc decode prefill floor"}
has() { [[ " $STEPS " == *" $1 "* ]]; }
has decode_b1 && step decode_b1 90 env B1_STREAM=both python3 benchmarks/gpu_decode_b1.py
has t_gpu && step t_gpu 330 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_sparse_cascade.py \
    tests/test_cuda_prefill_cc.py tests/test_cuda_merge.py tests/test_cuda_decode.py
has prefill_cc && step prefill_cc 230 python3 benchmarks/gpu_prefill_cc.py --budget-s 210
# correctness cases start while 200 s of the budget are left: 330 - 200 = 130 s of cases
has decode && step decode_correct 150 python3 benchmarks/gpu_decode.py correct --budget-s 330 --quick
has decode && step decode 100 python3 benchmarks/gpu_decode.py bench --budget-s 100 --quick
has prefill && step prefill 300 python3 benchmarks/gpu_prefill.py
has floor && step floor 60 python3 benchmarks/gpu_read_floor.py
