#!/usr/bin/env bash
# One GPU visit for correctness, everything side by side (GPU only):
#   tests      the GPU-marked tests (every variant on every GPU-only path, graph
#              replay after re-planning, ...)                       -> $OUT/logs.tgz (gpu_tests.log)
#   notebooks  every notebook's code cells top to bottom              -> $OUT/notebooks_gpu.json
#   verify     the nbattn verify campaign, several seeds              -> $OUT/verify.json
# Verify runs niced, so the tests and notebooks get the cores first.  The sanitizer sweep
# needs a visit of its own (its warm-up compiles every family; beside these jobs that took
# 289 s): python3 benchmarks/gpu_sanitizer.py --commit SHA --jobs 12 --deadline 420 --results $OUT
#   COMMIT=<sha of the tree you send> bash benchmarks/gpu_correctness.sh
# (name the commit yourself: the device copy's git HEAD need not be the tree that was sent)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nbattn_out}
COMMIT=${COMMIT:-unknown}
LIMIT=${LIMIT:-400}            # seconds for the whole visit
mkdir -p "$OUT" /tmp/nbattn_logs
L=/tmp/nbattn_logs
nvidia-smi -L; python3 -c "import numba_cuda, torch; print('numba-cuda', numba_cuda.__version__, 'torch', torch.__version__)"
t0=$(date +%s)
timeout $((LIMIT - 10)) python3 -m pytest -v -p no:cacheprovider -n 7 -m gpu tests/ > $L/gpu_tests.log 2>&1 &
P1=$!
timeout $((LIMIT - 10)) python3 benchmarks/gpu_notebooks.py --commit "$COMMIT" --out "$OUT" --jobs 3 \
    --timeout $((LIMIT - 30)) > $L/notebooks.log 2>&1 &
P2=$!
timeout $((LIMIT - 5)) nice -n 5 python3 benchmarks/gpu_verify_campaign.py --commit "$COMMIT" --seeds $(seq 11 21) \
    --cases 1100 --per-config 100 --time-budget $((LIMIT - 110)) --out "$OUT" > $L/verify.log 2>&1 &
P3=$!
for p in $P1 $P2 $P3; do wait $p; echo "pid $p rc=$? at $(( $(date +%s) - t0 )) s"; done
tail -5 $L/gpu_tests.log; tail -12 $L/notebooks.log; tail -4 $L/verify.log
tar czf "$OUT/logs.tgz" -C /tmp nbattn_logs
