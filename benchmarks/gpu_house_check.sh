#!/usr/bin/env bash
# A short GPU visit after a restructure that must not change the kernels: every GPU-marked
# test of the restructured paths (decode, prefill, cascade, sparse, merge, wrappers, variants,
# NaN rule), under a hard time limit.  Writes $OUT/gpu_tests.log.
#   COMMIT=<sha> LIMIT=<s> bash benchmarks/gpu_house_check.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/nbattn_out}; mkdir -p "$OUT"
LIMIT=${LIMIT:-150}
nvidia-smi -L
echo "commit ${COMMIT:-unknown}"
t0=$(date +%s)
timeout "$LIMIT" python3 -m pytest -p no:cacheprovider -q -rfE -n ${TEST_JOBS:-14} -m gpu ${TESTS:+-k "$TESTS"} tests/ \
    > "$OUT/gpu_tests.log" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - t0 )) s"
tail -25 "$OUT/gpu_tests.log"
