#!/usr/bin/env bash
# One GPU visit that re-runs the kernel suites after a change that must not make anything
# slower, and compares each record with the committed file (benchmarks/compare_results.py:
# new / old, same-run peer normalised where the record has a peer).
#   COMMIT=<sha> bash benchmarks/gpu_house_suites.sh      (about 8 minutes)
# Writes $OUT/{decode,decode_b1,prefill,cascade}.json and $OUT/compare.json.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nbattn_out}; mkdir -p "$OUT"
COMMIT=${COMMIT:-unknown}
t0=$(date +%s)
timeout 200 python3 benchmarks/gpu_decode.py bench --quick --out "$OUT" > "$OUT/decode.log" 2>&1
echo "decode rc=$? at $(( $(date +%s) - t0 )) s"
timeout 90 python3 benchmarks/gpu_decode_b1.py --out "$OUT" > "$OUT/decode_b1.log" 2>&1
echo "decode_b1 rc=$? at $(( $(date +%s) - t0 )) s"
timeout 180 python3 benchmarks/gpu_prefill.py prefill_8k cascade --commit "$COMMIT" --out "$OUT" > "$OUT/prefill.log" 2>&1
echo "prefill rc=$? at $(( $(date +%s) - t0 )) s"
python3 benchmarks/compare_results.py benchmarks/results "$OUT" decode decode_b1 prefill cascade \
    --commit "$COMMIT" --out "$OUT/compare.json"
