#!/usr/bin/env bash
# Compile the kernels the last GPU suite run recorded (tests/compile_records.json.gz) on this CPU machine, with the
# device's own Triton and CuTe DSL (scripts/cpu_compile_env.sh), and pack the caches into .device/compile_cache.tar.xz
# for the first device call (benchmarks/NOTES_gpu_suite.md). Session 39: the device's Triton fingerprint and CuTe DSL
# cache directory equal this machine's, so the suite's workers hit these caches instead of compiling (~900 s of the
# rest part's test time on the H100). Run it on the commit the suite will run: a kernel's source enters its key.
# Since session 47 the CuTe DSL fingerprint hashes only the DSL kernels' sources and what they import
# (`kernels.compile_cache.dsl_sources`): a Triton-only kernel edit after the build costs that kernel's Triton
# compiles on the device (seconds), not every CuTe DSL object (~900 s there).
#   bash scripts/prepare_device_caches.sh            # JOBS (default 2), LIMIT_S (default 3600), BUDGET_MIB (13)
# TRITON_DIR (default /tmp/ls_triton) keeps every older version of a changed kernel and the packer takes them all
# along: after kernel changes give a fresh one (session 46: TRITON_DIR=/tmp/ls_triton46, 544 s for 1,268 kernels,
# the rest archive 14.2 -> 4.2 MB).
# Records a kernel's new constexpr made stale are skipped (and fail tests/foundation/test_compile_records_fit.py):
# carry them over with benchmarks/scripts/migrate_records.py first (session 54), or they compile on the device.
# EXTRA_RECORDS: more record files, e.g. a bench-ops sweep's (`bench-ops ... --compile-records FILE`). The archive
# and .device/cute-a go together in one call under the 64 MiB transfer limit, the tree (~18 MB) included, so
# BUDGET_MIB bounds it; what it leaves out goes to .device/compile_cache_rest.tar.xz, unpacked the same way at the
# start of the second call (carried beside .device/cute-b and .whl: ~8 MB of room there).
# then the first device call, carrying [".device/cute-a", ".device/compile_cache.tar.xz"]:
#   bash .device/cute-a/stash.sh && python3 benchmarks/scripts/compile_cache_pack.py unpack \
#     .device/compile_cache.tar.xz --triton ~/.triton/cache --cute /tmp/ls_kcache
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TRITON_DIR=${TRITON_DIR:-/tmp/ls_triton} KCACHE=${KCACHE:-/tmp/ls_kcache}
bash scripts/cpu_compile_env.sh
# shellcheck disable=SC1091
source scripts/cpu_compile_env.sh --activate
t0=$(date +%s)
TRITON_CACHE_DIR=$TRITON_DIR LS_KERNEL_CACHE_DIR=$KCACHE "$PY312" benchmarks/scripts/precompile.py \
  tests/compile_records.json.gz ${EXTRA_RECORDS:-} --jobs "${JOBS:-2}" --time-limit "${LIMIT_S:-3600}"
fp=$(LS_KERNEL_CACHE_DIR=$KCACHE "$PY312" -c \
  "from latency_specialized.kernels.compile_cache import disk_dir; print(disk_dir())")
echo "compiled in $(( $(date +%s) - t0 )) s; CuTe DSL cache: $fp (the device prints its own as 'cute cache:')"
mkdir -p .device
"$PY312" benchmarks/scripts/compile_cache_pack.py pack .device/compile_cache.tar.xz --triton "$TRITON_DIR" \
  --cute "$fp" --budget-mib "${BUDGET_MIB:-13}" --rest .device/compile_cache_rest.tar.xz
