#!/usr/bin/env bash
# Same-visit A/B of the decode suites across source trees: tells a code change from a
# slower or faster device visit (benchmarks/results/experiments/decode_ab_2026-12-04.json).
#
#   bash benchmarks/gpu_decode_ab.sh prepare SHA [SHA ...]   # here: git archive each tree into _ab/SHA
#   bash benchmarks/gpu_decode_ab.sh run SHA [SHA ...]       # on the GPU (the device copies _ab/, which
#                                                             # git does not track); HEAD is the working tree
# Each tree runs benchmarks/gpu_decode_b1.py and benchmarks/gpu_decode.py bench --quick with its own
# code (PYTHONPATH=the tree) and writes $OUT/<SHA>/; about 75 s a tree on an H200.
set -u
#   bash benchmarks/gpu_decode_ab.sh case SHA [SHA ...]      # on the GPU: one case per tree
#                                                             # (benchmarks/decode_ab_case.py), ~25 s a tree
what=${1:?prepare, run or case}; shift
OUT=${OUT:-/tmp/nbattn_out}
here=$(cd "$(dirname "$0")" && pwd)
for t in "$@"; do
  d=$PWD/_ab/$t; [ "$t" = HEAD ] && d=$PWD
  if [ "$what" = prepare ]; then
    [ "$t" = HEAD ] && continue
    mkdir -p "$d" && git archive "$t" | tar -x -C "$d" && echo "prepared $d"
    continue
  fi
  if [ "$what" = case ]; then
    (cd "$d" && PYTHONPATH=$d PYTHONUNBUFFERED=1 timeout 120 python3 "$here/decode_ab_case.py" "$OUT/case_$t.json" \
        ${CASE:-64 4096 8} 2>&1 | tail -2)
    continue
  fi
  mkdir -p "$OUT/$t"
  # trees from before the benchmark options (argparse) read OUT and NBATTN_QUICK instead; both are set
  (cd "$d" && OUT="$OUT/$t" NBATTN_QUICK=1 PYTHONPATH=$d PYTHONUNBUFFERED=1 timeout 60 python3 benchmarks/gpu_decode_b1.py --out "$OUT/$t" \
      > "$OUT/$t/b1.log" 2>&1; echo "$t decode_b1 rc=$?")
  (cd "$d" && OUT="$OUT/$t" NBATTN_QUICK=1 PYTHONPATH=$d PYTHONUNBUFFERED=1 timeout 100 python3 benchmarks/gpu_decode.py bench --quick \
      --out "$OUT/$t" > "$OUT/$t/decode.log" 2>&1; echo "$t decode rc=$?")
done
