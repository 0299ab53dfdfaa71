#!/usr/bin/env bash
# One H200 session for the gemm/norm/prefetch kernels: bench-ops (results + measured gemm dispatch
# table) then the GPU tests against that fresh table. Results land in $OUT (results.tgz + logs).
#   on the device, after `bash .device/cute-a/stash.sh` on the same machine:
#   source scripts/device_env.sh && bash latency_specialized/bench/h200_run.sh
# Knobs: OPS (bench families), BENCH_S / TEST_S (time limits), TESTS (pytest selection).
set -o pipefail
OUT=${OUT:-/tmp/ls_out}
mkdir -p "$OUT/res"
export LS_KERNEL_CACHE_DIR=${LS_KERNEL_CACHE_DIR:-/tmp/ls_kcache} PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv > "$OUT/gpu.txt" 2>&1
t0=$(date +%s)
timeout "${BENCH_S:-300}" python3 -m latency_specialized.cli bench-ops --ops "${OPS:-gemm,norm,prefetch}" \
  --out "$OUT/res" --write-table "$OUT/res/h200_gemm.json" --jobs 15 2>&1 | tee "$OUT/bench.log"
echo "bench rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
if [ -f "$OUT/res/h200_gemm.json" ]; then export LS_GEMM_TABLE="$OUT/res/h200_gemm.json"; fi
t1=$(date +%s)
timeout "${TEST_S:-200}" python3 -m pytest -m gpu ${TESTS:-tests/ops/test_gemm_norm_prefetch_gpu.py} -q -rfE \
  -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
echo "tests rc=$? in $(( $(date +%s) - t1 )) s" | tee -a "$OUT/gpu_tests.log"
tar czf "$OUT/results.tgz" -C "$OUT" res && rm -rf "$OUT/res"
