#!/usr/bin/env bash
# Issue 24 on the H200, one call: the MXFP4 mma kernels - the gemm (gemm_q4_mma) and the routed experts on it
# (moe.experts.mma) - their GPU tests, then the 4-bit experts bench at Kimi K3 TP8 (ours: mma per MMA_VARIANTS
# entry, the Triton 4-bit paths; humming's MXFP4 MoE as stock runs it; our bf16 experts), results after every batch.
# After `bash .device/cute-a/stash.sh` (carry .device/cute-a), carrying .device/cute-b and .whl (humming):
#   source scripts/device_env.sh && bash benchmarks/scripts/q4_experts_mma_probe.sh      # results under $OUT/q4mma
# Env: TEST_S (tests' limit), BENCH_S, BATCH (default 1,4,8,16,64), MMA_VARIANTS (names or all), QUICK=1 (Triton
# default variants only), TESTS=0 (bench only: the whole suite ran the tests), LAYER=1 (the layer A/B), PROFILE=1
# (the layer per kernel).
set -o pipefail
R=${OUT:-/tmp/ls_out}/q4mma; mkdir -p "$R"
export LS_KERNEL_CACHE_DIR=${LS_KERNEL_CACHE_DIR:-/tmp/ls_kcache} CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1
export HUMMING_CACHE_DIR=${HUMMING_CACHE_DIR:-/tmp/hcache}
export PYTHONPATH=$PWD:$PWD/tests/ops${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s)
if [ "${TESTS:-1}" = 1 ]; then
timeout "${TEST_S:-240}" python3 -m pytest -q -rfE -p no:cacheprovider -n 4 tests/ops/test_moe_experts_mma_gpu.py \
  tests/ops/test_gemm_q4_mma_gpu.py > "$R/tests.log" 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^(FAILED|ERROR)" "$R/tests.log" | cut -c1-240 | head -20
tail -1 "$R/tests.log"
fi
timeout "${BENCH_S:-300}" python3 benchmarks/scripts/q4_experts_bench.py --tp 8 --batch "${BATCH:-1,4,8,16,64}" \
  --fmt mxfp4 ${QUICK:+--quick} ${MMA_VARIANTS:+--mma-variants "$MMA_VARIANTS"} --out "$R" > "$R/bench.log" 2>&1
echo "bench rc=$? $(( $(date +%s) - t0 )) s"; grep -h "^| " "$R/ops_moe_experts_q4_mxfp4_tp8.md" | cut -d'|' -f2-9 | head -80
# NVFP4 (Muse Spark's format) at the same shapes: ours only (no peer wired for NVFP4)
if [ "${NVFP4:-1}" = 1 ]; then
  timeout "${NV_S:-150}" python3 benchmarks/scripts/q4_experts_bench.py --tp 8 --batch "${NV_BATCH:-1,8,64}" \
    --fmt nvfp4 --quick --mma-variants default --out "$R" > "$R/bench_nvfp4.log" 2>&1
  echo "nvfp4 bench rc=$? $(( $(date +%s) - t0 )) s"; grep -h "^| " "$R/ops_moe_experts_q4_nvfp4_tp8.md" | cut -d'|' -f2-9 | head -20
fi
# the Kimi K3 layers with MXFP4 experts: moe.experts.mma (baseline, the default since session 35) against the Triton
# 4-bit kernels (LAYER=1)
if [ "${LAYER:-0}" = 1 ]; then
  timeout "${LAYER_S:-400}" python3 -m latency_specialized.cli bench --model kimi_k3 --tp 8 --experts mxfp4 \
    --batch "${LAYER_BATCH:-1,8,64}" --out "$R" --ab mma \
    --ab triton:latency_specialized.kernels.moe_experts_mma.ENABLED=False > "$R/layer_ab.log" 2>&1
  echo "layer A/B rc=$? $(( $(date +%s) - t0 )) s"; tail -30 "$R/layer_ab.log"
fi
# per-kernel device time of the Kimi K3 KDA layer with MXFP4 experts, ours and stock (PROFILE=1; the experts' two
# stages apart in the timeline)
if [ "${PROFILE:-0}" = 1 ]; then
  timeout "${PROFILE_S:-240}" python3 benchmarks/scripts/profile_layer.py --kind kda --batches "${PROFILE_BATCH:-1,8}" \
    --experts mxfp4 --timeline --out "$R/profile_kda_mxfp4.json" > "$R/profile_kda_mxfp4.txt" 2>&1
  echo "profile rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^=== |MmaExperts" "$R/profile_kda_mxfp4.txt" | head -30
fi
