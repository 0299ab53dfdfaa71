#!/usr/bin/env bash
# The whole `pytest -m gpu` suite on one H200, as pytest-xdist runs whose workers share the GPU: the
# cross-model matrix file with its cells spread over MATRIX_WORKERS (--dist load: it is the longest file by
# far), every other test over WORKERS with --dist loadgroup (REST_DIST): tests spread one by one except those
# tests/conftest.py groups (a module-scoped fixture's file, tests/comm's multi-process worlds) - session 33's
# `--dist loadfile` run hit 470 s behind one file (DeepSeek-V4.1's quantized generate tests: 342 s of the 1,310 s
# of test time in session 32's junit). Together they are every test `pytest -m gpu` collects. Logs + junit files
# under $OUT, counts at the end.
#   on the device, after `bash .device/cute-a/stash.sh` on the same machine (carry .device/cute-b and .whl:
#   the .whl folder must hold pytest-xdist and execnet):
#   source scripts/device_env.sh && bash benchmarks/scripts/h200_suite.sh
# PART: both (default: the two runs concurrently, one call), matrix or rest (one run per call: once the matrix
# holds the long-context cells the two no longer fit one 600 s call together, nor the matrix alone: session 23's
# matrix call ran 271 of its ~288 cells in 560 s on 5 workers; split it with MATRIX_K). SUITE_S (default 560 s,
# under the device's 600 s per call) bounds each run.
# At the limit the runs get SIGINT (then SIGKILL 25 s on): pytest stops as after Ctrl-C and still prints its summary
# (each failure's reason: session 37's rest run, killed outright, named 143 failures and errors but not why) and
# writes its junit file; --durations lists the slowest tests. Then the tests that failed by running out of GPU memory
# run again on fewer workers in what is left of the call (below), and gpu_suite_report.py summarises the per-test
# records (peak memory, seconds, compile seconds).
# Run it alone on the GPU: the matrix's memory ledger (testing/gpu_share.py) admits matrix cells only, and other GPU
# jobs beside it starve them (session 26: four Muse Spark 128K cells failed beside two long checks, passed alone).
set -o pipefail
OUT=${OUT:-/tmp/ls_out}
PART=${PART:-both}
mkdir -p "$OUT"
export LS_KERNEL_CACHE_DIR=${LS_KERNEL_CACHE_DIR:-/tmp/ls_kcache} CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1
export LS_ALLREDUCE_KERNEL_DIR=${LS_ALLREDUCE_KERNEL_DIR:-/tmp/ls_ar} HUMMING_CACHE_DIR=${HUMMING_CACHE_DIR:-/tmp/hcache}
# the workers' per-test records: outside $OUT (the device returns at most 8 files; the merged ones go there) and one
# directory per call, so a second call on the same machine (the long matrix after the short) does not merge the first's
export PYTHONPATH=$PWD:$PWD/tests/ops${PYTHONPATH:+:$PYTHONPATH} LS_GPU_PEAKS=${LS_GPU_PEAKS:-/tmp/ls_peaks/$PART-$$}
MATRIX=tests/models/test_matrix.py
t0=$(date +%s)
# Kernels an earlier suite run compiled (tests/compile_records.json.gz: Triton, CuTe DSL), compiled first on all
# cores but one into the caches the workers then hit (they would compile them one per worker; session 30 vs 32: a
# warm Triton cache took the rest part from 2,358 to 1,310 s of test time). Once per machine; PRECOMPILE_S bounds it.
RECORDS=${COMPILE_RECORDS:-tests/compile_records.json.gz}
# Triton's installation fingerprint: where it equals the CPU machine's (scripts/cpu_compile_env.sh prints that one;
# benchmarks/NOTES_gpu_suite.md), the CPU machine can fill the caches ahead of the session instead
python3 -c "from latency_specialized.testing.triton_specs import toolchain_fingerprint as f; print('toolchain:', f())"
# the CuTe DSL disk cache's directory: its last part fingerprints the kernel sources and the DSL / TVM-FFI versions
python3 -c "from latency_specialized.kernels.compile_cache import disk_dir; print('cute cache:', disk_dir())"
if [ -f "$RECORDS" ] && [ ! -f /tmp/ls_precompiled ]; then
  timeout -k 10 $(( ${PRECOMPILE_S:-150} + 20 )) python3 benchmarks/scripts/precompile.py "$RECORDS" \
    --jobs $(( $(nproc) - 1 )) --time-limit "${PRECOMPILE_S:-150}" 2>&1 | tail -16
  touch /tmp/ls_precompiled
fi
limit=$(( ${SUITE_S:-560} - ($(date +%s) - t0) ))   # the runs' limit: SUITE_S from the call's start
rm=skipped; ro=skipped
if [ "$PART" != rest ]; then
  # -v: one PASSED/FAILED line per cell as it ends, so a run the timeout kills still names its failures;
  # MATRIX_K (a -k expression, e.g. "ctx8 or ctx40" / "ctx32768 or ctx131072") splits the cells over calls
  # --maxschedchunk 1: one cell at a time per worker, so the long cells tests/conftest.py puts first spread over the
  # workers (xdist's default hands each worker a run of consecutive cells to start with)
  # MATRIX_WORKERS (default 4): each worker keeps a TP process pool per TP size (~0.9 GiB of CUDA context a rank),
  # so on an 80 GB card 4 suit the long cells; 6 the short ones (< 1 GiB each; session 39: 258 cells in 362 s)
  timeout -s INT -k 25 "$limit" python3 -m pytest -m gpu "$MATRIX" ${MATRIX_K:+-k "$MATRIX_K"} -n "${MATRIX_WORKERS:-4}" \
    --dist load --maxschedchunk 1 -v -rfE --durations=20 -p no:cacheprovider --junitxml="$OUT/junit_matrix.xml" > "$OUT/gpu_suite_matrix.log" 2>&1 &
  m=$!
fi
if [ "$PART" != matrix ]; then
  # -v here too: session 35's run hit the limit with 4 failures and an error the -q log could not name;
  # REST_PATHS (default: all of tests/) splits the rest over calls, e.g. "tests/ops" then "tests/models tests/comm ..."
  # WORKERS default: 8 on the H200's 139 GB, 6 on an 80 GB H100 - one per 13 GiB, at most 8. The H100 ran out of
  # memory with 12 workers in session 36 and with 6 in session 37 (143 tests, the MoE ones with Kimi K3's 896
  # experts); since then the heaviest tests wait for room in the memory ledger (tests/gpu_memory.json), the experts'
  # reference dequantises one expert at a time and the tests draw expert weights in chunks. Each test's peak memory
  # goes to $OUT/gpu_peaks_$PART.json (tests/conftest.py, merged below): the data for the ledger's figures
  WORKERS=${WORKERS:-$(python3 -c "import torch; print(max(2, min(8, torch.cuda.get_device_properties(0).total_memory \
    // (13 * 2 ** 30))))")}
  # shellcheck disable=SC2086
  timeout -s INT -k 25 "$limit" python3 -m pytest -m gpu ${REST_PATHS:-tests} --ignore="$MATRIX" -n "$WORKERS" \
    --dist "${REST_DIST:-loadgroup}" -v -rfE --durations=30 -p no:cacheprovider --junitxml="$OUT/junit.xml" \
    > "$OUT/gpu_suite.log" 2>&1 &
  o=$!
fi
if [ "$PART" != rest ]; then wait $m; rm=$?; fi
if [ "$PART" != matrix ]; then wait $o; ro=$?; fi
echo "suite ($PART): matrix rc=$rm, the rest rc=$ro, after $(( $(date +%s) - t0 )) s"
for f in "$OUT/gpu_suite_matrix.log" "$OUT/gpu_suite.log"; do
  [ -f "$f" ] || continue
  grep -hE "^(FAILED|ERROR)| FAILED | ERROR " "$f" | cut -c1-200 | sort -u | head -30
  echo "$(basename "$f"): $(tail -1 "$f") ($(grep -c " PASSED " "$f") PASSED lines)"
done
# one file of every worker's records (the device returns at most 8 files from $OUT): node id -> peak GiB, seconds,
# compile seconds (Triton / CuTe DSL); the summary says how much of the test time was compiling
if [ -d "$LS_GPU_PEAKS" ]; then
  python3 benchmarks/scripts/gpu_suite_report.py merge "$LS_GPU_PEAKS" "$OUT/gpu_peaks_${PART}.json"
  # the kernels the workers compiled (Triton, CuTe DSL): commit as tests/compile_records.json.gz (merged with the
  # other parts': gpu_suite_report.py records) so that the next machine compiles them up front (below)
  python3 benchmarks/scripts/gpu_suite_report.py records "$LS_GPU_PEAKS" "$OUT/compile_records_${PART}.json.gz"
fi
# Tests that failed or errored by running out of GPU memory (workers sharing the card; session 37: 143 on an H100)
# run again on RERUN_WORKERS (default 2) in what is left of CALL_S (default 590 s): their ids go to
# $OUT/oom_<part>.txt, the rerun's log and junit beside the first run's, so the report can say which passed alone.
CALL_S=${CALL_S:-590}
for run in matrix rest; do
  [ "$run" = matrix ] && junit="$OUT/junit_matrix.xml" || junit="$OUT/junit.xml"
  [ -f "$junit" ] || continue
  python3 benchmarks/scripts/gpu_suite_report.py oom "$junit" > "$OUT/oom_$run.txt"
  n=$(wc -l < "$OUT/oom_$run.txt")
  if [ "$n" = 0 ]; then rm -f "$OUT/oom_$run.txt"; continue; fi
  left=$(( CALL_S - ($(date +%s) - t0) - 5 ))
  echo "$run: $n tests failed by running out of GPU memory; rerun on ${RERUN_WORKERS:-2} workers, ${left} s left"
  if [ "$left" -lt 30 ]; then echo "  no time left: rerun them from $OUT/oom_$run.txt"; continue; fi
  mapfile -t ids < "$OUT/oom_$run.txt"
  LS_GPU_PEAKS='' timeout -s INT -k 10 "$left" python3 -m pytest -m gpu "${ids[@]}" -n "${RERUN_WORKERS:-2}" \
    --dist loadgroup -v -rfE -p no:cacheprovider --junitxml="$OUT/junit_${run}_rerun.xml" \
    > "$OUT/gpu_suite_${run}_rerun.log" 2>&1
  echo "  rerun: $(tail -1 "$OUT/gpu_suite_${run}_rerun.log")"
done
# the compile caches the runs filled (CuTe DSL objects, Triton's), for the record: later calls on this machine reuse
# them; the next session's machine gets them from the records instead (precompile above, or built on the CPU machine
# and carried: scripts/cpu_compile_env.sh, benchmarks/NOTES_gpu_suite.md)
du -sh "$LS_KERNEL_CACHE_DIR" "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" 2>/dev/null
