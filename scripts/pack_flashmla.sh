#!/usr/bin/env bash
# Pack FlashMLA's sources (without its SM100 part) and the CUTLASS its submodule pins into .device/flashmla.tgz
# (~2.6 MB) for the H200, where scripts/device_env.sh unpacks it and sets LS_FLASHMLA_SRC.
#   bash scripts/pack_flashmla.sh FLASHMLA_GIT_DIR CUTLASS_GIT_DIR
# Both arguments are git directories (clones or bare mirrors) of github.com/deepseek-ai/FlashMLA and
# github.com/NVIDIA/cutlass; the CUTLASS commit is the one FlashMLA's HEAD records for csrc/cutlass.
set -euo pipefail
fm=$1 cutlass=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/flashmla/csrc/cutlass"
git -C "$fm" archive HEAD csrc flash_mla LICENSE | tar -x -C "$tmp/flashmla"
rm -rf "$tmp/flashmla/csrc/sm100"
pin=$(git -C "$fm" ls-tree HEAD csrc/cutlass | awk '{print $3}')
git -C "$cutlass" archive "$pin" include tools/util/include LICENSE.txt | tar -x -C "$tmp/flashmla/csrc/cutlass"
# (a mirror without some large media blobs makes git archive complain about them; the headers are what counts)
for f in csrc/cutlass/include/cute/tensor.hpp csrc/sm90/decode/dense/instantiations/bf16.cu csrc/api/dense_decode.h; do
  [ -f "$tmp/flashmla/$f" ] || { echo "pack_flashmla: $f missing from the archive" >&2; exit 1; }
done
echo "FlashMLA $(git -C "$fm" rev-parse --short HEAD), CUTLASS $pin" > "$tmp/flashmla/VERSION"
mkdir -p .device
tar czf .device/flashmla.tgz -C "$tmp" flashmla
echo "wrote .device/flashmla.tgz ($(du -h .device/flashmla.tgz | cut -f1)): $(cat "$tmp/flashmla/VERSION")"
