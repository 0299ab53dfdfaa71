#!/usr/bin/env bash
# H200 session runs: GPU tests, the gemm dispatch table, the MoE/KDA and MLA op benches,
# the Kimi K3 layer bench (KINDS=kda,mla; CONTEXT for MLA cells; SPEC_TOKENS=0,3,7 and ROUTING=random|shared for
# verification cells, e.g. STEPS=bench KINDS=kda,mla BATCH=1 CONTEXT=4096 SPEC_TOKENS=0,3,7 ROUTING=shared) and the long teacher-forced check
# (long_check.py of LONG_MODEL, default kimi_k3, at RUNS batch:steps:router_scale,...; JSON $OUT/res/LONG_NAME.json).
#   on the device, after `bash .device/cute-a/stash.sh` on the same machine:
#   source scripts/device_env.sh && bash benchmarks/scripts/h200_session.sh
# Put the local commit into the command, e.g. `LS_GIT_COMMIT=<git rev-parse HEAD here> LS_GIT_DIRTY=0 ...`:
# the device copy's .git is not the tree's (it kept the session's first commit), and result files record it.
# STEPS (default "tests,table,bench") picks the parts (tests,table,ops,opsmoe,experts,opsmla,bench,long);
# results under $OUT. ops = bench-ops of OPS (default gemm,norm,prefetch) with a fresh gemm table;
# experts = the routed-expert variants at EXPERT_BATCHES (default 2,4,8,16,32,64) vs stock Triton.
set -o pipefail
OUT=${OUT:-/tmp/ls_out}
mkdir -p "$OUT/res"
export LS_KERNEL_CACHE_DIR=${LS_KERNEL_CACHE_DIR:-/tmp/ls_kcache} CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1
STEPS=${STEPS:-tests,table,bench}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  > "$OUT/gpu.txt" 2>&1
t0=$(date +%s)
if [[ ",$STEPS," == *",tests,"* ]]; then
  timeout "${TEST_S:-240}" python3 -m pytest -m gpu ${TESTS:-tests/ops/test_attnres_mlp_gpu.py \
    tests/ops/test_gemm_norm_prefetch_gpu.py tests/models/kimi_k3/test_long_check.py} -q -rfE -p no:cacheprovider \
    > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$? at $(( $(date +%s) - t0 )) s"; tail -4 "$OUT/gpu_tests.log"
fi
if [[ ",$STEPS," == *",table,"* ]]; then
  timeout "${TABLE_S:-240}" python3 -m latency_specialized.cli bench-ops --ops gemm --tp 8,16 --out "$OUT/res" \
    --write-table "$OUT/res/h200_gemm.json" --jobs 15 > "$OUT/bench_ops.log" 2>&1
  echo "table rc=$? at $(( $(date +%s) - t0 )) s"; tail -2 "$OUT/bench_ops.log"
fi
if [[ ",$STEPS," == *",ops,"* ]]; then
  timeout "${OPS_S:-300}" python3 -m latency_specialized.cli bench-ops --ops "${OPS:-gemm,norm,prefetch}" \
    --out "$OUT/res" --write-table "$OUT/res/h200_gemm.json" --jobs 15 > "$OUT/bench_ops.log" 2>&1
  echo "ops rc=$? at $(( $(date +%s) - t0 )) s"; tail -2 "$OUT/bench_ops.log"
fi
if [ -f "$OUT/res/h200_gemm.json" ]; then export LS_GEMM_TABLE="$OUT/res/h200_gemm.json"; fi
if [[ ",$STEPS," == *",experts,"* ]]; then
  python3 benchmarks/scripts/bench_moe_kda.py --precompile --experts-sweep "${EXPERT_BATCHES:-2,4,8,16,32,64}" \
    --jobs 15 > "$OUT/experts_precompile.log" 2>&1
  echo "experts precompile rc=$? at $(( $(date +%s) - t0 )) s"; tail -1 "$OUT/experts_precompile.log"
  timeout "${EXPERTS_S:-240}" python3 benchmarks/scripts/bench_moe_kda.py --out "$OUT/res" \
    --experts-sweep "${EXPERT_BATCHES:-2,4,8,16,32,64}" --tps "${EXPERT_TPS:-8,16}" > "$OUT/experts_sweep.log" 2>&1
  echo "experts sweep rc=$? at $(( $(date +%s) - t0 )) s"; grep "^experts" "$OUT/experts_sweep.log" | cut -c1-150
fi
if [[ ",$STEPS," == *",opsmoe,"* ]]; then
  timeout "${MOE_S:-150}" python3 benchmarks/scripts/bench_moe_kda.py --out "$OUT/res" > "$OUT/bench_moe_kda.log" 2>&1
  echo "moe/kda ops rc=$? at $(( $(date +%s) - t0 )) s"; grep "^kda tp8 B=64\|^router" "$OUT/bench_moe_kda.log" | head -8
fi
if [[ ",$STEPS," == *",opsmla,"* ]]; then
  timeout "${MLA_S:-150}" python3 benchmarks/scripts/bench_mla.py --out "$OUT/res" ${MLA_ARGS:-} > "$OUT/bench_mla.log" 2>&1
  echo "mla ops rc=$? at $(( $(date +%s) - t0 )) s"; tail -4 "$OUT/bench_mla.log"
fi
if [[ ",$STEPS," == *",bench,"* ]]; then
  timeout "${BENCH_S:-150}" python3 -m latency_specialized.cli bench --model kimi_k3 --tp 8 --kinds ${KINDS:-kda} \
    --batch ${BATCH:-1,2,4,8,16,32,64} $([[ ",${KINDS:-kda}," == *",mla,"* ]] && echo --context ${CONTEXT:-4096,32768}) --layers 3 ${SPEC_TOKENS:+--spec-tokens $SPEC_TOKENS} ${ROUTING:+--routing $ROUTING} ${NAME:+--name $NAME} --out "$OUT/res" \
    > "$OUT/bench.log" 2>&1
  echo "bench rc=$? at $(( $(date +%s) - t0 )) s"; grep "batch" "$OUT/bench.log" | tail -16
fi
if [[ ",$STEPS," == *",long,"* ]]; then
  LONG_MODEL=${LONG_MODEL:-kimi_k3}
  LONG_NAME=${LONG_NAME:-$([[ $LONG_MODEL == kimi_k3 ]] && echo kimi || echo "$LONG_MODEL")_long_check}
  timeout "${LONG_S:-500}" python3 benchmarks/scripts/long_check.py --model "$LONG_MODEL" --runs "${RUNS:-64:256:0}" \
    --out "$OUT/res/$LONG_NAME.json" > "$OUT/long_check.log" 2>&1
  echo "long check ($LONG_MODEL) rc=$? at $(( $(date +%s) - t0 )) s"; grep "^batch" "$OUT/long_check.log"
fi
# one archive: the device returns a limited number of files
tar czf "$OUT/results.tgz" -C "$OUT" res && rm -rf "$OUT/res"
