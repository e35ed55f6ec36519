#!/usr/bin/env bash
# One GPU visit for the wrappers' merge over the grid, the prefill plan over one wave of
# CTAs and the plan() host work (issues 16 and 21), about 9 minutes:
#   COMMIT=<sha> bash benchmarks/gpu_visit_merge_plan.sh
# 1. the GPU tests of both wrappers (the merge kernel, plans, graphs), masks, sinks, windows;
# 2. benchmarks/gpu_sched.py: sched.json + cost_fit.json (the mixed steps also plan over
#    every CTA, as before the one-wave rule, and record the prefill launches' occupancy);
# 3. benchmarks/gpu_eager.py without its first-call part: eager.json (plan() and run()).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/nbattn_out}; mkdir -p "$OUT"
COMMIT=${COMMIT:-unknown}
t0=$(date +%s)
timeout ${TESTS_S:-180} python3 -m pytest -p no:cacheprovider -q -rfE -n 15 tests/test_cuda_wrappers.py \
    tests/test_sched_wrapper_cost.py tests/test_cuda_custom_mask.py tests/test_window_work.py tests/test_cuda_sinks.py \
    tests/test_driver.py > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? at $(( $(date +%s) - t0 )) s"; tail -8 "$OUT/gpu_tests.log"
timeout ${SCHED_S:-270} python3 benchmarks/gpu_sched.py --out "$OUT" --commit "$COMMIT" --budget-s 250 > "$OUT/sched.log" 2>&1
echo "sched rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "lpt/best|mixed|resident" "$OUT/sched.log" | tail -20
timeout ${EAGER_S:-150} python3 benchmarks/gpu_eager.py --commit "$COMMIT" --out "$OUT" --skip first > "$OUT/eager.log" 2>&1
echo "eager rc=$? at $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/eager.log"
