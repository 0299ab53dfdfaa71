#!/usr/bin/env bash
# Where our MLA decode loses to FlashMLA (session 30: from batch 8 at 32K, 1,274 vs 577 us at GLM-5.3 TP8 shapes,
# batch 64): the fused merge's W_UV tile and the split kernel's stages, then the Kimi K3 MLA layer against stock on
# FlashMLA. On the H200, after `bash .device/cute-a/stash.sh` (carry .device/cute-a), carrying .device/cute-b, .whl
# and .device/flashmla.tgz (scripts/pack_flashmla.sh):
#   source scripts/device_env.sh && bash benchmarks/scripts/mla_gap_probe.sh      # results: $OUT/mla_gap.tgz
set -o pipefail
R=${OUT:-/tmp/ls_out}/mla_gap; mkdir -p "$R"
export LS_KERNEL_CACHE_DIR=${LS_KERNEL_CACHE_DIR:-/tmp/ls_kcache} CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1
t0=$(date +%s)
# base: MERGE_W_TILE (session 32: GLM's v 256 in two 128-wide blocks, set from offline register counts);
# nocap: the session-30 code (one 256-wide block: 5.6 KB of stack offline)
configs=(--config base: --config nocap:--merge-w-tile=1073741824 --config mlf128:--merge-l-fused=128
         --config mlf64:--merge-l-fused=64 --config vb32:--merge-v-block=32 --config s3:--stages=3)
timeout "${SWEEP_S:-240}" python3 benchmarks/scripts/mla_sweep.py --out "$R/glm" --contexts 32768 --batches 8,64 \
  --heads 8 --nope 192 --v 256 "${configs[@]}" > "$R/sweep_glm.log" 2>&1
echo "glm sweep rc=$? $(( $(date +%s) - t0 )) s"; grep -h "^| [0-9]" "$R"/glm/*.md
timeout "${SWEEP_S:-240}" python3 benchmarks/scripts/mla_sweep.py --out "$R/kimi" --contexts 32768 --batches 8,64 \
  "${configs[@]}" > "$R/sweep_kimi.log" 2>&1
echo "kimi sweep rc=$? $(( $(date +%s) - t0 )) s"; grep -h "^| [0-9]" "$R"/kimi/*.md
if [ -n "${LS_FLASHMLA_SRC:-}" ]; then
  timeout "${LAYER_S:-300}" python3 -m latency_specialized.cli bench --model kimi_k3 --tp 8 --kinds mla \
    --batch 1,8,64 --context 4096,32768 --layers 3 --out "$R" --name bench_kimi_k3_tp8_mla_flashmla \
    > "$R/layer.log" 2>&1
  echo "layer rc=$? $(( $(date +%s) - t0 )) s"; grep "^| mla" "$R/layer.log" | head -12
else
  echo "LS_FLASHMLA_SRC unset (carry .device/flashmla.tgz): the layer bench against FlashMLA is skipped"
fi
tar czf "${OUT:-/tmp/ls_out}/mla_gap.tgz" -C "$(dirname "$R")" "$(basename "$R")"
