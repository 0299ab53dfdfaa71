#!/usr/bin/env bash
# The measurements sessions 36-40 left pending, in one device call after the whole GPU suite (same machine, its
# caches unpacked; carry .device/cute-b and .whl with humming-kernels). Each step under its own timeout, in priority
# order, so a call stopped at the limit keeps the steps before; results tarred per step (the device returns <= 8 files):
#   source scripts/device_env.sh >/dev/null 2>&1; bash benchmarks/scripts/pending_measurements.sh
# Steps (STEPS, default mhc,q4,dsv,ab):
#   mhc  mHC seam alone at DeepSeek-V4.1 shapes: the per-thread Sinkhorn (SCALAR_SINKHORN) beside the vector form,
#        and the same with 1 Sinkhorn round (what the tail's 20 rounds cost)
#   q4   the MXFP4 routed experts at Kimi K3 TP8: the paired-nibble layout beside the checkpoint packing, humming beside
#   dsv  DeepSeek-V4.1-Flash TP8 layers window and c2_idx at batch 1, 8, 64 (session 40's mHC blocks in the layer)
#   ab   DeepSeek-V4.1-Flash A/B: the sparse MQA combine with PDL (batch 1, 8) and 16 KiB split tiles (batch 2, 4)
set -o pipefail
OUT=${OUT:-/tmp/ls_out}
export LS_KERNEL_CACHE_DIR=${LS_KERNEL_CACHE_DIR:-/tmp/ls_kcache} CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1
STEPS=${STEPS:-mhc,q4,dsv,ab}
W=$(mktemp -d)
t0=$(date +%s)
step() { [[ ",$STEPS," == *",$1,"* ]]; }
pack() { tar -C "$W" -czf "$OUT/$1.tgz" "$1" && echo "$1: rc=$2 at $(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
if step mhc; then
  mkdir -p "$W/mhc"
  timeout "${MHC_S:-90}" python3 benchmarks/scripts/mhc_bench.py --batches 1,8,64 --seams middle --no-reference \
    --scalar-sinkhorn --out "$W/mhc" > "$W/mhc/mhc.log" 2>&1; rc=$?
  timeout "${MHC_S:-90}" python3 benchmarks/scripts/mhc_bench.py --batches 1,8,64 --seams middle --no-reference \
    --scalar-sinkhorn --sinkhorn-iters 1 --tag _iters1 --out "$W/mhc" >> "$W/mhc/mhc.log" 2>&1
  pack mhc "$rc/$?"; grep -h "^| " "$W"/mhc/mhc*.md | head -20
fi
if step q4; then
  OUT="$W" TESTS=0 NVFP4=0 BATCH=${Q4_BATCH:-1,8,64} MMA_VARIANTS=default,paired BENCH_S=${Q4_S:-200} \
    bash benchmarks/scripts/q4_experts_mma_probe.sh > "$W/q4mma.log" 2>&1; rc=$?
  mv "$W/q4mma.log" "$W/q4mma/"; pack q4mma "$rc"; grep -h "^| " "$W"/q4mma/*.md | cut -d'|' -f2-9 | head -24
fi
if step dsv; then
  mkdir -p "$W/dsv"
  timeout "${DSV_S:-200}" python3 -m latency_specialized.cli bench --model deepseek_v41_flash --tp 8 \
    --kinds window,c2_idx --batch 1,8,64 --context 4096 --layers 3 --out "$W/dsv" > "$W/dsv/dsv.log" 2>&1
  pack dsv $?; grep -h "^| " "$W"/dsv/*.md | head -12
fi
if step ab; then
  mkdir -p "$W/ab"
  timeout "${AB_S:-150}" python3 -m latency_specialized.cli bench --model deepseek_v41_flash --tp 8 \
    --kinds window,c2_idx --batch 1,8 --context 4096 --layers 3 --out "$W/ab" --ab base \
    --ab cpdl:latency_specialized.kernels.sparse_mqa_triton.COMBINE_PDL=True > "$W/ab/ab_cpdl.log" 2>&1; rc=$?
  timeout "${AB_S:-150}" python3 -m latency_specialized.cli bench --model deepseek_v41_flash --tp 8 \
    --kinds window,c2_idx --batch 2,4 --context 4096 --layers 3 --out "$W/ab" --ab base \
    --ab tile16:latency_specialized.kernels.sparse_mqa_triton.TILE_BYTES=16384 > "$W/ab/ab_tile16.log" 2>&1
  pack ab "$rc/$?"; tail -12 "$W"/ab/ab_cpdl.log "$W"/ab/ab_tile16.log
fi
echo "done at $(( $(date +%s) - t0 )) s"
