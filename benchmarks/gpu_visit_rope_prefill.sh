#!/usr/bin/env bash
# One GPU visit for RoPE on the pipelined tensor-core prefill tile (issue 19), about 6 minutes:
#   COMMIT=<sha> BEFORE=_ab/A BEFORE_COMMIT=<sha> bash benchmarks/gpu_visit_rope_prefill.sh
# or, to set trees side by side on the prefill case alone (no BEFORE run):
#   COMMIT=<sha> TREES="N B ." PARTS=rope_prefill bash benchmarks/gpu_visit_rope_prefill.sh
#   ("." is this tree, NAME is _ab/NAME; $OUT/rope_<NAME><round>.json, ROUNDS rounds;
#   TESTS_DIR=_ab/NAME runs step 1 in that tree instead of this one)
# 1. GPU tests: RoPE on the pipelined tile (paged, the wrapper with a graph replay, single),
#    the RoPE cascade on it, and the pipelined tile's other variants (unchanged code paths);
# 2. benchmarks/gpu_variants.py --parts rope (decode b64 x 4k and b1 x 32k, prefill 8k causal)
#    of this tree, run inside the tree before (its package), then in this tree, in turn
#    (ROUNDS times): $OUT/rope_before<r>.json, $OUT/rope_now<r>.json.
# The logs go to $OUT/visit.log.
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/nbattn_out}; mkdir -p "$OUT"; root=$PWD
LOG=/tmp/nbattn_visit; mkdir -p $LOG
COMMIT=${COMMIT:?pass COMMIT=<sha>, since the git of the device copy may be stale}
BEFORE=${BEFORE:-}
t0=$(date +%s)
step() {   # name, seconds, command...
    local name=$1 secs=$2; shift 2
    timeout "$secs" "$@" > "$LOG/$name.log" 2>&1
    echo "== $name rc=$? at $(( $(date +%s) - t0 )) s" | tee -a "$OUT/visit.log"
    grep -v -E "Warning|warn\(|^\s*$|^tests/.*(\[|::)|site-packages|NAT = " "$LOG/$name.log" | tail -${KEEP:-40} \
        >> "$OUT/visit.log"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/visit.log"
export PYTHONPATH=$root
[ -n "${TESTS_DIR:-}" ] && cd "$root/$TESTS_DIR" && export PYTHONPATH=$PWD
step tests ${TESTS_S:-240} python3 -m pytest -p no:cacheprovider -q -rfE -n 12 \
    tests/test_gpu_variants.py::test_prefill_rope_on_the_pipelined_tile \
    tests/test_cuda_sparse_cascade.py::test_gpu_rope_block_sparse_and_cascade \
    ${MORE_TESTS:-}
pkill -f "exec\(eval\(sys.stdin" ; sleep 1      # xdist workers a timeout left behind
cd "$root"; export PYTHONPATH=$root
if [ -n "${TREES:-}" ]; then
  for r in $(seq ${ROUNDS:-1}); do
    for t in $TREES; do
      d=$root; c=$COMMIT; name=now
      [ "$t" != . ] && d=$root/_ab/$t && c=$t && name=$t
      cp "$root/benchmarks/gpu_variants.py" "$d/benchmarks/gpu_variants_visit.py"
      (cd "$d" && export PYTHONPATH=$d KEEP=8 && step rope_$name$r ${ROPE_S:-150} python3 \
          "$d/benchmarks/gpu_variants_visit.py" --commit "$c" --parts ${PARTS:-rope} --out /tmp/rope_$name$r)
      cp /tmp/rope_$name$r/variants.json "$OUT/rope_$name$r.json" 2>/dev/null
    done
  done
  exit 0
fi
for r in $(seq ${ROUNDS:-1}); do
  for t in before now; do
    d=$root; c=$COMMIT; [ $t = before ] && d=$root/$BEFORE && c=${BEFORE_COMMIT:-before}
    # this tree's script inside the measured tree (the script puts its own tree first on sys.path)
    [ $t = before ] && cp "$root/benchmarks/gpu_variants.py" "$d/benchmarks/gpu_variants_visit.py"
    s=$d/benchmarks/gpu_variants.py; [ $t = before ] && s=$d/benchmarks/gpu_variants_visit.py
    (cd "$d" && export PYTHONPATH=$d KEEP=8 && step rope_$t$r ${ROPE_S:-150} python3 "$s" \
        --commit "$c" --parts rope --out /tmp/rope_$t$r)
    cp /tmp/rope_$t$r/variants.json "$OUT/rope_$t$r.json" 2>/dev/null
  done
done
