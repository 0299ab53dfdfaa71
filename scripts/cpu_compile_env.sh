#!/usr/bin/env bash
# A Python 3.12 environment on this CPU machine that compiles kernels exactly as the GPU machine does, so that the
# kernels a GPU run recorded (tests/compile_records.json.gz) compile here and their caches travel with the first
# device call (benchmarks/NOTES_gpu_suite.md): the device's own Triton (3.6.0, cp312), its CuTe DSL parts
# (../shared/device/cute-a + cute-b: nvidia-cutlass-dsl 4.8.0 for CUDA 13, apache-tvm-ffi 0.1.11) and a cp312 torch
# (the kernel modules import it; its version does not enter any cache key). ~3 GB from the local wheel store.
#   bash scripts/cpu_compile_env.sh            # builds $V312 (default /tmp/v312) and $CUTE312 (default /tmp/cute312)
#   then: source scripts/cpu_compile_env.sh --activate   (PYTHONPATH for the CuTe DSL; $PY312 the interpreter)
set -euo pipefail
V312=${V312:-/tmp/v312}
CUTE312=${CUTE312:-/tmp/cute312}
SHARED=${SHARED_DEVICE:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/../shared/device}
if [ "${1:-}" = --activate ]; then
  export PY312="$V312/bin/python" CUTE_DSL_ARCH=sm_90a
  export PYTHONPATH="$PWD:$CUTE312:$CUTE312/nvidia_cutlass_dsl/dsl_packages"
  return 0 2>/dev/null || exit 0
fi
py=$(ls -d "$(pyenv root 2>/dev/null || echo /root/.pyenv)"/versions/3.12.*/bin/python 2>/dev/null | tail -1)
[ -x "$py" ] || { echo "no Python 3.12 here (pyenv versions/3.12.*): the device's wheels are cp312" >&2; exit 2; }
[ -x "$V312/bin/python" ] || "$py" -m venv "$V312"
pip="$V312/bin/pip -q --disable-pip-version-check"
# the device's Triton; torch without its pins (it names another Triton), then what it and the kernel modules import
# (pydantic: mlp_fused's configs; the device gets it from .whl)
$pip install --no-deps triton==3.6.0 torch==2.14.1
$pip install pydantic filelock typing-extensions sympy networkx jinja2 fsspec numpy "setuptools>=77.0.3" \
  "cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3" \
  "cuda-bindings>=13.0.3,<14" nvidia-cudnn-cu13==9.24.0.43 nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.30.7 \
  nvidia-nvshmem-cu13==3.4.5 2>&1 | grep -v "dependency resolver\|requires triton" || true
if [ ! -f "$CUTE312/.ok" ]; then
  mkdir -p "$CUTE312"
  cat "$SHARED/cute-a/part.00" "$SHARED/cute-b/part.01" > /tmp/cute312.tar.xz
  echo "$(cat "$SHARED/cute-b/full.sha256")  /tmp/cute312.tar.xz" | sha256sum -c --quiet
  tar -C "$CUTE312" -xJf /tmp/cute312.tar.xz && tar -C "$CUTE312" -xJf "$SHARED/cute-b/core.tar.xz"
  $pip install --no-index --no-deps --no-compile --target "$CUTE312" "$SHARED"/cute-b/apache_tvm_ffi-*.whl
  rm -f /tmp/cute312.tar.xz && touch "$CUTE312/.ok"
fi
# shellcheck disable=SC1091
source "${BASH_SOURCE[0]}" --activate
"$PY312" -c "
from latency_specialized.testing.triton_specs import toolchain_fingerprint
from latency_specialized.kernels.compile_cache import disk_dir
import os; os.environ.setdefault('LS_KERNEL_CACHE_DIR', '/tmp/ls_kcache')
print('toolchain:', toolchain_fingerprint()); print('cute cache:', disk_dir())"
