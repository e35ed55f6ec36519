#!/usr/bin/env bash
# One GPU visit for the wrappers, the scheduler sweep and the public path (issues 16, 17, 21), about 9 minutes:
#   COMMIT=<sha> bash benchmarks/gpu_visit_sched_eager.sh
# 1. the GPU tests of the wrappers, masks, sinks, windows and the driver;
# 2. benchmarks/gpu_sched.py: sched.json + cost_fit.json;
# 3. benchmarks/diag_small_batch.py: the batch-16 decode pieces, plan() under cProfile;
# 4. benchmarks/gpu_eager.py: eager.json (decode, prefill, plan), then its first-call part
#    alone into $OUT/first/eager.json (cold and on-disk-cached compiles).
# Logs go to $OUT/visit.log (the device tool brings back at most 8 files; figures are
# drawn again from the JSON).  PARTS picks steps (default: tests sched diag eager first);
# TEST_FILES the test files.
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
PARTS=${PARTS:-tests sched diag eager first}
has() { [[ " $PARTS " == *" $1 "* ]]; }
TEST_FILES=${TEST_FILES:-tests/test_cuda_wrappers.py tests/test_sched_wrapper_cost.py tests/test_cuda_custom_mask.py \
    tests/test_window_work.py tests/test_cuda_sinks.py tests/test_driver.py}
if has tests; then
step tests ${TESTS_S:-150} python3 -m pytest -p no:cacheprovider -q -rfE -n 15 $TEST_FILES
pkill -f "exec\(eval\(sys.stdin" ; sleep 1      # xdist workers a timeout left behind
grep -E "passed|failed|FAILED" "$LOG/tests.log" | tail -6
fi
has sched && step sched $(( ${SCHED_S:-150} + 10 )) python3 benchmarks/gpu_sched.py --out "$OUT" --commit "$COMMIT" --budget-s ${SCHED_S:-150}
has sched && grep -E "lpt/best|prefill fit" "$LOG/sched.log" | tail -20
has diag && step diag ${DIAG_S:-80} python3 benchmarks/diag_small_batch.py --out "$OUT" --commit "$COMMIT"
has diag && grep -E "^\[|median" "$LOG/diag.log" | grep -v "\]     " | head -20
has eager && step eager ${EAGER_S:-150} python3 benchmarks/gpu_eager.py --commit "$COMMIT" --out "$OUT" --skip first
has eager && grep -E "^\s+\[|^plan" "$LOG/eager.log" | tail -12
left=$(( ${TOTAL_S:-540} - ($(date +%s) - t0) ))
has first && step first $left python3 benchmarks/gpu_eager.py --commit "$COMMIT" --out "$OUT/first" --skip decode prefill plan --profile-first "$OUT/first"
has first && grep "first call" "$LOG/first.log"
rm -f "$OUT"/*.png "$OUT"/first/*.png
