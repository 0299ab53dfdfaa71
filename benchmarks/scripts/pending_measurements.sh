#!/usr/bin/env bash
# The measurements left pending, in one device call after the whole GPU suite (same machine, its caches unpacked;
# carry .device/cute-b, .whl with humming-kernels, .device/flashmla.tgz). Each step under its own timeout, in
# priority order, so a call stopped at the limit keeps the steps before; results tarred per step (the device returns
# <= 8 files):
#   source scripts/device_env.sh >/dev/null 2>&1; timeout 575 bash benchmarks/scripts/pending_measurements.sh
# Steps (STEPS, default normsm,dsv15,normk,paired,q4) - session 55's plan (session 55 ran pick54 on an H100:
# benchmarks/results/h100/session55/; session 53 ran pick52 and icache:
# benchmarks/results/h100/session53/; their switches are the defaults since, so pick52's, selab's and selglm's
# "base" now holds them - read their variants against that); pick52 holds session 51's cbeside and
# beside, which stay available by name (session 51 ran slots; session 50
# dsvk, fine, cutprof, paired (cut off), credit, q4: benchmarks/results/h100/session50/; session 48 c2ab, topk, dsv;
# session 46 gqa, dsvab, topk, muse; those, fine2, prof and gemm stay available by name):
#   pick52 (session 52's plan) the GPU tests of session 51's four switches, then DeepSeek-V4.1-Flash c2_idx and
#          GLM-5.3 moe at batch 1 / 8: base / side (the compressor beside the query; the indexer beside the sparse
#          MLA's prologue) / both (the select from the leading-byte counts with packed scans) / side + both / loop
#          (the select's rows looped in tiles: 32 KB of code against 88, session 52's cold-code question); the
#          winners picked by ab_pick.py's rule into /tmp/ls_picks.txt for the suite calls after
#   pick54 (session 54) GLM-5.3 moe at batch 1 / 8: base / wide (SELECT_WIDE_LOOPS: rows past the half-width path
#          looped) / wide8 (the same on 8 warps) / loop (every row looped) / sep (ops.plan.NORM_PROLOGUES=False);
#          DeepSeek-V4.1-Flash c2_idx base / wide / wide8 / k17 / k16 (session 50's kernel-count switches: the
#          compressor writing the key, the norm-site credit, the select in the score kernel); Kimi K3 mla and
#          DeepSeek window base / sep (their q_b GEMVs normalise their input too); picks into /tmp/ls_picks.txt.
#          Session 55 added: the one-launch shared-expert MLP (mlp_one_launch_triton.ENABLED) and its GPU tests -
#          GLM-5.3 one, DeepSeek k15 (k16 + it: issue 21's 15 kernels), not picked
#   dsv15  (session 55) DeepSeek-V4.1-Flash c2_idx at batch 1 / 8 on the session-55 defaults: base (18 kernels) /
#          fkey (the compressor writes the indexer's key: 17) / fsel (+ the select in the score kernel: 16) / cred
#          (fkey + the q norm in the q_b GEMV: 16) / k15 (all three: 15 kernels, 1.48x in session 55) / k15nsm (k15
#          with gemm_gemv.NORM_SMEM); a timeline of k15nsm
#   normsm (session 55) the norm prologue once per CTA in shared memory (gemm_gemv.NORM_SMEM, new, off): GLM-5.3 moe
#          base / nsm / sep, DeepSeek window and c2_idx base / nsm / cred (the norm-site credit) / nsmcred
#   normk  (session 55) Kimi K3 mla at batch 1 / 8: base / sep (ops.plan.NORM_PROLOGUES=False), 220 s
#   glmloop (session 52; since session 53 on the new defaults) GLM-5.3 moe at batch 1 / 8: base (bytes + packed + the
#          indexer beside the attention, the defaults) / loop (+ looped rows) / fine (+ the finer widths)
#   normab (session 53) GLM-5.3 moe and Kimi K3 mla at batch 1 / 8: base / sep (ops.plan.NORM_PROLOGUES=False: the
#          q_a norm launched before the q_b GEMV instead of inside it)
#   icache (session 52) the select after a kernel of big code on every SM vs a small one (select_icache_probe.py)
#   selglm (session 51's plan) GLM-5.3 moe at batch 1 / 8, one replay's kernels each: the radix select with 8 warps
#          instead of 16 at its 8,192 tile (w8), the finer widths (fine), 8-bit digits (b8), the passes started from
#          the score kernel's leading-byte counts (bytes: SELECT_FIRST_BYTE, new in session 51) alone and with fine,
#          one prefix sum for both ranks (packed: SELECT_PACKED_SCAN, new), bytes + packed (both) - the select takes
#          28 us a call in this layer and ~20 alone on the layer's own logits (session 51's probes)
#   selab  (session 51's plan) GLM-5.3 moe and DeepSeek-V4.1-Flash c2_idx at batch 1 / 8: base / bytes / bytes + fine /
#          8 warps at the 8,192 tile / bytes + packed - the layer A/B that decides the select's switches
#   beside (session 51's plan) GLM-5.3 moe at batch 1 / 8 with its indexer on the side stream beside the sparse MLA's
#          prologue (pieces.attention.sparse_mla.INDEXER_BESIDE_ATTENTION, new): base / side / side + bytes + packed,
#          and one replay's kernels with it
#   cbeside (session 51's plan) DeepSeek-V4.1-Flash c2_idx at batch 1 / 8 with the compressor on the side stream
#          beside the q norm and q_b gemm (pieces.attention.sparse_mqa.COMPRESS_BESIDE_QUERY, new): base / side /
#          side + the compressor writing the key / side + fine widths (c2_idx needs ~4 us for 1.5x), and a timeline
#   slots  (session 50's plan) one replay of a 2-layer DeepSeek-V4.1-Flash c2_idx program at batch 1 and 8 with the
#          step's slots in one launch each (step_slots_triton.STEP_SLOTS_KERNEL) off and on: the replay's total and
#          kernels (the layer bench leaves per-step work out)
#   fine2  (session 50's plan) the finer select widths again, 3 runs a variant: DeepSeek c2_idx and GLM-5.3 moe at
#          batch 1 / 8, base / fine / fine + the norm-site credit (c2_idx needs ~1 us past fine for 1.5x), then one
#          replay's kernels of GLM-5.3 moe at batch 1 with them off and on (session 50: the select alone 3.8 us faster
#          at its 4,097 live positions, the layer 0.7 us slower - which kernel moved)
#   dsvk   DeepSeek-V4.1-Flash c2_idx at batch 1 / 8, fewer kernels: (fkey) the compressor writes the indexer's new
#          key (sparse_mqa_triton.COMPRESS_INDEX_KEY, new in session 49: the key gemm and the indexer's key launch
#          left out, 20 -> 18 kernels), (fsel) the score kernel's last program of a row selects it
#          (indexer_triton.SCORE_SELECTS, new in session 49: -1), (credit) the q norm in the q_b gemm's prologue
#          (tuning.NORM_SITE_CREDIT_US, -1 where the GEMV kernel is within 1.5 us of the table's winner: the plan
#          takes it on c2_idx's q_b at batch 1, not at 8), (all) the three, (all5) with step fine's two (the 1.5x at
#          batch 1 needs ~4.8 us off c2_idx); GLM-5.3 moe (index layers): base / fsel / (wkey) the scoring program
#          holding the new position writes the key (indexer_triton.SCORE_WRITES_KEY, new in session 49: -1) / (one)
#          both, the indexer in one launch - the kernel counts in the runs' tables (ab_runs)
#   fine   the indexer's radix select holding a width that follows the live length in finer steps (1/4, 3/8, 1/2,
#          3/4, all of the tile: indexer_triton.SELECT_FINE_WIDTHS, new in session 48) against the half-width path
#          alone: the select alone at live lengths past each power of two, then DeepSeek c2_idx and GLM-5.3 moe
#          (indexer layers) at batch 1 / 8 with it (fine), with the scoring keys loaded a step ahead
#          (indexer_triton.SCORE_KEYS_AHEAD: ahead) and both
#   cutprof DeepSeek-V4.1-Flash c2_idx at batch 1, one replay's kernels with the indexer on the cut table
#          (INDEX_COMPRESSED_TABLE=True, off since session 46: 18 us slower in the layer, though the select alone is
#          faster on it) - where the 18 us go
#   c2ab   DeepSeek-V4.1-Flash c2_idx at batch 1 / 8: (selpdl) the sparse MQA split kernel launched with PDL
#          behind the radix select, which triggers at its start (sparse_mqa_triton.SELECTION_PDL +
#          indexer_triton.SELECT_TRIGGER_START, new in session 47: the split's prologue and window slots overlap the
#          12.6 us select); (mc64) the indexer's scoring chunk MIN_CHUNK 128 -> 64 (17 programs of two 64-position
#          tiles -> 33 of one at batch 1; the score kernel 8.1 us per call against ~0.3 us of bytes); (early) the
#          radix passes stop once the K-th key's bucket holds only keys to take (indexer_triton.SELECT_EARLY_EXIT,
#          new in session 48: ~4.6 of 8 passes on bench-like logits, a CPU simulation); (all3) the three together
#   gqa    the GQA split kernel's own merge (gqa_decode_triton.FUSED_MERGE_MAX_SPLITS, off since session 46) against
#          the merge kernel and at every split count, Muse Spark TP8 at batch 1-64, 4K-128K (gqa_sweep.py fused)
#   prof   DeepSeek-V4.1-Flash TP8 window and c2_idx at batch 1: one replay's kernels in order (profile_layer.py
#          --timeline; session 46 ran c2_idx alone: the select 31 -> 12.6 us per call on its half-width path)
#   dsvab  DeepSeek-V4.1-Flash c2_idx at batch 1 / 8 with the indexer on the whole table against the compressed
#          rows' table (pieces.attention.sparse_mqa.INDEX_COMPRESSED_TABLE, off since session 46); window at b1 / 8
#          with the sum-only all-reduces left out (runtime.harness.SUM_ONLY_KERNEL False) against the one-rank
#          kernel there (the bench before session 44); both measured in session 46 (cut table off, exclusion on)
#   topk   the indexer's radix select alone with the early exit (indexer_triton.SELECT_EARLY_EXIT) against all 8
#          passes (radix_early / radix_late; radix4_loop_early: tiles looped): 4,096- and 8,192-wide tables with half
#          of each live, K 512 / 2048, 1 / 8 rows (session 46 ran it as the half-width path's A/B)
#   muse   Muse Spark swa at batch 1 / 8, the same SUM_ONLY_KERNEL A/B (its gated residual's all-reduces)
#   paired Kimi K3 kda / mla layers with MXFP4 experts at batch 64: the paired layout (on since session 44)
#          against the checkpoint packing (session 44 measured batch 1 / 8, session 43 mla batch 1 / 64)
#   credit the norm-site credit (tuning.NORM_SITE_CREDIT_US=1.5) on Kimi K3 kda / mla at batch 1 and 8 (GLM-5.3 moe
#          and Muse Spark swa measured in session 44: -0.6 / 0.0 us, one run)
#   q4     the MXFP4 experts at 1, 8, 64 tokens, default / paired / paired_dn_a1 beside humming
#   gemm   the DeepSeek-V4.1-Flash attention projections at M 1 and 8 (bench-ops --shapes; session 44 ran it)
#   dsv    DeepSeek-V4.1-Flash window / c2_idx at batch 1 and 8 with stock, no A/B
set -o pipefail
OUT=${OUT:-/tmp/ls_out}
export LS_KERNEL_CACHE_DIR=${LS_KERNEL_CACHE_DIR:-/tmp/ls_kcache} CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1
STEPS=${STEPS:-normsm,dsv15,normk,paired,q4}
W=$(mktemp -d)
t0=$(date +%s)
step() { [[ ",$STEPS," == *",$1,"* ]]; }
pack() { tar -C "$W" -czf "$OUT/$1.tgz" "$1" && echo "$1: rc=$2 at $(( $(date +%s) - t0 )) s"; }
# a step of bench --ab runs: plots and the runs' JSON left out, packed, its A/B tables' rows printed
pack_ab() {
  find "$W/$1" -name "*.png" -delete; find "$W/$1" -path "*ab_runs*" -name "*.json" -delete
  pack "$1" "$2"; grep -h "^| [a-z_0-9]* | [0-9]" "$W/$1"/*/ab.md
}
BENCH=(python3 -m latency_specialized.cli bench --tp 8 --context 4096 --layers 3)
# a step's layer A/B at batch 1 / 8 and one replay's kernels at batch 1 with one setting on:
#   ab_timeline STEP MODEL KIND BENCH_LIMIT_S SETTING --ab ... (the bench's variants)
ab_timeline() {
  local s=$1 model=$2 kind=$3 limit=$4 setting=$5 rc=0
  shift 5
  mkdir -p "$W/$s"
  timeout "$limit" "${BENCH[@]}" --model "$model" --kinds "$kind" --batch 1,8 --out "$W/$s/$model" "$@" \
    > "$W/$s/$model.log" 2>&1 || rc=$?
  timeout "${PROF_S:-70}" python3 benchmarks/scripts/profile_layer.py --model "$model" --kind "$kind" --batches 1 \
    --layers 2 --timeline --out "$W/$s/p_${kind}_$s.json" --set "$setting" > "$W/$s/p_${kind}_$s.txt" 2>&1 || rc=$?
  find "$W/$s" -name "*.png" -delete; find "$W/$s" -path "*ab_runs*" -name "*.json" -delete
  rm -f "$W/$s"/*.trace.json; pack "$s" "$rc"; grep -h "^| [a-z_0-9]* | [0-9]" "$W/$s"/*/ab.md
  grep -h "^=== " "$W/$s"/*.txt
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
if step gqa; then
  mkdir -p "$W/gqa"
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "${GQA_S:-110}" python3 benchmarks/scripts/gqa_sweep.py \
    "$W/gqa/fused.json" fused > "$W/gqa/gqa.log" 2>&1
  pack gqa $?; python3 -c "
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r['FUSED_MERGE_MAX_SPLITS'], r['FUSED_MERGE_UNROLL'], r['batch'], r['context'], r['window'], r['splits'],
          round(r['us'], 2), round(r['roofline'], 3))" "$W/gqa/fused.json" 2>/dev/null
fi
if step dsvk; then
  mkdir -p "$W/dsvk"
  SP=latency_specialized.kernels
  rc=0
  timeout "${DSVK_S:-300}" "${BENCH[@]}" --model deepseek_v41_flash --kinds c2_idx --batch 1,8 --out "$W/dsvk/dsv" \
    --ab base --ab fkey:$SP.sparse_mqa_triton.COMPRESS_INDEX_KEY=True --ab fsel:$SP.indexer_triton.SCORE_SELECTS=True \
    --ab credit:$SP.tuning.NORM_SITE_CREDIT_US=1.5 --ab "all:$SP.sparse_mqa_triton.COMPRESS_INDEX_KEY=True,\
$SP.indexer_triton.SCORE_SELECTS=True,$SP.tuning.NORM_SITE_CREDIT_US=1.5" --ab "all5:$SP.sparse_mqa_triton.\
COMPRESS_INDEX_KEY=True,$SP.indexer_triton.SCORE_SELECTS=True,$SP.tuning.NORM_SITE_CREDIT_US=1.5,\
$SP.indexer_triton.SELECT_FINE_WIDTHS=True,$SP.indexer_triton.SCORE_KEYS_AHEAD=True" > "$W/dsvk/dsv.log" 2>&1 || rc=$?
  timeout "${DSVK_GLM_S:-150}" "${BENCH[@]}" --model glm53 --kinds moe --batch 1,8 --out "$W/dsvk/glm" --ab base \
    --ab fsel:$SP.indexer_triton.SCORE_SELECTS=True --ab wkey:$SP.indexer_triton.SCORE_WRITES_KEY=True \
    --ab "one:$SP.indexer_triton.SCORE_SELECTS=True,$SP.indexer_triton.SCORE_WRITES_KEY=True" \
    > "$W/dsvk/glm.log" 2>&1 || rc=$?
  find "$W/dsvk" -name "*.png" -delete; pack dsvk "$rc"   # the runs' tables (ab_runs) hold the kernel counts
  grep -h "^| [a-z_0-9]* | [0-9]" "$W"/dsvk/*/ab.md; grep -rh "^| [a-z_0-9]* | 1 |" "$W"/dsvk/*/ab_runs | cut -d'|' -f2-7
fi
if step slots; then
  mkdir -p "$W/slots"; rc=0
  for f in False True; do
    timeout "${PROF_S:-70}" python3 benchmarks/scripts/profile_layer.py --model deepseek_v41_flash --kind c2_idx \
      --batches 1,8 --layers 2 --timeline --out "$W/slots/p_c2_idx_slots_$f.json" \
      --set latency_specialized.kernels.step_slots_triton.STEP_SLOTS_KERNEL=$f > "$W/slots/p_c2_idx_slots_$f.txt" 2>&1 \
      || rc=$?
  done
  rm -f "$W"/slots/*.trace.json; pack slots "$rc"; grep -h "^=== " "$W"/slots/*.txt
fi
if step pick52; then
  # session 52's plan: the GPU tests of session 51's four switches, then the layer A/Bs that decide them - the
  # compressor beside the query (DeepSeek-V4.1-Flash c2_idx), the indexer beside the sparse MLA's prologue (GLM-5.3
  # moe), the select from the leading-byte counts with packed scans (both models) - picked by ab_pick.py's rule into
  # /tmp/ls_picks.txt (and $OUT/picks.txt) for the suite calls after; none picked where a test failed. Then one
  # replay's kernels of each model with all of them on.
  mkdir -p "$W/pick52"; rc=0; : > /tmp/ls_picks.txt
  SP=latency_specialized.kernels.indexer_triton PQ=latency_specialized.pieces.attention.sparse_mqa
  PL=latency_specialized.pieces.attention.sparse_mla
  both="$SP.SELECT_FIRST_BYTE=True,$SP.SELECT_PACKED_SCAN=True"
  light=${PICK_LIGHT:+" "}   # PICK_LIGHT=1: no side + both variants (the select's switches judged on GLM-5.3 alone)
  trc=skipped   # PICK_TESTS=0: no tests first (the rest part of the suite holds them), the picks taken as measured
  if [ "${PICK_TESTS:-1}" = 1 ]; then
    PYTHONPATH=$PWD:$PWD/tests/ops${PYTHONPATH:+:$PYTHONPATH} timeout "${TESTS_S:-110}" python3 -m pytest -m gpu \
      -n 4 -q -rfE -p no:cacheprovider tests/models/test_indexer_switches_gpu.py \
      tests/ops/test_indexer_triton_gpu.py::test_select_from_the_leading_byte_counts_and_packed_scans \
      tests/ops/test_sparse_mla_triton_gpu.py::test_selection_from_a_side_stream --junitxml="$W/pick52/junit.xml" \
      > "$W/pick52/tests.log" 2>&1; trc=$?
    echo "switch tests rc=$trc: $(tail -1 "$W/pick52/tests.log")"
  fi
  timeout "${DSV_S:-230}" "${BENCH[@]}" --model deepseek_v41_flash --kinds c2_idx --batch 1,8 --out "$W/pick52/dsv" \
    --ab base --ab side:$PQ.COMPRESS_BESIDE_QUERY=True ${light:---ab "sideboth:$PQ.COMPRESS_BESIDE_QUERY=True,$both"} \
    --ab loop:$SP.SELECT_RESIDENT_MAX=0 > "$W/pick52/dsv.log" 2>&1 || rc=$?
  timeout "${GLM_S:-230}" "${BENCH[@]}" --model glm53 --kinds moe --batch 1,8 --out "$W/pick52/glm" \
    --ab base --ab side:$PL.INDEXER_BESIDE_ATTENTION=True --ab "both:$both" --ab loop:$SP.SELECT_RESIDENT_MAX=0 \
    ${light:---ab "sideboth:$PL.INDEXER_BESIDE_ATTENTION=True,$both"} > "$W/pick52/glm.log" 2>&1 || rc=$?
  if [ "$trc" = 0 ] || [ "$trc" = skipped ]; then
    pk=(python3 benchmarks/scripts/ab_pick.py pick)
    "${pk[@]}" side --faster "$W/pick52/dsv/ab.md" >> /tmp/ls_picks.txt
    "${pk[@]}" side --faster "$W/pick52/glm/ab.md" >> /tmp/ls_picks.txt
    "${pk[@]}" both --faster "$W/pick52/glm/ab.md" ${light:---not-slower "$W/pick52/dsv/ab.md:sideboth:side"} \
      >> /tmp/ls_picks.txt
    "${pk[@]}" loop --faster "$W/pick52/glm/ab.md" --not-slower "$W/pick52/dsv/ab.md" >> /tmp/ls_picks.txt
  fi
  cp /tmp/ls_picks.txt "$OUT/picks.txt"; echo "picks: $(tr '\n' ' ' < /tmp/ls_picks.txt)"
  pack_ab pick52 "$rc"   # kept if the timelines run past the call
  mkdir -p "$W/pick52prof"
  [ "${PICK_PROF:-1}" = 1 ] && for m in "deepseek_v41_flash:c2_idx:$PQ.COMPRESS_BESIDE_QUERY=True,$both" \
      "glm53:moe:$PL.INDEXER_BESIDE_ATTENTION=True,$both"; do
    IFS=: read -r model kind settings <<< "$m"
    timeout "${PROF_S:-55}" python3 benchmarks/scripts/profile_layer.py --model "$model" --kind "$kind" --batches 1 \
      --layers 2 --timeline --out "$W/pick52prof/p_${kind}_all.json" --set "$settings" \
      > "$W/pick52prof/p_${kind}_all.txt" 2>&1 || rc=$?
  done
  rm -f "$W"/pick52prof/*.trace.json; pack pick52prof "$rc"; grep -h "^=== " "$W"/pick52prof/*.txt
fi
if step icache; then
  # session 52: GLM-5.3's select after a kernel of big straight-line code on every SM (cold instruction cache) against
  # after a small-code one, per variant (its code 59-169 KB at this shape)
  mkdir -p "$W/icache"
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "${ICACHE_S:-90}" \
    python3 benchmarks/scripts/select_icache_probe.py --out "$W/icache/icache.json" > "$W/icache/icache.log" 2>&1
  pack icache $?; tail -5 "$W/icache/icache.log"
fi
if step pick54; then
  # session 54: GLM-5.3's rows past the select's half-width path looped over 2,048-wide tiles (SELECT_WIDE_LOOPS, new;
  # the launch's 16 warps, or 8: wide8) against every row looped (SELECT_RESIDENT_MAX=0, -7.0 us on GLM-5.3 and +2.3
  # on DeepSeek in session 53, on the old select); the q_a norm before the q_b GEMV (ops.plan.NORM_PROLOGUES=False,
  # sep: the GEMV with the norm prologue took ~3 us over o_proj's in session 53's GLM-5.3 timeline). The switch's GPU
  # tests first; the winners picked by ab_pick.py into /tmp/ls_picks.txt (none where a test failed) for the suite
  # calls after, then one replay's kernels of GLM-5.3 moe with the picks.
  mkdir -p "$W/pick54"; rc=0; : > /tmp/ls_picks.txt
  SP=latency_specialized.kernels.indexer_triton NP=latency_specialized.ops.plan.NORM_PROLOGUES
  wide="$SP.SELECT_WIDE_LOOPS=True" wide8="$SP.SELECT_WIDE_LOOPS=True,$SP.SELECT_WARPS_WIDE=8"
  light=${PICK_LIGHT:+" "}   # PICK_LIGHT=1: only the variants that can be picked (no loop, k17, k16)
  trc=skipped
  if [ "${PICK_TESTS:-1}" = 1 ]; then
    PYTHONPATH=$PWD:$PWD/tests/ops${PYTHONPATH:+:$PYTHONPATH} timeout "${TESTS_S:-140}" python3 -m pytest -m gpu \
      -n 4 -q -rfE -p no:cacheprovider tests/ops/test_indexer_triton_gpu.py::test_radix_wide_loops \
      tests/models/test_indexer_switches_gpu.py::test_cells_with_the_wide_rows_looped \
      tests/ops/test_mlp_one_launch_gpu.py --junitxml="$W/pick54/junit.xml" > "$W/pick54/tests.log" 2>&1; trc=$?
    echo "switch tests rc=$trc: $(tail -1 "$W/pick54/tests.log")"
  fi
  # one (session 55; on by default since, so now the same as base): the shared expert's MLP in one launch (one
  # kernel fewer a layer; meant to cost nothing there) - timed for the record, not picked
  one="latency_specialized.kernels.mlp_one_launch_triton.ENABLED=True"
  timeout "${GLM_S:-230}" "${BENCH[@]}" --model glm53 --kinds moe --batch 1,8 --out "$W/pick54/glm" --ab base \
    --ab "wide:$wide" --ab "wide8:$wide8" ${light:---ab loop:$SP.SELECT_RESIDENT_MAX=0} --ab sep:$NP=False \
    --ab "one:$one" > "$W/pick54/glm.log" 2>&1 || rc=$?
  # k17 / k16: session 50's kernel-count switches on top of the session-53 defaults (the compressor, now beside the
  # query, writing the indexer's key; the q norm in the q_b GEMV; k16 also the select inside the score kernel) -
  # issue 21's <= 15 kernels at batch 1 against its 1.5x; timed for the record, not picked here
  KP=latency_specialized.kernels k17="$KP.sparse_mqa_triton.COMPRESS_INDEX_KEY=True,$KP.tuning.NORM_SITE_CREDIT_US=1.5"
  # k15: k16 + the shared expert in one launch (issue 21's 15 kernels), always run
  timeout "${DSV_S:-250}" "${BENCH[@]}" --model deepseek_v41_flash --kinds c2_idx --batch 1,8 --out "$W/pick54/dsv" \
    --ab base --ab "wide:$wide" --ab "wide8:$wide8" ${light:---ab "k17:$k17" --ab "k16:$k17,$SP.SCORE_SELECTS=True"} \
    --ab "k15:$k17,$SP.SCORE_SELECTS=True,$one" > "$W/pick54/dsv.log" 2>&1 || rc=$?
  # the other layers whose q_b GEMV normalises its input (explain: "normalises its input itself"), for sep's pick
  timeout "${KIMI_S:-110}" "${BENCH[@]}" --model kimi_k3 --kinds mla --batch 1,8 --out "$W/pick54/kimi" --ab base \
    --ab sep:$NP=False > "$W/pick54/kimi.log" 2>&1 || rc=$?
  timeout "${WIN_S:-110}" "${BENCH[@]}" --model deepseek_v41_flash --kinds window --batch 1,8 --out "$W/pick54/win" \
    --ab base --ab sep:$NP=False > "$W/pick54/win.log" 2>&1 || rc=$?
  if [ "$trc" = 0 ] || [ "$trc" = skipped ]; then
    pk=(python3 benchmarks/scripts/ab_pick.py pick)
    "${pk[@]}" wide,wide8 --faster "$W/pick54/glm/ab.md" --not-slower "$W/pick54/dsv/ab.md" >> /tmp/ls_picks.txt
  fi   # (sep touches no kernel: picked whatever the select's tests say)
  python3 benchmarks/scripts/ab_pick.py pick sep --faster "$W/pick54/glm/ab.md" --not-slower "$W/pick54/kimi/ab.md" \
    --not-slower "$W/pick54/win/ab.md" >> /tmp/ls_picks.txt
  cp /tmp/ls_picks.txt "$OUT/picks.txt"; echo "picks: $(tr '\n' ' ' < /tmp/ls_picks.txt)"
  pack_ab pick54 "$rc"
  if [ "${PICK_PROF:-1}" = 1 ] && [ -s /tmp/ls_picks.txt ]; then
    mkdir -p "$W/pick54prof"
    timeout "${PROF_S:-55}" python3 benchmarks/scripts/profile_layer.py --model glm53 --kind moe --batches 1 \
      --layers 2 --timeline --out "$W/pick54prof/p_moe_picked.json" --set "$(paste -sd, /tmp/ls_picks.txt)" \
      > "$W/pick54prof/p_moe_picked.txt" 2>&1 || rc=$?
    rm -f "$W"/pick54prof/*.trace.json; pack pick54prof "$rc"; grep -h "^=== " "$W"/pick54prof/*.txt
  fi
fi
if step dsv15; then
  # session 55: DeepSeek-V4.1-Flash c2_idx ran 15 kernels at batch 1 with session 50's three switches on the
  # session-53 defaults + the one-launch shared MLP (now a default) in 122.4 us, 1.0 us short of 1.5x (121.4): which
  # of the three costs the 6.8 us - the compressor writing the key (fkey, now on the side stream), + the select in
  # the score kernel (fsel: 16 kernels), + the q norm in the q_b GEMV's prologue (cred: 16; the GEMV then replaces
  # the small-M kernel of N 8,192), all three (k15) - and one replay's kernels with all three
  KP=latency_specialized.kernels
  fkey="$KP.sparse_mqa_triton.COMPRESS_INDEX_KEY=True" fsel="$KP.indexer_triton.SCORE_SELECTS=True"
  cred="$KP.tuning.NORM_SITE_CREDIT_US=1.5"
  # k15nsm: k15 with the credit's GEMV normalising once per CTA (gemm_gemv.NORM_SMEM, step normsm)
  nsm="$KP.gemm_gemv.NORM_SMEM=True"
  ab_timeline dsv15 deepseek_v41_flash c2_idx "${DSV15_S:-300}" "$fkey,$fsel,$cred,$nsm" --ab base --ab "fkey:$fkey" \
    --ab "fsel:$fkey,$fsel" --ab "cred:$fkey,$cred" --ab "k15:$fkey,$fsel,$cred" --ab "k15nsm:$fkey,$fsel,$cred,$nsm"
fi
if step normsm; then
  # session 55: the q_b GEMV's norm prologue once per CTA in shared memory (gemm_gemv.NORM_SMEM, new) against the
  # per-warp prologue (base) and the norm launched before the GEMV (sep) - GLM-5.3 moe, DeepSeek window, and
  # DeepSeek c2_idx with the norm-site credit (whose GEMV takes the prologue at N 8,192) with and without it
  mkdir -p "$W/normsm"; rc=0; NP=latency_specialized.ops.plan.NORM_PROLOGUES
  nsm="latency_specialized.kernels.gemm_gemv.NORM_SMEM=True"
  cred="latency_specialized.kernels.tuning.NORM_SITE_CREDIT_US=1.5"
  timeout "${GLM_S:-150}" "${BENCH[@]}" --model glm53 --kinds moe --batch 1,8 --out "$W/normsm/glm" --ab base \
    --ab "nsm:$nsm" --ab sep:$NP=False > "$W/normsm/glm.log" 2>&1 || rc=$?
  timeout "${DSV_S:-200}" "${BENCH[@]}" --model deepseek_v41_flash --kinds window,c2_idx --batch 1,8 \
    --out "$W/normsm/dsv" --ab base --ab "nsm:$nsm" --ab "cred:$cred" --ab "nsmcred:$nsm,$cred" \
    > "$W/normsm/dsv.log" 2>&1 || rc=$?
  pack_ab normsm "$rc"
fi
if step normk; then
  # session 55: the q_a norm launched before the q_b GEMV (ops.plan.NORM_PROLOGUES=False) took 2.1 us off GLM-5.3's
  # moe layer at batch 1 and cost DeepSeek's window layer 0.7; Kimi K3's mla layer (its q_b GEMV normalises its input
  # too) did not finish in pick54's 110 s - here with the time its 3-layer program takes to build
  mkdir -p "$W/normk"; rc=0; NP=latency_specialized.ops.plan.NORM_PROLOGUES
  timeout "${KIMI_S:-220}" "${BENCH[@]}" --model kimi_k3 --kinds mla --batch 1,8 --out "$W/normk/kimi" --ab base \
    --ab sep:$NP=False > "$W/normk/kimi.log" 2>&1 || rc=$?
  pack_ab normk "$rc"
fi
if step glmloop; then
  # session 53's defaults (leading-byte counts + packed scans, the indexer beside the attention): the looped rows took
  # 7.0 us off GLM-5.3's moe layer at batch 1 on the old select (session 53); do they on top of the new one, and the
  # finer widths (faster alone, slower in the layer in session 50)
  mkdir -p "$W/glmloop"; rc=0
  SP=latency_specialized.kernels.indexer_triton
  timeout "${GLMLOOP_S:-170}" "${BENCH[@]}" --model glm53 --kinds moe --batch 1,8 --out "$W/glmloop/glm" --ab base \
    --ab loop:$SP.SELECT_RESIDENT_MAX=0 --ab "fine:$SP.SELECT_FINE_WIDTHS=True" \
    > "$W/glmloop/glm.log" 2>&1 || rc=$?
  pack_ab glmloop "$rc"
fi
if step normab; then
  # session 53: the q_b GEMV that normalises its own input took ~3 us more than the o_proj GEMV of its shape in
  # GLM-5.3's layer; the norm site run before it instead (ops.plan.NORM_PROLOGUES=False), GLM-5.3 and Kimi K3
  mkdir -p "$W/normab"; rc=0
  for mk in glm53:moe kimi_k3:mla; do
    timeout "${NORMAB_S:-150}" "${BENCH[@]}" --model "${mk%%:*}" --kinds "${mk#*:}" --batch 1,8 \
      --out "$W/normab/${mk%%:*}" --ab base --ab sep:latency_specialized.ops.plan.NORM_PROLOGUES=False \
      > "$W/normab/${mk%%:*}.log" 2>&1 || rc=$?
  done
  pack_ab normab "$rc"
fi
if step selglm; then
  # session 51: GLM-5.3's select takes 28 us a call in its layer and 19.7 alone on the layer's own logits and arguments
  # (benchmarks/results/h100/session51/README.md); the knobs that change it alone, timed where it is slow
  mkdir -p "$W/selglm"; rc=0
  SP=latency_specialized.kernels.indexer_triton
  for v in base:"" w8:$SP.SELECT_WARPS_WIDE=8 fine:$SP.SELECT_FINE_WIDTHS=True b8:$SP.SELECT_BITS=8 \
      bytes:$SP.SELECT_FIRST_BYTE=True bytesfine:$SP.SELECT_FIRST_BYTE=True,$SP.SELECT_FINE_WIDTHS=True \
      packed:$SP.SELECT_PACKED_SCAN=True both:$SP.SELECT_FIRST_BYTE=True,$SP.SELECT_PACKED_SCAN=True; do
    name=${v%%:*} settings=${v#*:}
    timeout "${PROF_S:-70}" python3 benchmarks/scripts/profile_layer.py --model glm53 --kind moe --batches 1,8 \
      --layers 2 --timeline --out "$W/selglm/p_glm_moe_$name.json" ${settings:+--set "$settings"} \
      > "$W/selglm/p_glm_moe_$name.txt" 2>&1 || rc=$?
  done
  for nl in 8192:4097 4096:2049; do   # the select alone: packed scans against two
    timeout "${TOPK_S:-40}" python3 benchmarks/scripts/topk_bench.py --kind relu --rows 1,8 --lengths "${nl%%:*}" \
      --live "${nl##*:}" --ks 512,2048 --variants radix_coarse,radix_packed,radix_fine,radix_fine_packed \
      --out "$W/selglm/topk_${nl/:/_}.json" >> "$W/selglm/topk.log" 2>&1 || rc=$?
  done
  rm -f "$W"/selglm/*.trace.json; pack selglm "$rc"; grep -h "^| " "$W"/selglm/topk_*.md | head -12
  for f in "$W"/selglm/*.txt; do echo "$(basename "$f"): $(grep -h "^=== " "$f" | cut -c1-90 | tr '\n' ' ')"; \
    grep -h "select_kernel$" "$f" | head -2; done
fi
if step selab; then
  # session 51's plan: the select's switches in the layers, 2 runs a variant (after selglm says which kernel moved)
  mkdir -p "$W/selab"; rc=0
  SP=latency_specialized.kernels.indexer_triton
  for m in glm53:moe deepseek_v41_flash:c2_idx; do
    timeout "${SELAB_S:-170}" "${BENCH[@]}" --model "${m%%:*}" --kinds "${m##*:}" --batch 1,8 \
      --out "$W/selab/${m%%:*}" --ab base --ab bytes:$SP.SELECT_FIRST_BYTE=True \
      --ab "bfine:$SP.SELECT_FIRST_BYTE=True,$SP.SELECT_FINE_WIDTHS=True" --ab w8:$SP.SELECT_WARPS_WIDE=8 \
      --ab "both:$SP.SELECT_FIRST_BYTE=True,$SP.SELECT_PACKED_SCAN=True" \
      > "$W/selab/${m%%:*}.log" 2>&1 || rc=$?
  done
  pack_ab selab "$rc"
fi
if step cbeside; then
  # session 51's plan: DeepSeek-V4.1-Flash's compressor on the side stream beside the q norm and q_b gemm (c2_idx: every
  # layer a KV source with its indexer), alone / with the compressor writing the key / with the fine widths; a timeline
  PP=latency_specialized.pieces.attention.sparse_mqa SP=latency_specialized.kernels
  ab_timeline cbeside deepseek_v41_flash c2_idx "${CBESIDE_S:-170}" $PP.COMPRESS_BESIDE_QUERY=True --ab base \
    --ab side:$PP.COMPRESS_BESIDE_QUERY=True \
    --ab "sidekey:$PP.COMPRESS_BESIDE_QUERY=True,$SP.sparse_mqa_triton.COMPRESS_INDEX_KEY=True" \
    --ab "sidefine:$PP.COMPRESS_BESIDE_QUERY=True,$SP.indexer_triton.SELECT_FINE_WIDTHS=True"
fi
if step beside; then
  # session 51's plan: GLM-5.3's indexer on the side stream beside the sparse MLA's prologue, with and without the
  # select's switches; then one replay's kernels with it (the two branches overlapping)
  SP=latency_specialized.kernels.indexer_triton PP=latency_specialized.pieces.attention.sparse_mla
  ab_timeline beside glm53 moe "${BESIDE_S:-150}" $PP.INDEXER_BESIDE_ATTENTION=True --ab base \
    --ab side:$PP.INDEXER_BESIDE_ATTENTION=True \
    --ab "sideboth:$PP.INDEXER_BESIDE_ATTENTION=True,$SP.SELECT_FIRST_BYTE=True,$SP.SELECT_PACKED_SCAN=True"
fi
if step fine2; then
  mkdir -p "$W/fine2"; rc=0
  SP=latency_specialized.kernels
  for m in deepseek_v41_flash:c2_idx glm53:moe; do
    timeout "${FINE2_S:-170}" "${BENCH[@]}" --model "${m%%:*}" --kinds "${m##*:}" --batch 1,8 --repeat 3 \
      --out "$W/fine2/${m%%:*}" --ab base --ab fine:$SP.indexer_triton.SELECT_FINE_WIDTHS=True \
      --ab "credit:$SP.indexer_triton.SELECT_FINE_WIDTHS=True,$SP.tuning.NORM_SITE_CREDIT_US=1.5" \
      > "$W/fine2/${m%%:*}.log" 2>&1 || rc=$?
  done
  for f in False True; do
    timeout "${PROF_S:-70}" python3 benchmarks/scripts/profile_layer.py --model glm53 --kind moe --batches 1 \
      --layers 2 --timeline --out "$W/fine2/p_glm_moe_fine_$f.json" --set $SP.indexer_triton.SELECT_FINE_WIDTHS=$f \
      > "$W/fine2/p_glm_moe_fine_$f.txt" 2>&1 || rc=$?
  done
  pack_ab fine2 "$rc"; grep -h "select_kernel\|score_kernel" \
    "$W"/fine2/p_glm_moe_fine_*.txt | head -12
fi
if step fine; then
  mkdir -p "$W/fine"; rc=0
  SP=latency_specialized.kernels
  for nl in 8192:2080 8192:3072 8192:4097 8192:6144 4096:1040; do
    timeout "${TOPK_S:-40}" python3 benchmarks/scripts/topk_bench.py --kind relu --rows 1,8 --lengths "${nl%%:*}" \
      --live "${nl##*:}" --ks 512,2048 --variants radix_coarse,radix_fine --out "$W/fine/topk_${nl/:/_}.json" \
      >> "$W/fine/topk.log" 2>&1 || rc=$?
  done
  for m in deepseek_v41_flash:c2_idx glm53:moe; do
    timeout "${FINE_S:-150}" "${BENCH[@]}" --model "${m%%:*}" --kinds "${m##*:}" --batch 1,8 --out "$W/fine/${m%%:*}" \
      --ab base --ab fine:$SP.indexer_triton.SELECT_FINE_WIDTHS=True \
      --ab ahead:$SP.indexer_triton.SCORE_KEYS_AHEAD=True \
      --ab "both:$SP.indexer_triton.SELECT_FINE_WIDTHS=True,$SP.indexer_triton.SCORE_KEYS_AHEAD=True" \
      > "$W/fine/${m%%:*}.log" 2>&1 || rc=$?
  done
  rm -rf "$W"/fine/*/ab_runs; pack fine "$rc"; grep -h "^| [a-z_0-9]* | [0-9]" "$W"/fine/*/ab.md "$W"/fine/*.md
fi
if step c2ab; then
  mkdir -p "$W/c2ab"
  SP=latency_specialized.kernels
  timeout "${C2AB_S:-240}" "${BENCH[@]}" --model deepseek_v41_flash --kinds c2_idx --batch 1,8 --out "$W/c2ab" \
    --ab base --ab "selpdl:$SP.sparse_mqa_triton.SELECTION_PDL=True,$SP.indexer_triton.SELECT_TRIGGER_START=True" \
    --ab mc64:$SP.indexer_triton.MIN_CHUNK=64 --ab early:$SP.indexer_triton.SELECT_EARLY_EXIT=True \
    --ab "all3:$SP.sparse_mqa_triton.SELECTION_PDL=True,$SP.indexer_triton.SELECT_TRIGGER_START=True,\
$SP.indexer_triton.MIN_CHUNK=64,$SP.indexer_triton.SELECT_EARLY_EXIT=True" > "$W/c2ab/c2ab.log" 2>&1
  rc=$?; rm -rf "$W"/c2ab/ab_runs; pack c2ab "$rc"; grep -h "^| [a-z_0-9]* | [0-9]" "$W"/c2ab/ab.md
fi
if step cutprof; then
  mkdir -p "$W/cutprof"
  timeout "${PROF_S:-70}" python3 benchmarks/scripts/profile_layer.py --model deepseek_v41_flash --kind c2_idx \
    --batches 1 --layers 2 --timeline --out "$W/cutprof/p_c2_idx_cut.json" \
    --set latency_specialized.pieces.attention.sparse_mqa.INDEX_COMPRESSED_TABLE=True \
    > "$W/cutprof/p_c2_idx_cut.txt" 2>&1
  pack cutprof $?; grep -h -A12 "^=== " "$W"/cutprof/*.txt | head -14
fi
if step prof; then
  mkdir -p "$W/prof"
  for k in window c2_idx; do
    timeout "${PROF_S:-70}" python3 benchmarks/scripts/profile_layer.py --model deepseek_v41_flash --kind "$k" \
      --batches 1 --layers 2 --timeline --out "$W/prof/p_$k.json" > "$W/prof/p_$k.txt" 2>&1; echo "prof $k rc=$?"
  done
  pack prof 0; grep -h -A3 "^=== " "$W"/prof/*.txt | head -12
fi
if step gemm; then
  mkdir -p "$W/gemm"; cp latency_specialized/kernels/tuning/h200_gemm.json "$W/gemm/table.json"
  timeout "${GEMM_S:-150}" python3 -m latency_specialized.cli bench-ops --ops gemm --model deepseek_v41_flash --tp 8 \
    --m 1,8 --shapes 1792:5120,2848:5120,4096:1280,8192:1280,5120:1024 --out "$W/gemm" \
    --write-table "$W/gemm/table.json" --merge-table > "$W/gemm/gemm.log" 2>&1
  pack gemm $?; grep -h "^| " "$W"/gemm/*.md | head -24
fi
if step dsvab; then
  mkdir -p "$W/dsvab/c2" "$W/dsvab/window"; rc=0
  timeout "${DSVAB_S:-120}" "${BENCH[@]}" --model deepseek_v41_flash --kinds c2_idx --batch 1,8 --out "$W/dsvab/c2" \
    --ab base --ab cut:latency_specialized.pieces.attention.sparse_mqa.INDEX_COMPRESSED_TABLE=True \
    > "$W/dsvab/c2.log" 2>&1 || rc=$?
  timeout "${DSVAB_S:-120}" "${BENCH[@]}" --model deepseek_v41_flash --kinds window --batch 1,8 \
    --out "$W/dsvab/window" --ab base --ab kernel:latency_specialized.runtime.harness.SUM_ONLY_KERNEL=True \
    > "$W/dsvab/window.log" 2>&1 || rc=$?
  rm -rf "$W"/dsvab/*/ab_runs; pack dsvab "$rc"; grep -h "^| [a-z_0-9]* | [0-9]" "$W"/dsvab/*/ab.md
fi
if step topk; then
  mkdir -p "$W/topk"; rc=0
  for nl in 4096:2048 8192:4096 8192:2048; do
    timeout "${TOPK_S:-40}" python3 benchmarks/scripts/topk_bench.py --kind relu --rows 1,8 --lengths "${nl%%:*}" \
      --live "${nl##*:}" --ks 512,2048 --variants radix_late,radix_early,radix4_loop_early \
      --out "$W/topk/topk_${nl/:/_}.json" \
      >> "$W/topk/topk.log" 2>&1 || rc=$?
  done
  pack topk "$rc"; grep -h "^| " "$W"/topk/*.md | head -16
fi
if step muse; then
  mkdir -p "$W/muse"
  timeout "${MUSE_S:-100}" "${BENCH[@]}" --model muse_spark --kinds swa --batch 1,8 --out "$W/muse" \
    --ab base --ab kernel:latency_specialized.runtime.harness.SUM_ONLY_KERNEL=True > "$W/muse/muse.log" 2>&1
  rc=$?; rm -rf "$W"/muse/ab_runs; pack muse "$rc"; grep -h "^| [a-z_]* | [0-9]" "$W"/muse/ab.md
fi
if step paired; then
  mkdir -p "$W/paired"
  timeout "${PAIRED_S:-240}" "${BENCH[@]}" --model kimi_k3 --experts mxfp4 --kinds kda,mla --batch 64 \
    --out "$W/paired" --ab paired --ab checkpoint:latency_specialized.pieces.ffn.latent_moe.PAIR_EXPERT_CODES=False \
    > "$W/paired/paired.log" 2>&1; rc=$?
  rm -rf "$W"/paired/ab_runs; pack paired "$rc"; grep -h "^| [a-z_]* | [0-9]" "$W"/paired/ab.md
fi
if step credit; then
  mkdir -p "$W/credit"; rc=0
  CR=(--batch 1,8 --ab base --ab credit:latency_specialized.kernels.tuning.NORM_SITE_CREDIT_US=1.5)
  credit() {
    timeout "${CREDIT_S:-80}" "${BENCH[@]}" --model "$1" --kinds "$2" --out "$W/credit/$1" "${CR[@]}" \
      >> "$W/credit/credit.log" 2>&1 || rc=$?
  }
  credit kimi_k3 kda,mla
  rm -rf "$W"/credit/*/ab_runs; pack credit "$rc"; grep -h "^| [a-z_]* | [0-9]" "$W"/credit/*/ab.md
fi
if step dsv; then
  mkdir -p "$W/dsv"
  timeout "${DSV_S:-100}" "${BENCH[@]}" --model deepseek_v41_flash --kinds window,c2_idx --batch 1,8 \
    --out "$W/dsv" > "$W/dsv/dsv.log" 2>&1
  pack dsv $?; grep -h "^| [a-z_0-9]* | [0-9]" "$W"/dsv/*.md | head -6
fi
if step q4; then
  OUT="$W" TESTS=0 NVFP4=0 QUICK=1 BATCH=1,8,64 MMA_VARIANTS=default,paired,paired_dn_a1 BENCH_S=${Q4_S:-120} \
    bash benchmarks/scripts/q4_experts_mma_probe.sh > "$W/q4mma.log" 2>&1; rc=$?
  mv "$W/q4mma.log" "$W/q4mma/"; pack q4mma "$rc"; grep -h "^| " "$W"/q4mma/*.md | cut -d'|' -f2-9 | head -20
fi
echo "done at $(( $(date +%s) - t0 )) s"
