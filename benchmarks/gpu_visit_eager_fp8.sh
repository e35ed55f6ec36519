#!/usr/bin/env bash
# One GPU visit for the public path and fp8 (issues 16 and 19):
#   COMMIT=<sha> bash benchmarks/gpu_visit_eager_fp8.sh
# 1. what torch's float -> float8_e4m3fn cast does with out-of-range values on this machine;
# 2. benchmarks/gpu_eager.py (eager.json, eager.png);
# 3. the GPU tests of the plain decode, the wrappers, fp8 and the tile rule;
# 4. benchmarks/gpu_fp8.py (fp8.json).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/nbattn_out}; mkdir -p "$OUT"
COMMIT=${COMMIT:-unknown}
t0=$(date +%s)
python3 -c "import torch; print(torch.__version__, torch.tensor([500., 1e6, float('inf')]).to(torch.float8_e4m3fn).view(torch.uint8).tolist())"
timeout ${EAGER_S:-300} python3 benchmarks/gpu_eager.py --commit "$COMMIT" --out "$OUT" > "$OUT/eager.log" 2>&1
echo "eager rc=$? at $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/eager.log"
timeout ${TESTS_S:-150} python3 -m pytest -p no:cacheprovider -q -rfE -n 12 tests/test_cuda_fp8.py tests/test_decode_call.py \
    tests/test_cuda_wrappers.py tests/test_tile_rule.py tests/test_hostwork_plan.py tests/test_driver.py > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? at $(( $(date +%s) - t0 )) s"; tail -8 "$OUT/gpu_tests.log"
timeout ${FP8_S:-120} python3 benchmarks/gpu_fp8.py --commit "$COMMIT" --out "$OUT" ${FP8_ARGS:-} > "$OUT/fp8.log" 2>&1
echo "fp8 rc=$? at $(( $(date +%s) - t0 )) s"; tail -12 "$OUT/fp8.log"
