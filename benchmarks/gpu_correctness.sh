#!/usr/bin/env bash
# One GPU visit for correctness, everything side by side (GPU only):
#   tests      GPU-marked tests (TESTS: a pytest -k expression, default all)  -> $OUT/gpu_tests.log
#   notebooks  every notebook's code cells top to bottom                      -> $OUT/notebooks_gpu.json
#   verify     the nbattn verify campaign (VERIFY_JOBS: gpu_verify_campaign.py --job list;
#              default: decode-side kernels in 5 processes of 2600 cases, each prefill-side
#              kernel in its own process of 600)                              -> $OUT/verify.json
#   prefill    with PREFILL=1, after the rest: benchmarks/gpu_prefill.py prefill_8k (timing
#              needs the GPU to itself)                                       -> $OUT/prefill.json
# Verify runs niced, so the tests and notebooks get the cores first.  The sanitizer sweep
# needs a visit of its own (its warm-up compiles every family; beside these jobs that took
# 289 s): python3 benchmarks/gpu_sanitizer.py --commit SHA --jobs 12 --deadline 380 --results $OUT
#   COMMIT=<sha of the tree you send> [LIMIT=s] [TESTS=expr] [TEST_JOBS=n] [PREFILL=1] bash benchmarks/gpu_correctness.sh
# (name the commit yourself: the device copy's git HEAD need not be the tree that was sent)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
OUT=${OUT:-/tmp/nbattn_out}
COMMIT=${COMMIT:-unknown}
LIMIT=${LIMIT:-400}            # seconds for the tests, notebooks and verify
DECODE_SIDE=decode,decode_wrapper,merge_states,split_kv
DEFAULT_JOBS="--job 31:2600:$DECODE_SIDE --job 32:2600:$DECODE_SIDE --job 33:2600:$DECODE_SIDE \
--job 34:2600:$DECODE_SIDE --job 35:2600:$DECODE_SIDE --job 41:600:single_prefill --job 42:600:prefill_paged --job 43:600:prefill_ragged \
--job 44:600:cascade --job 45:600:block_sparse --job 46:600:prefill_wrapper --job 47:600:single_decode"
VERIFY_JOBS=${VERIFY_JOBS:-$DEFAULT_JOBS}
mkdir -p "$OUT" /tmp/nbattn_logs
L=/tmp/nbattn_logs
nvidia-smi -L; python3 -c "import numba_cuda, torch; print('numba-cuda', numba_cuda.__version__, 'torch', torch.__version__)"
t0=$(date +%s)
timeout $((LIMIT - 10)) python3 -m pytest -v -p no:cacheprovider -n ${TEST_JOBS:-2} -m gpu ${TESTS:+-k "$TESTS"} tests/ \
    > $L/gpu_tests.log 2>&1 &
P1=$!
timeout $((LIMIT - 10)) python3 benchmarks/gpu_notebooks.py --commit "$COMMIT" --out "$OUT" --jobs 3 \
    --timeout $((LIMIT - 30)) > $L/notebooks.log 2>&1 &
P2=$!
timeout $((LIMIT - 5)) nice -n 5 python3 benchmarks/gpu_verify_campaign.py --commit "$COMMIT" $VERIFY_JOBS \
    --per-config 300 --time-budget $((LIMIT - 70)) --out "$OUT" > $L/verify.log 2>&1 &
P3=$!
for p in $P1 $P2 $P3; do wait $p; echo "pid $p rc=$? at $(( $(date +%s) - t0 )) s"; done
grep -E "PASSED|FAILED|ERROR|passed|failed" $L/gpu_tests.log | tail -40; tail -12 $L/notebooks.log; tail -4 $L/verify.log
if [ "${PREFILL:-0}" = 1 ]; then
    timeout 150 python3 benchmarks/gpu_prefill.py prefill_8k --commit "$COMMIT" --out "$OUT" > $L/prefill.log 2>&1
    echo "prefill rc=$? at $(( $(date +%s) - t0 )) s"; grep -v "^ \|Warning" $L/prefill.log | tail -12
fi
cp $L/gpu_tests.log "$OUT/gpu_tests.log"
tar czf "$OUT/logs.tgz" -C /tmp nbattn_logs
