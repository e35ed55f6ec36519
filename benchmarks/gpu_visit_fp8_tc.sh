#!/usr/bin/env bash
# One GPU visit for fp8 on the tensor-core decode path and the plan() staging (issues 19, 16),
# with the parked commits restored first (branch gpu-pending-25):
#   COMMIT=<sha> bash benchmarks/gpu_visit_fp8_tc.sh
# 1. the fp8 GPU tests (decode and prefill) and the wrappers' re-plan / graph tests;
# 2. benchmarks/gpu_fp8.py (fp8.json; FP8_ARGS=--quick for two cases);
# 3. benchmarks/plan_wrapper_pieces.py (plan() host time at batch 1 / 64 / 1024);
# 4. benchmarks/gpu_eager.py --quick, first calls only (cold and from the on-disk cache).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/nbattn_out}; mkdir -p "$OUT"
COMMIT=${COMMIT:-unknown}
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${TESTS_S:-170} python3 -m pytest -p no:cacheprovider -q -rfE -n 14 tests/test_cuda_fp8.py tests/test_cuda_fp8_prefill.py \
    tests/test_cuda_wrappers.py -k gpu > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? at $(( $(date +%s) - t0 )) s"; tail -15 "$OUT/gpu_tests.log"
timeout ${FP8_S:-200} python3 benchmarks/gpu_fp8.py --commit "$COMMIT" --out "$OUT" ${FP8_ARGS:-} > "$OUT/fp8.log" 2>&1
echo "fp8 rc=$? at $(( $(date +%s) - t0 )) s"; tail -25 "$OUT/fp8.log"
timeout ${PLAN_S:-45} python3 benchmarks/plan_wrapper_pieces.py --commit "$COMMIT" --out "$OUT/plan_pieces.json" > "$OUT/plan.log" 2>&1
echo "plan rc=$? at $(( $(date +%s) - t0 )) s"; tail -4 "$OUT/plan.log"
timeout ${FIRST_S:-90} python3 benchmarks/gpu_eager.py --commit "$COMMIT" --out "$OUT/first" --quick \
    --skip decode prefill plan > "$OUT/first.log" 2>&1
echo "first call rc=$? at $(( $(date +%s) - t0 )) s"; grep "first call" "$OUT/first.log" | tail -4
