#!/usr/bin/env bash
# The measurements left pending, in one device call after the whole GPU suite (same machine, its caches unpacked;
# carry .device/cute-b, .whl with humming-kernels, .device/flashmla.tgz). Each step under its own timeout, in
# priority order, so a call stopped at the limit keeps the steps before; results tarred per step (the device returns
# <= 8 files):
#   source scripts/device_env.sh >/dev/null 2>&1; timeout 575 bash benchmarks/scripts/pending_measurements.sh
# Steps (STEPS, default dsv,early,kimi,q4,muse,glm) - session 41's plan for session 42:
#   dsv   DeepSeek-V4.1-Flash TP8 window / c2_idx at batch 1, 8, 64 with stock: the merged gemm cells (the shared
#         expert's GLU GEMV), the experts' addend and the mHC out row loaded first (predicted 14 kernels at batch 1)
#   early DeepSeek-V4.1-Flash A/B, batch 1 and 8: the sparse MQA split kernel's first tile requested before its
#         prologue (sparse_mqa_triton.EARLY_FIRST_TILE); the q_b GEMV with its norm prologue given a 1.5 us credit
#         over the table's winner (tuning.NORM_SITE_CREDIT_US: attn.q_norm skipped on the index layers at batch 1)
#   kimi  Kimi K3 TP8 kda / mla at batch 1 and 8 with MXFP4 experts, stock on humming's MXFP4 MoE (not run since 35)
#   q4    the MXFP4 mma experts at 64 tokens, every variant of ops_bench_q4.MMA_VARIANTS beside humming (session 41:
#         0.98x the peer on an H100)
#   muse  Muse Spark TP8 swa / full at batch 1 and 8
#   glm   GLM-5.3 TP8 moe / moe_shared_topk at batch 1 and 8
set -o pipefail
OUT=${OUT:-/tmp/ls_out}
export LS_KERNEL_CACHE_DIR=${LS_KERNEL_CACHE_DIR:-/tmp/ls_kcache} CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1
STEPS=${STEPS:-dsv,early,kimi,q4,muse,glm}
W=$(mktemp -d)
t0=$(date +%s)
step() { [[ ",$STEPS," == *",$1,"* ]]; }
pack() { tar -C "$W" -czf "$OUT/$1.tgz" "$1" && echo "$1: rc=$2 at $(( $(date +%s) - t0 )) s"; }
BENCH=(python3 -m latency_specialized.cli bench --tp 8 --context 4096 --layers 3)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
if step dsv; then
  mkdir -p "$W/dsv"
  timeout "${DSV_S:-150}" "${BENCH[@]}" --model deepseek_v41_flash --kinds window,c2_idx --batch 1,8,64 \
    --out "$W/dsv" > "$W/dsv/dsv.log" 2>&1
  pack dsv $?; grep -h "^| " "$W"/dsv/*.md | head -14
fi
if step early; then
  mkdir -p "$W/early"
  timeout "${EARLY_S:-200}" "${BENCH[@]}" --model deepseek_v41_flash --kinds window,c2_idx --batch 1,8 \
    --out "$W/early" --ab base --ab early:latency_specialized.kernels.sparse_mqa_triton.EARLY_FIRST_TILE=True \
    --ab credit:latency_specialized.kernels.tuning.NORM_SITE_CREDIT_US=1.5 > "$W/early/early.log" 2>&1; rc=$?
  rm -rf "$W/early/ab_runs"; pack early "$rc"; tail -6 "$W/early/early.log"
fi
if step kimi; then
  mkdir -p "$W/kimi"
  timeout "${KIMI_S:-170}" "${BENCH[@]}" --model kimi_k3 --kinds kda,mla --batch 1,8 --experts mxfp4 \
    --out "$W/kimi" > "$W/kimi/kimi.log" 2>&1
  pack kimi $?; grep -h "^| " "$W"/kimi/*.md | head -14
fi
if step q4; then
  OUT="$W" TESTS=0 NVFP4=0 QUICK=1 BATCH=64 BENCH_S=${Q4_S:-150} bash benchmarks/scripts/q4_experts_mma_probe.sh \
    > "$W/q4mma.log" 2>&1; rc=$?
  mv "$W/q4mma.log" "$W/q4mma/"; pack q4mma "$rc"; grep -h "^| " "$W"/q4mma/*.md | cut -d'|' -f2-9 | head -24
fi
if step muse; then
  mkdir -p "$W/muse"
  timeout "${MUSE_S:-120}" "${BENCH[@]}" --model muse_spark --batch 1,8 --out "$W/muse" > "$W/muse/muse.log" 2>&1
  pack muse $?; grep -h "^| " "$W"/muse/*.md | head -10
fi
if step glm; then
  mkdir -p "$W/glm"
  timeout "${GLM_S:-120}" "${BENCH[@]}" --model glm53 --kinds moe,moe_shared_topk --batch 1,8 --out "$W/glm" \
    > "$W/glm/glm.log" 2>&1
  pack glm $?; grep -h "^| " "$W"/glm/*.md | head -10
fi
echo "done at $(( $(date +%s) - t0 )) s"
