#!/usr/bin/env bash
# One GPU visit for the decode wrapper's plan() host time (issue 16), about 3 minutes:
#   COMMIT=<sha> BASE=<name> bash benchmarks/gpu_visit_plan_host.sh      (BASE: a tree under _ab/)
# 1. benchmarks/gpu_plan_host.py in this tree: plan() statement by statement at batch
#    1 / 64 / 1024 with real copies, and one driver call per staging span against one
#    batched call: $OUT/plan_host_<COMMIT>.json;
# 2. benchmarks/plan_tree_ab.py: _ab/$BASE and this tree in turn, AB_ROUNDS (3) rounds:
#    $OUT/plan_tree_ab_<COMMIT>.json.
# The logs go to $OUT/visit.log.
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/nbattn_out}; mkdir -p "$OUT"
COMMIT=${COMMIT:?pass COMMIT=<sha>, since the git of the device copy may be stale}
BASE=${BASE:?pass BASE=<name> of the tree under _ab/ to compare with}
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/visit.log"
PYTHONPATH=$PWD timeout ${HOST_S:-200} python3 benchmarks/gpu_plan_host.py --commit "$COMMIT" \
    --out "$OUT/plan_host_$COMMIT.json" > /tmp/plan_host.log 2>&1
echo "== plan_host rc=$? at $(( $(date +%s) - t0 )) s" >> "$OUT/visit.log"
grep -v -i warn /tmp/plan_host.log | tail -20 | cut -c1-600 >> "$OUT/visit.log"
PYTHONPATH=$PWD timeout ${AB_S:-300} python3 benchmarks/plan_tree_ab.py --trees "_ab/$BASE" . --rounds ${AB_ROUNDS:-3} \
    --commit "$COMMIT" --out "$OUT/plan_tree_ab_$COMMIT.json" > /tmp/plan_ab.log 2>&1
echo "== plan_tree_ab rc=$? at $(( $(date +%s) - t0 )) s" >> "$OUT/visit.log"
tail -8 /tmp/plan_ab.log | cut -c1-400 >> "$OUT/visit.log"
