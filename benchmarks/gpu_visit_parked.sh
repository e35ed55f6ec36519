#!/usr/bin/env bash
# One GPU visit (two calls of under 10 minutes) for the changes parked until a GPU has run
# them: the plain decode call's host trims, the decode plan's two copies (the workspace
# as rows, one cuMemcpy2DAsync) and run() without an empty merge outside a graph capture
# (issue 16), the wrapper's programmatic fixed-grid merge (issue 21) and the RoPE prefill
# tile's order of work (issue 19).
#   git revert <the parking commit>           # this tree: the changes back (one commit, e0d757a)
#   mkdir -p _ab/B && git archive <the parking commit> nbattn benchmarks tests pyproject.toml | tar -x -C _ab/B
#   COMMIT=<sha> BASE=B STAGE=1 bash benchmarks/gpu_visit_parked.sh      # then STAGE=2, STAGE=3
# STAGE=1 (about 7 minutes):
#   1. the GPU tests of the wrappers, the plain decode call, the scheduler's wrapper cost, the
#      driver and staging, the variants and the RoPE cascade, in this tree;
#   2. benchmarks/gpu_eager.py --quick (decode and plan() only) of _ab/$BASE and of this tree in
#      turn, ROUNDS (1) times: $OUT/eager_<tree><round>.json (plan() and the plain call's host
#      times are what the changes move; each file has its same-run SDPA).
# STAGE=2 (about 5 minutes):
#   3. benchmarks/diag_small_batch.py of both trees (the batch-16 steps, LPT against the fixed
#      split, CUDA graphs): $OUT/diag_<tree>.json;
#   4. benchmarks/gpu_variants.py --parts rope_prefill of both trees: $OUT/rope_<tree>.json.
# STAGE=3 (about 4 minutes): benchmarks/gpu_rope_warp_diag.py (RoPE decode under other register
#   budgets) and benchmarks/gpu_plan_host.py, in this tree.
# Each script runs inside the tree it measures (this tree's copy of it); logs in $OUT/visit.log.
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/nbattn_out}; mkdir -p "$OUT"; root=$PWD
C=${COMMIT:?pass COMMIT=<sha>, since the git of the device copy may be stale}
B=${BASE:?pass BASE=<name> of the tree under _ab/ to compare with}
t0=$(date +%s)
LOG=/tmp/nbattn_visit; mkdir -p $LOG
step() {   # name, seconds, command...
  local name=$1 secs=$2; shift 2
  timeout "$secs" "$@" > "$LOG/$name.log" 2>&1
  echo "== $name rc=$? at $(( $(date +%s) - t0 )) s" >> "$OUT/visit.log"
  grep -v -E "Warning|warn\(|^\s*$|site-packages|NAT = " "$LOG/$name.log" | tail -${KEEP:-14} | cut -c1-400 \
      >> "$OUT/visit.log"; }
intree() {  # tree (. or a name under _ab/), script, args...
  local t=$1 s=$2; shift 2; local d=$root; [ "$t" != . ] && d=$root/_ab/$t
  cp "$root/benchmarks/$s" "$d/benchmarks/visit_$s"
  (cd "$d" && PYTHONPATH=$d python3 "$d/benchmarks/visit_$s" "$@"); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/visit.log"
if [ "${STAGE:?pass STAGE=1, 2 or 3}" = 1 ]; then
  export PYTHONPATH=$root
  KEEP=20 step tests ${TESTS_S:-300} python3 -m pytest -p no:cacheprovider -q -rfE -n 12 -m gpu \
      tests/test_cuda_wrappers.py tests/test_decode_call.py tests/test_sched_wrapper_cost.py tests/test_driver.py \
      tests/test_gpu_variants.py tests/test_cuda_sparse_cascade.py
  pkill -f "exec\(eval\(sys.stdin" ; sleep 1      # xdist workers a timeout left behind
  for r in $(seq ${ROUNDS:-1}); do
    for t in "$B" .; do
      n=$t c=$t; [ "$t" = . ] && n=now c=$C
      KEEP=8 step eager_$n$r ${EAGER_S:-120} intree "$t" gpu_eager.py --commit "$c" --quick \
          --skip prefill first --out /tmp/eager_$n$r
      cp /tmp/eager_$n$r/eager.json "$OUT/eager_$n$r.json" 2>/dev/null
    done
  done
elif [ "$STAGE" = 2 ]; then
  for t in "$B" .; do
    n=$t c=$t; [ "$t" = . ] && n=now c=$C
    KEEP=4 step diag_$n ${DIAG_S:-150} intree "$t" diag_small_batch.py --out /tmp/diag_$n --commit "$c"
    cp /tmp/diag_$n/diag_small_batch.json "$OUT/diag_$n.json" 2>/dev/null
    KEEP=6 step rope_$n ${ROPE_S:-150} intree "$t" gpu_variants.py --commit "$c" --parts rope_prefill \
        --out /tmp/rope_$n
    cp /tmp/rope_$n/variants.json "$OUT/rope_$n.json" 2>/dev/null
  done
else
  export PYTHONPATH=$root
  KEEP=20 step rope_warp ${RW_S:-200} python3 benchmarks/gpu_rope_warp_diag.py --commit "$C" \
      --out "$OUT/rope_warp_$C.json"
  KEEP=20 step plan_host ${HOST_S:-150} python3 benchmarks/gpu_plan_host.py --commit "$C" \
      --out "$OUT/plan_host_$C.json"
fi
