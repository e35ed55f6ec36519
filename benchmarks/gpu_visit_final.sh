#!/usr/bin/env bash
# The closing GPU visit of a session (issues 16, 17, 21), about 9 minutes:
#   COMMIT=<sha> bash benchmarks/gpu_visit_final.sh
# 1. the GPU tests of the wrappers, masks, sinks, windows and the driver;
# 2. benchmarks/gpu_sched.py: sched.json + cost_fit.json;
# 3. benchmarks/diag_small_batch.py: the batch-16 decode pieces, plan() under cProfile;
# 4. benchmarks/gpu_eager.py: eager.json (decode, prefill, plan), then its first-call part
#    alone into $OUT/first/eager.json (cold and on-disk-cached compiles).
# Logs go to $OUT/visit.log (the device tool brings back at most 8 files; figures are
# drawn again from the JSON).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/nbattn_out}; mkdir -p "$OUT/first"
LOG=/tmp/nbattn_visit; mkdir -p $LOG
COMMIT=${COMMIT:-unknown}
t0=$(date +%s)
step() {   # name, seconds, command...
    local name=$1 secs=$2; shift 2
    timeout "$secs" "$@" > "$LOG/$name.log" 2>&1
    echo "== $name rc=$? at $(( $(date +%s) - t0 )) s" | tee -a "$OUT/visit.log"
    grep -v -E "Warning|warn\(|^\s*$" "$LOG/$name.log" >> "$OUT/visit.log"
}
step tests ${TESTS_S:-150} python3 -m pytest -p no:cacheprovider -q -rfE -n 15 tests/test_cuda_wrappers.py \
    tests/test_sched_wrapper_cost.py tests/test_cuda_custom_mask.py tests/test_window_work.py tests/test_cuda_sinks.py \
    tests/test_driver.py
grep -E "passed|failed|FAILED" "$LOG/tests.log" | tail -6
step sched ${SCHED_S:-150} python3 benchmarks/gpu_sched.py --out "$OUT" --commit "$COMMIT" --budget-s 140
grep -E "lpt/best|prefill fit" "$LOG/sched.log" | tail -20
step diag ${DIAG_S:-80} python3 benchmarks/diag_small_batch.py --out "$OUT" --commit "$COMMIT"
grep -E "^\[|median" "$LOG/diag.log" | grep -v "\]     " | head -20
step eager ${EAGER_S:-150} python3 benchmarks/gpu_eager.py --commit "$COMMIT" --out "$OUT" --skip first
grep -E "^\s+\[|^plan" "$LOG/eager.log" | tail -12
left=$(( ${TOTAL_S:-540} - ($(date +%s) - t0) ))
step first $left python3 benchmarks/gpu_eager.py --commit "$COMMIT" --out "$OUT/first" --skip decode prefill plan
grep "first call" "$LOG/first.log"
rm -f "$OUT"/*.png "$OUT"/first/*.png
