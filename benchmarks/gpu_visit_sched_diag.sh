#!/usr/bin/env bash
# One GPU visit for the scheduler (issue 21) and the small-batch diagnosis, about 6 minutes:
#   COMMIT=<sha> bash benchmarks/gpu_visit_sched_diag.sh
# 1. the GPU tests of the wrappers (graphs after re-plans, the programmatic tile merge) and
#    of the planner's cost on the wrappers;
# 2. benchmarks/gpu_sched.py: sched.json + cost_fit.json (the mixed steps' LPT planned under
#    a prefill model fitted to the same run's fixed policies);
# 3. benchmarks/diag_small_batch.py: where LPT loses at batch 16, plan() under cProfile.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/nbattn_out}; mkdir -p "$OUT"
COMMIT=${COMMIT:-unknown}
t0=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest -p no:cacheprovider -q -rfE -n 15 tests/test_cuda_wrappers.py \
    tests/test_sched_wrapper_cost.py > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -8
timeout ${SCHED_S:-200} python3 benchmarks/gpu_sched.py --out "$OUT" --commit "$COMMIT" --budget-s 180 > "$OUT/sched.log" 2>&1
echo "sched rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "lpt/best|prefill fit|mixed " "$OUT/sched.log" | tail -20
timeout ${DIAG_S:-150} python3 benchmarks/diag_small_batch.py --out "$OUT" --commit "$COMMIT" > "$OUT/diag.log" 2>&1
echo "diag rc=$? at $(( $(date +%s) - t0 )) s"; grep -v Warning "$OUT/diag.log" | grep -v "warn(" | head -60
