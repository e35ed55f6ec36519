#!/usr/bin/env bash
# One GPU visit for RoPE's fixed-point turn on the warp decode path and the bound fp8
# widening launch (issues 19, 16), about 9 minutes:
#   COMMIT=<sha> BEFORE=<dir of the tree before, e.g. _ab/A> bash benchmarks/gpu_visit_rope_widen.sh
# 1. GPU tests: the turn alone at positions up to 2**31 - 1, RoPE on the warp path against
#    the golden model, the fp8 prefill wrapper (its bound widening launch, graph replay);
# 2. benchmarks/gpu_variants.py --parts rope for the tree before and this tree, in turn,
#    twice: $OUT/rope_before{1,2}.json and $OUT/rope_now{1,2}.json;
# 3. benchmarks/gpu_fp8.py --quick (the widening inside the prefill timing): $OUT/fp8.json.
# The logs go to $OUT/visit.log (the device tool brings back at most 8 files).
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/nbattn_out}; mkdir -p "$OUT"; root=$PWD
LOG=/tmp/nbattn_visit; mkdir -p $LOG
COMMIT=${COMMIT:?pass COMMIT=<sha>, since the git of the device copy may be stale}
BEFORE=${BEFORE:?pass BEFORE=<the tree before, relative to the repository root>}
t0=$(date +%s)
step() {   # name, seconds, command...
    local name=$1 secs=$2; shift 2
    timeout "$secs" "$@" > "$LOG/$name.log" 2>&1
    echo "== $name rc=$? at $(( $(date +%s) - t0 )) s" | tee -a "$OUT/visit.log"
    grep -v -E "Warning|warn\(|^\s*$" "$LOG/$name.log" | tail -${KEEP:-30} >> "$OUT/visit.log"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/visit.log"
export PYTHONPATH=$root
step tests ${TESTS_S:-200} bash -c "python3 -m pytest -p no:cacheprovider -q -rfE -n 8 \
    tests/test_cuda_rope.py::test_the_warp_turn_is_float32_accurate_at_large_positions \
    tests/test_gpu_variants.py::test_decode_rope_on_the_warp_path; \
    python3 -m pytest -p no:cacheprovider -q -rfE -n 8 tests/test_cuda_fp8_prefill.py -k gpu"
pkill -f "exec\(eval\(sys.stdin" ; sleep 1      # xdist workers a timeout left behind
for r in 1 2; do
  for t in before now; do
    d=$root; [ $t = before ] && d=$root/$BEFORE
    (cd "$d" && export PYTHONPATH=$d KEEP=6 && step rope_$t$r ${ROPE_S:-90} python3 "$d/benchmarks/gpu_variants.py" \
        --commit "$([ $t = before ] && echo ${BEFORE_COMMIT:-before} || echo $COMMIT)" --parts rope --out /tmp/rope_$t$r)
    cp /tmp/rope_$t$r/variants.json "$OUT/rope_$t$r.json" 2>/dev/null
  done
done
step fp8 ${FP8_S:-200} python3 benchmarks/gpu_fp8.py --commit "$COMMIT" --out "$OUT" --quick
