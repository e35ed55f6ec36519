#!/usr/bin/env bash
# One GPU visit for the decode wrapper's programmatic fixed-grid merge (issue 21), about 6 minutes:
#   COMMIT=<sha> BASE=<name> bash benchmarks/gpu_visit_pdl_merge.sh        (BASE: a tree under _ab/)
# 1. (PARTS has "tests") the wrappers' and decode GPU tests of this tree (graph replays after
#    re-plans, 100 bitwise-equal runs, plans back to back while the stream is busy);
# 2. (PARTS has "diag") benchmarks/diag_small_batch.py of _ab/$BASE and of this tree in turn,
#    ROUNDS rounds: the batch-16 steps' CUDA-graph times, the LPT wrapper against the fixed
#    split on the same items: $OUT/diag_<name><round>.json.
# The logs go to $OUT/visit.log.
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/nbattn_out}; mkdir -p "$OUT"; root=$PWD
COMMIT=${COMMIT:?pass COMMIT=<sha>, since the git of the device copy may be stale}
BASE=${BASE:?pass BASE=<name> of the tree under _ab/ to compare with}
PARTS=${PARTS:-tests diag}
t0=$(date +%s)
log() { echo "== $1 rc=$2 at $(( $(date +%s) - t0 )) s" >> "$OUT/visit.log"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/visit.log"
if [[ " $PARTS " == *" tests "* ]]; then
  PYTHONPATH=$root timeout ${TESTS_S:-240} python3 -m pytest -p no:cacheprovider -q -rfE -n 12 \
      tests/test_cuda_wrappers.py tests/test_sched_wrapper_cost.py > /tmp/pdl_tests.log 2>&1
  log tests $?
  grep -E "passed|failed|FAILED|ERROR" /tmp/pdl_tests.log | tail -12 | cut -c1-400 >> "$OUT/visit.log"
  pkill -f "exec\(eval\(sys.stdin" ; sleep 1      # xdist workers a timeout left behind
fi
if [[ " $PARTS " == *" diag "* ]]; then
  for r in $(seq ${ROUNDS:-2}); do
    for t in "$BASE" .; do
      d=$root; name=now; c=$COMMIT
      [ "$t" != . ] && d=$root/_ab/$t && name=$t && c=$t
      cp "$root/benchmarks/diag_small_batch.py" "$d/benchmarks/diag_small_batch_visit.py"
      (cd "$d" && PYTHONPATH=$d timeout ${DIAG_S:-150} python3 benchmarks/diag_small_batch_visit.py \
          --out /tmp/diag_$name$r --commit "$c" > /tmp/diag_$name$r.log 2>&1)
      log diag_$name$r $?
      tail -3 /tmp/diag_$name$r.log | cut -c1-300 >> "$OUT/visit.log"
      cp /tmp/diag_$name$r/diag_small_batch.json "$OUT/diag_$name$r.json" 2>/dev/null
    done
  done
fi
