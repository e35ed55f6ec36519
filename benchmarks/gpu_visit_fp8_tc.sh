#!/usr/bin/env bash
# One GPU visit for fp8 on the tensor-core decode path, the prefill wrapper's fp8 and the
# plan() staging (issues 19, 16), about 8 minutes:
#   COMMIT=<sha> bash benchmarks/gpu_visit_fp8_tc.sh
# 1. the fp8 GPU tests (decode and prefill) and the wrappers' re-plan / graph tests;
# 2. benchmarks/gpu_fp8.py (fp8.json; FP8_ARGS=--quick for fewer cases);
# 3. benchmarks/fp8_tc_shape_ab.py (the tensor-core CTA shape for an fp8 cache);
# 4. benchmarks/plan_wrapper_pieces.py (plan() host time at batch 1 / 64 / 1024);
# 5. benchmarks/gpu_eager.py --quick, first calls only (cold and from the on-disk cache).
# The logs go to $OUT/visit.log (the device tool brings back at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/nbattn_out}; mkdir -p "$OUT/first"
LOG=/tmp/nbattn_visit; mkdir -p $LOG
COMMIT=${COMMIT:?pass COMMIT=<sha>, since the git of the device copy may be stale}
t0=$(date +%s)
step() {   # name, seconds, command...
    local name=$1 secs=$2; shift 2
    timeout "$secs" "$@" > "$LOG/$name.log" 2>&1
    echo "== $name rc=$? at $(( $(date +%s) - t0 )) s" | tee -a "$OUT/visit.log"
    grep -v -E "Warning|warn\(|^\s*$" "$LOG/$name.log" >> "$OUT/visit.log"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/visit.log"
step tests ${TESTS_S:-170} python3 -m pytest -p no:cacheprovider -q -rfE -n 14 tests/test_cuda_fp8.py \
    tests/test_cuda_fp8_prefill.py tests/test_cuda_wrappers.py -k gpu
pkill -f "exec\(eval\(sys.stdin" ; sleep 1      # xdist workers a timeout left behind
grep -E "passed|failed|FAILED" "$LOG/tests.log" | tail -6
step fp8 ${FP8_S:-230} python3 benchmarks/gpu_fp8.py --commit "$COMMIT" --out "$OUT" ${FP8_ARGS:-}
grep -E "us|err|wrote" "$LOG/fp8.log" | tail -25
step shape ${AB_S:-100} python3 benchmarks/fp8_tc_shape_ab.py --commit "$COMMIT" --out "$OUT" --budget-s 80
grep -E "tc_shape|wrote" "$LOG/shape.log" | tail -14
step plan ${PLAN_S:-45} python3 benchmarks/plan_wrapper_pieces.py --commit "$COMMIT" --out "$OUT/plan_pieces.json"
tail -4 "$LOG/plan.log"
step first ${FIRST_S:-90} python3 benchmarks/gpu_eager.py --commit "$COMMIT" --out "$OUT/first" --quick \
    --skip decode prefill plan
grep "first call" "$LOG/first.log" | tail -4
