# Two entry points: `make demo` and `make test`. Both create the environment if missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: env demo test test-gpu lint clean

# transformers 5.24 (Muse Spark) goes to $(VENV)/extra/transformers-5.24, beside the venv's pinned one.
env:
	@bash scripts/bootstrap_env.sh
	@VENV=$(VENV) bash scripts/install_transformers_extra.sh

demo: env
	$(VENV)/bin/latency-specialized generate --model kimi_k3 --batch 2 --max-tokens 24 \
		--prompt "The quick brown fox" --show-plan --show-trace

# CPU suite (GPU tests are deselected here; run them on a GPU machine with `make test-gpu`).
test: env
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

test-gpu: env
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
