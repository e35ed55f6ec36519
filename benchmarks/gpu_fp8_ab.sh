#!/usr/bin/env bash
# Same-visit A/B of fp8 decode across source trees (the working tree and trees under _ab/):
#   TREES="A B C" bash benchmarks/gpu_fp8_ab.sh      # "." is the working tree, NAME is _ab/NAME
# Per tree: the fp8 GPU tests of decode (tests/test_cuda_fp8.py -k gpu) once, then
# benchmarks/gpu_fp8.py with that tree's code, into $OUT/<tree>/fp8.json; the trees take turns
# (ROUNDS times), so a slower or faster visit shows in every tree alike.
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/nbattn_out}; root=$PWD
dir() { [ "$1" = . ] && echo "$root" || echo "$root/_ab/$1"; }
for t in ${TESTS:-}; do
  d=$(dir $t)
  (cd "$d" && PYTHONPATH=$d timeout ${TESTS_S:-150} python3 -m pytest -p no:cacheprovider -q -n 14 tests/test_cuda_fp8.py -k gpu \
      2>&1 | grep -E "passed|failed|FAILED" | tail -4 | sed "s/^/$t tests: /")
  pkill -f "exec\(eval\(sys.stdin" ; sleep 1
done
for r in $(seq ${ROUNDS:-1}); do
  for t in $TREES; do
    d=$(dir $t); name=${t/./HEAD}; mkdir -p "$OUT/$name$r"
    (cd "$d" && PYTHONPATH=$d timeout ${FP8_S:-120} python3 "$d/benchmarks/gpu_fp8.py" --commit "$name" --out "$OUT/$name$r" \
        ${FP8_ARGS:-} 2>&1 | grep -E "path tc|err|wrote" | grep -v "bfloat16\|warp" | sed "s/^/$name round $r: /")
  done
done
