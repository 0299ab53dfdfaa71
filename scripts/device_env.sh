# Source on the H200 device machine (from the repo root) to get this project importable there.
#   first call on a fresh machine:  bash .device/cute-a/stash.sh   (carry .device/cute-a)
#   then, same machine:             source scripts/device_env.sh && ...   (carry .device/cute-b and .whl)
# Installs the carried pure-Python wheels (pydantic & co are not in the device image), puts
# nvidia-cutlass-dsl 4.8.0 on PYTHONPATH and installs this project editable without network.
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ ! -f /tmp/site/.ok ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.ok
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if [ -d .device/cute-b ]; then source .device/cute-b/activate.sh; fi
# FlashMLA source for the stock MLA layers (scripts/pack_flashmla.sh makes the archive; carry .device/flashmla.tgz)
if [ -f .device/flashmla.tgz ] && [ ! -d /tmp/fm/flashmla ]; then mkdir -p /tmp/fm && tar xzf .device/flashmla.tgz -C /tmp/fm; fi
if [ -d /tmp/fm/flashmla ]; then export LS_FLASHMLA_SRC=/tmp/fm/flashmla; fi
if ! python3 -c "import latency_specialized_models" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/ls_install.log 2>&1 \
    || { echo "editable install failed:"; tail -20 /tmp/ls_install.log; }
fi
python3 -c "import torch, latency_specialized; print('device env:', torch.__version__, torch.cuda.get_device_name(0))"
