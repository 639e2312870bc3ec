# One entry point for set-up, the demo, tests, lint and benchmarks.
# `make demo` and `make test` create or refresh .venv themselves (see README).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv demo worker test lint bench clean

$(STAMP): pyproject.toml Makefile
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "mm-encoder needs Python >= 3.10, found " + sys.version.split()[0])'
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || { echo "error: cannot create a virtualenv: install python3-venv (apt-get install python3-venv)"; exit 1; }
	$(BIN)/python -m pip install -q --upgrade pip
	# Pinned here, not in pyproject: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e '.[dev,dynamo]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/mm-encoder demo

worker: $(STAMP)
	$(BIN)/python -m mm_encoder.worker

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/encoder.py
	$(BIN)/python bench/wire.py
	$(BIN)/python bench/worker.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
