#!/usr/bin/env bash
# The measurements sessions 36-40 left pending, in one device call after the whole GPU suite (same machine, its
# caches unpacked; carry .device/cute-b and .whl with humming-kernels). Each step under its own timeout, in priority
# order, so a call stopped at the limit keeps the steps before; results tarred per step (the device returns <= 8 files):
#   source scripts/device_env.sh >/dev/null 2>&1; bash benchmarks/scripts/pending_measurements.sh
# Steps (STEPS, default ab,mhc,q4,b64,glm,tile16):
#   ab     DeepSeek-V4.1-Flash TP8 window / c2_idx, batch 1 and 8, A/B: base against the shared experts added after
#          the experts by a kernel of its own (ADD_SHARED_IN_EXPERTS=False, the old way)
#   mhc    mHC seam alone at DeepSeek-V4.1 shapes: the out row loaded before the coefficients (OUT_LOAD_FIRST) beside
#          and the same with 1 Sinkhorn round (what the tail's 20 rounds cost)
#   q4     the MXFP4 routed experts at Kimi K3 TP8: the paired-nibble layout beside the checkpoint packing, humming beside
#   b64    DeepSeek-V4.1-Flash window / c2_idx at batch 64 (session 40's mHC blocks in the layer)
#   glm    GLM-5.3 TP8 moe / moe_shared_topk at batch 1 and 8, A/B of the shared experts' add as in ab
#   tile16 DeepSeek-V4.1-Flash A/B of 16 KiB sparse MQA split tiles at batch 2 and 4, and of the sparse MQA combine
#          launched with PDL
set -o pipefail
OUT=${OUT:-/tmp/ls_out}
export LS_KERNEL_CACHE_DIR=${LS_KERNEL_CACHE_DIR:-/tmp/ls_kcache} CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1
STEPS=${STEPS:-ab,mhc,q4,b64,glm,tile16}
W=$(mktemp -d)
t0=$(date +%s)
step() { [[ ",$STEPS," == *",$1,"* ]]; }
pack() { tar -C "$W" -czf "$OUT/$1.tgz" "$1" && echo "$1: rc=$2 at $(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
DSV=(python3 -m latency_specialized.cli bench --model deepseek_v41_flash --tp 8 --context 4096 --layers 3)
OLD_ADD=add:latency_specialized.pieces.ffn.moe.ADD_SHARED_IN_EXPERTS=False
if step ab; then
  mkdir -p "$W/ab"
  timeout "${AB_S:-300}" "${DSV[@]}" --kinds window,c2_idx --batch 1,8 --out "$W/ab" --ab base --ab "$OLD_ADD" \
    > "$W/ab/ab.log" 2>&1
  pack ab $?; tail -8 "$W/ab/ab.log"
fi
if step mhc; then
  mkdir -p "$W/mhc"
  timeout "${MHC_S:-60}" python3 benchmarks/scripts/mhc_bench.py --batches 1,8,64 --seams middle --no-reference \
    --out-first --out "$W/mhc" > "$W/mhc/mhc.log" 2>&1; rc=$?
  timeout "${MHC_S:-60}" python3 benchmarks/scripts/mhc_bench.py --batches 1,8,64 --seams middle --no-reference \
    --out-first --sinkhorn-iters 1 --tag _iters1 --out "$W/mhc" >> "$W/mhc/mhc.log" 2>&1
  pack mhc "$rc/$?"; grep -h "^| " "$W"/mhc/mhc*.md | head -20
fi
if step q4; then
  OUT="$W" TESTS=0 NVFP4=0 BATCH=${Q4_BATCH:-1,8,64} MMA_VARIANTS=default,paired BENCH_S=${Q4_S:-150} \
    bash benchmarks/scripts/q4_experts_mma_probe.sh > "$W/q4mma.log" 2>&1; rc=$?
  mv "$W/q4mma.log" "$W/q4mma/"; pack q4mma "$rc"; grep -h "^| " "$W"/q4mma/*.md | cut -d'|' -f2-9 | head -24
fi
if step b64; then
  mkdir -p "$W/b64"
  timeout "${B64_S:-120}" "${DSV[@]}" --kinds window,c2_idx --batch 64 --out "$W/b64" > "$W/b64/b64.log" 2>&1
  pack b64 $?; grep -h "^| " "$W"/b64/*.md | head -8
fi
if step glm; then
  mkdir -p "$W/glm"
  timeout "${GLM_S:-150}" python3 -m latency_specialized.cli bench --model glm53 --tp 8 --kinds moe,moe_shared_topk \
    --batch 1,8 --context 4096 --layers 3 --out "$W/glm" --ab base --ab "$OLD_ADD" > "$W/glm/glm.log" 2>&1
  pack glm $?; tail -6 "$W/glm/glm.log"
fi
if step tile16; then
  mkdir -p "$W/tile16"
  timeout "${T16_S:-120}" "${DSV[@]}" --kinds window,c2_idx --batch 2,4 --out "$W/tile16" --ab base \
    --ab tile16:latency_specialized.kernels.sparse_mqa_triton.TILE_BYTES=16384 \
    --ab cpdl:latency_specialized.kernels.sparse_mqa_triton.COMBINE_PDL=True > "$W/tile16/tile16.log" 2>&1
  pack tile16 $?; tail -6 "$W/tile16/tile16.log"
fi
echo "done at $(( $(date +%s) - t0 )) s"
