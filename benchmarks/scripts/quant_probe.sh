#!/usr/bin/env bash
# Issue 24 on the H200, one call: the block-FP8 gemms (ours per launch config against humming's W8A16, the stock
# W8A8 stand-in and bf16 cuBLAS, GLM-5.3 / DeepSeek-V4.1 shard shapes), then the Kimi K3 KDA and MLA layers with
# MXFP4 experts against stock's humming MoE (bench --experts mxfp4). After `bash .device/cute-a/stash.sh` (carry
# .device/cute-a), carrying .device/cute-b and .whl (with the humming_kernels wheel: vLLM 0.33 pins 0.1.19):
#   source scripts/device_env.sh && bash benchmarks/scripts/quant_probe.sh        # results: $OUT/quant.tgz
set -o pipefail
R=${OUT:-/tmp/ls_out}/quant; mkdir -p "$R"
export LS_KERNEL_CACHE_DIR=${LS_KERNEL_CACHE_DIR:-/tmp/ls_kcache} CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1
export HUMMING_CACHE_DIR=${HUMMING_CACHE_DIR:-/tmp/hcache}
t0=$(date +%s)
# FP8_QUICK=1: the heuristic default config only (the sweep of ops_bench_fp8.SWEEP triples the time)
timeout "${FP8_S:-240}" python3 benchmarks/scripts/fp8_gemm_bench.py --batch "${FP8_BATCH:-1,4,16,64}" \
  ${FP8_QUICK:+--quick} ${FP8_SHAPES:+--shapes "$FP8_SHAPES"} --out "$R" > "$R/fp8_gemm.log" 2>&1
echo "fp8 gemm rc=$? $(( $(date +%s) - t0 )) s"; grep -h "^| " "$R/ops_gemm_fp8.md" | head -40
timeout "${LAYER_S:-300}" python3 -m latency_specialized.cli bench --model kimi_k3 --tp 8 --kinds kda,mla \
  --batch "${LAYER_BATCH:-1,8,64}" --context 4096 --layers 3 --experts mxfp4 --out "$R" \
  --name bench_kimi_k3_tp8_mxfp4 > "$R/layer_mxfp4.log" 2>&1
echo "mxfp4 layer rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\[(kda|mla)\] batch" "$R/layer_mxfp4.log" | head -12
tar czf "${OUT:-/tmp/ls_out}/quant.tgz" -C "$(dirname "$R")" "$(basename "$R")"
