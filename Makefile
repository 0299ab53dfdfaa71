# Two entry points: `make demo` and `make test`. Both create the environment if missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (2 = this project's 2-core machines; `XDIST_N=auto` for more, 0 = serial).
XDIST_N ?= 2

.PHONY: env demo test test-gpu lint clean

# transformers 5.24 (Muse Spark) goes to $(VENV)/extra/transformers-5.24, beside the venv's pinned one.
env:
	@bash scripts/bootstrap_env.sh
	@VENV=$(VENV) bash scripts/install_transformers_extra.sh

demo: env
	$(VENV)/bin/latency-specialized generate --model kimi_k3 --batch 2 --max-tokens 24 \
		--prompt "The quick brown fox" --show-plan --show-trace

# CPU suite (GPU tests are deselected here; run them on a GPU machine with `make test-gpu`), in parallel
# with pytest-xdist where the bootstrap could install it (tests/conftest.py groups what must share a worker).
test: env
	@if [ "$(XDIST_N)" != "0" ] && $(PY) -c "import xdist" 2>/dev/null; then \
		echo "$(PY) -m pytest -m \"not gpu\" -n $(XDIST_N) --dist loadgroup $(PYTEST_ARGS)"; \
		$(PY) -m pytest -m "not gpu" -n $(XDIST_N) --dist loadgroup $(PYTEST_ARGS); \
	else \
		[ "$(XDIST_N)" = "0" ] || echo "!!!!! WARNING: pytest-xdist is not installed in $(VENV): running the CPU suite SERIALLY (about 25 min on 2 cores) !!!!!" >&2; \
		$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS); \
	fi

test-gpu: env
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
