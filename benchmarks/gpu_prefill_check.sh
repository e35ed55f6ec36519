#!/usr/bin/env bash
# One device session for the tensor-core prefill / cascade paths: their GPU
# differential tests (three pytest processes side by side, so the kernel
# compiles overlap on the host cores), then benchmarks/gpu_prefill.py.
#   bash benchmarks/gpu_prefill_check.sh [gpu_prefill.py sections...]
# Writes $OUT/gpu_tests_prefill_*.txt and the result JSON files.
set -u
export PYTHONPATH=$PWD NBATTN_TEST_PATHS=tc
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider tests/test_cuda_prefill.py \
    -k "gpu_real_sizes or gpu_pipelined" > "$OUT/gpu_tests_prefill_a.txt" 2>&1 &
  timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider tests/test_cuda_sparse_cascade.py \
    > "$OUT/gpu_tests_prefill_b.txt" 2>&1 &
  timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider \
    tests/test_cuda_wrappers.py::test_gpu_prefill_cuda_graph_replay_after_replan \
    > "$OUT/gpu_tests_prefill_c.txt" 2>&1 &
  wait
  for f in "$OUT"/gpu_tests_prefill_*.txt; do echo "$f: $(tail -1 "$f")"; done
  echo "tests took $(( $(date +%s) - t0 )) s"
fi
python3 benchmarks/gpu_prefill.py "$@" 2>&1 | tee "$OUT/gpu_prefill_log.txt" | grep -v "^  *[0-9]* \[" | tail -60
echo "total $(( $(date +%s) - t0 )) s"
