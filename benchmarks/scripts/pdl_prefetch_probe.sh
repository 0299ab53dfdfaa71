#!/usr/bin/env bash
# H200 A/B of the PDL prefetch (GemvConfig.prefetch / MmaConfig.prefetch): offline SASS shows ptxas hoisting
# griddepcontrol.wait above the weight loads our kernels issue before it (ld.global.nc), so no weight was in flight
# while the previous kernel finished; the prefetch variants issue that first batch through the coherent path, which
# ptxas keeps ahead (tests/ops/test_pdl_load_order.py). The op bench times each config as CUDA-graph replays of
# back-to-back calls (PDL between them): the quick set is the default and its prefetch twin per kernel.
# After `bash .device/cute-a/stash.sh` (carry .device/cute-a), carrying .device/cute-b and .whl:
#   source scripts/device_env.sh && bash benchmarks/scripts/pdl_prefetch_probe.sh      # results under $OUT/pdl
set -o pipefail
R=${OUT:-/tmp/ls_out}/pdl; mkdir -p "$R"
export LS_KERNEL_CACHE_DIR=${LS_KERNEL_CACHE_DIR:-/tmp/ls_kcache} CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/tests/ops${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s)
timeout "${TEST_S:-150}" python3 -m pytest -q -rfE -p no:cacheprovider -n 4 tests/ops/test_gemm_norm_prefetch_gpu.py \
  -k "gemv" > "$R/tests.log" 2>&1
echo "gemv tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 "$R/tests.log"
timeout "${OPS_S:-300}" python3 -m latency_specialized.cli bench-ops --ops gemm --model kimi_k3 --tp 8 \
  --m "${M:-1,4,16}" --quick --out "$R" > "$R/bench_ops.log" 2>&1
echo "bench-ops rc=$? $(( $(date +%s) - t0 )) s"; grep -hE "gemv|small_m" "$R"/*.md 2>/dev/null | head -60
