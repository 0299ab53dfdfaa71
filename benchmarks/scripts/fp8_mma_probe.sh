#!/usr/bin/env bash
# Issue 24 on the H200, one call: the CuTe DSL block-FP8 gemm (gemm.fp8_w8a16_mma) and MXFP4 mma kernel - their GPU
# tests and the two FP8 tests fixed after session 32 - then the FP8 op bench (ours: mma per launch config incl. the
# "split" pairing + the Triton paths' heuristic; humming's W8A16 (also DeepSeek's 32 x 32 as MXFP8), the stock W8A8
# stand-in, bf16 cuBLAS) on the >= 20 MB shard shapes first, then the TP8 ones; then the MXFP4 kernel on a batch-1
# expert load (benchmarks/scripts/q4_mma_bench.py).
# After `bash .device/cute-a/stash.sh` (carry .device/cute-a), carrying .device/cute-b and .whl:
#   source scripts/device_env.sh && bash benchmarks/scripts/fp8_mma_probe.sh        # results under $OUT/fp8mma
# Env: EXPERTS=1 also times GLM-5.3's block-FP8 experts (benchmarks/scripts/fp8_experts_bench.py:
# moe.experts.mma_fp8 vs the Triton FP8 experts), Q4=0 skips the MXFP4 kernel.
set -o pipefail
R=${OUT:-/tmp/ls_out}/fp8mma; mkdir -p "$R"
export LS_KERNEL_CACHE_DIR=${LS_KERNEL_CACHE_DIR:-/tmp/ls_kcache} CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1
export HUMMING_CACHE_DIR=${HUMMING_CACHE_DIR:-/tmp/hcache}
export PYTHONPATH=$PWD:$PWD/tests/ops${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s)
timeout "${TEST_S:-200}" python3 -m pytest -q -rfE -p no:cacheprovider -n 4 tests/ops/test_gemm_fp8_mma_gpu.py \
  tests/ops/test_gemm_q4_mma_gpu.py \
  "tests/ops/test_gemm_fp8_gpu.py::test_fp8_decoding_of_every_code_under_edge_scales_is_exact" \
  tests/ops/test_moe_finalize_gpu.py > "$R/tests.log" 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^(FAILED|ERROR)" "$R/tests.log" | cut -c1-240 | head -20
tail -1 "$R/tests.log"
SH=${FP8_SHAPES:-"dsv41-tp1 wq_b,glm53-tp4 dense gate_up,glm53-tp4 o_proj,dsv41-tp2 wo_b,glm53-tp4 dense down,glm53-tp8 q_b+wq_b,glm53-tp8 o_proj,glm53-tp8 q_a+kv_a,glm53-tp8 dense gate_up,dsv41-tp8 wq_b"}
timeout "${FP8_S:-300}" python3 benchmarks/scripts/fp8_gemm_bench.py --batch "${FP8_BATCH:-1,4,16,64}" --quick \
  --shapes "$SH" --out "$R" > "$R/fp8_gemm.log" 2>&1
echo "fp8 gemm rc=$? $(( $(date +%s) - t0 )) s"; grep -h "^| " "$R/ops_gemm_fp8.md" | cut -d'|' -f2-10 | head -48
# the MXFP4 mma kernel (the 4-bit experts' building block) on a batch-1 expert load (Q4=0 skips it)
if [ "${Q4:-1}" = 1 ]; then
  timeout "${Q4_S:-120}" python3 benchmarks/scripts/q4_mma_bench.py --out "$R" > "$R/q4_mma.log" 2>&1
  echo "q4 mma rc=$? $(( $(date +%s) - t0 )) s"; grep -h "^| " "$R/q4_mma.md" | head -12
fi
# GLM-5.3's block-FP8 experts at TP8: moe.experts.mma_fp8 against the Triton FP8 experts (EXPERTS=1)
if [ "${EXPERTS:-0}" = 1 ]; then
  timeout "${EXPERTS_S:-200}" python3 benchmarks/scripts/fp8_experts_bench.py --tp 8 --batch "${EXPERTS_BATCH:-1,8,64}" \
    --out "$R" > "$R/fp8_experts.log" 2>&1
  echo "fp8 experts rc=$? $(( $(date +%s) - t0 )) s"; grep -h "^| " "$R/ops_moe_experts_fp8_glm53_tp8.md" | head -20
fi
