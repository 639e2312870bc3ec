#!/usr/bin/env bash
# Builds the release's container images without a container daemon or a registry, with rootful podman
# (Debian's packages); the Makefile runs it (`make images`, after `make dist`), then tests/images/.
#
#   tools/images.sh tools     installs podman, buildah, debootstrap and runc with apt-get (root), or says how
#   tools/images.sh base      the base image, $BASE_IMAGE (localhost/mm-encoder-base:bookworm): Debian 12 from
#                             Debian's archive by debootstrap, imported; built only when missing
#   tools/images.sh cpu       docker/Dockerfile.cpu  -> mm-encoder:<version>-cpu
#   tools/images.sh vllm      docker/Dockerfile.vllm -> mm-encoder-vllm:<version>-cpu
#   tools/images.sh all       all four, in that order (what `make images` runs)
#   tools/images.sh podman-args   prints the flags `podman run` needs on this host (tests/images/ reads them)
#
# pip inside the build uses the host's package sources: the index, extra indexes and find-links that
# `pip config list` reports here are written to a pip.conf that is bind-mounted at /etc/pip.conf for the
# build's RUN steps only, with the local directories they name mounted read-only at the same paths (and
# the CA bundle pip trusts, `cert`, at /etc/pip-ca.pem: a TLS-intercepting proxy's CA is in it);
# TORCH_INDEX_URL is passed empty so torch comes from those sources too. Nothing of that stays in an image.
# Each step prints its wall time and each image its size. podman's flags for this kind of sandbox: runc
# (crun refuses cgroups in hybrid mode), the host network, and ulimits no higher than the host's.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' mm_encoder/_version.py)
BASE_IMAGE=${BASE_IMAGE:-localhost/mm-encoder-base:bookworm}
CPU_IMAGE=${CPU_IMAGE:-mm-encoder:$VERSION-cpu}
VLLM_IMAGE=${VLLM_IMAGE:-mm-encoder-vllm:$VERSION-cpu}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PY=${PY:-python3}
TOOLS="podman buildah debootstrap runc"
WHEEL=dist/mm_encoder-$VERSION-py3-none-any.whl

# runc: crun refuses a host whose cgroup v2 hierarchy has controllers beside v1's ("hybrid mode").
# nproc: a container may not raise the limit above what this host grants a new process (32768 here).
podman_args() {
    local nofile
    nofile=$(ulimit -Hn)
    [ "$nofile" = unlimited ] && nofile=1048576
    echo "--runtime=runc --network=host --ulimit=nofile=$nofile:$nofile --ulimit=nproc=${IMAGES_NPROC:-32768}:${IMAGES_NPROC:-32768}"
}

need_root() {
    [ "$(id -u)" = 0 ] && return 0
    echo "error: building the images needs root: rootful podman (its storage, bind mounts, the host network) and"
    echo "  debootstrap; run: sudo make images"
    exit 1
}

need_tools() {
    need_root
    local missing=()
    for t in $TOOLS; do command -v "$t" > /dev/null || missing+=("$t"); done
    [ ${#missing[@]} = 0 ] && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
        echo "installing ${missing[*]} with apt-get"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq --no-install-recommends $TOOLS > /dev/null 2>&1 ||
            { apt-get update -qq && apt-get install -y -qq --no-install-recommends $TOOLS > /dev/null; } ||
            { echo "error: apt-get could not install $TOOLS"; exit 1; }
    else
        echo "error: building the images needs ${missing[*]} and root (rootful podman, debootstrap):"
        echo "  apt-get install -y --no-install-recommends $TOOLS"
        exit 1
    fi
}

timed() {  # timed LABEL COMMAND...: runs it, then prints its wall time
    local start=$SECONDS
    "${@:2}"
    echo "$1: $((SECONDS - start)) s"
}

image_size() {
    podman image inspect --format '{{.Size}}' "$1" | awk -v n="$1" '{ printf "%s: %.0f MB\n", n, $1 / 1e6 }'
}

build_base() {
    if podman image exists "$BASE_IMAGE"; then
        echo "$BASE_IMAGE exists (podman rmi $BASE_IMAGE to rebuild it)"
        return 0
    fi
    local root
    root=$(mktemp -d /var/tmp/mm-encoder-base.XXXXXX)
    echo "debootstrap bookworm from $DEBIAN_MIRROR"
    # minbase, like debian:bookworm-slim, plus Python 3.11 (the torch wheels' cp311)
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$root/rootfs" "$DEBIAN_MIRROR" > "$root/debootstrap.log" 2>&1 ||
        { tail -20 "$root/debootstrap.log"; rm -rf "$root"; echo "error: debootstrap failed"; return 1; }
    cat > "$root/rootfs/etc/apt/sources.list" <<EOF
deb $DEBIAN_MIRROR bookworm main
deb $DEBIAN_MIRROR bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
    rm -rf "$root"/rootfs/var/lib/apt/lists/* "$root"/rootfs/var/cache/apt/archives/*.deb
    tar -C "$root/rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' \
        --message "Debian 12 (bookworm) minbase + python3 by debootstrap from $DEBIAN_MIRROR" - "$BASE_IMAGE" \
        > /dev/null 2>&1 || { rm -rf "$root"; echo "error: podman import failed"; return 1; }
    rm -rf "$root"
    image_size "$BASE_IMAGE"
}

# The host's package sources as one pip.conf, and a --volume for each local directory it names. pip's
# precedence: its environment (PIP_*) over the user's files over site's over the global ones.
pip_sources() {
    local conf=$1 line scope key value path rank
    local -A values ranks mounts
    while IFS= read -r line; do
        scope=${line%%.*} key=${line%%=*} key=${key#*.} value=${line#*=} value=${value#\'} value=${value%\'}
        case $key in cert|index-url|extra-index-url|find-links|trusted-host|no-index|default-timeout|timeout) ;; *) continue ;; esac
        case $scope in :env:) rank=4 ;; user) rank=3 ;; site) rank=2 ;; *) rank=1 ;; esac
        [ "${ranks[$key]:-0}" -le "$rank" ] && { values[$key]=$value; ranks[$key]=$rank; }
    done < <("$PY" -m pip config list 2>/dev/null)
    echo "[global]" > "$conf"
    VOLUMES=(--volume "$conf:/etc/pip.conf:ro")
    if [ -n "${values[cert]:-}" ]; then  # the CA bundle pip trusts here (a TLS proxy's CA among them)
        VOLUMES+=(--volume "${values[cert]}:/etc/pip-ca.pem:ro")
        values[cert]=/etc/pip-ca.pem
    fi
    for key in "${!values[@]}"; do
        echo "$key = ${values[$key]}" >> "$conf"
        for path in ${values[$key]}; do
            path=${path#file://}
            [ "$key" != cert ] && [ "${path:0:1}" = / ] || continue
            [ "$(basename "$path")" = simple ] && path=$(dirname "$path")  # an index's files lie beside it
            [ -e "$path" ] && [ -z "${mounts[$path]:-}" ] && { mounts[$path]=1; VOLUMES+=(--volume "$path:$path:ro"); }
        done
    done
}

build_image() {  # build_image DOCKERFILE TAG
    [ -f "$WHEEL" ] || { echo "error: $WHEEL is missing: run make dist first"; return 1; }
    podman image exists "$BASE_IMAGE" || { echo "error: no $BASE_IMAGE: tools/images.sh base"; return 1; }
    local tmp
    tmp=$(mktemp -d /var/tmp/mm-encoder-pip.XXXXXX)
    pip_sources "$tmp/pip.conf"
    local rc=0
    # shellcheck disable=SC2046  # podman_args is a list of flags
    podman build $(podman_args) "${VOLUMES[@]}" --format docker --layers --force-rm \
        --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg MM_ENCODER_VERSION="$VERSION" \
        --build-arg TORCH_INDEX_URL= -f "$1" -t "$2" . || rc=$?
    rm -rf "$tmp"
    [ "$rc" = 0 ] || { echo "error: podman build -f $1 failed"; return "$rc"; }
    image_size "$2"
}

case "${1:-}" in
    tools) need_tools ;;
    base) need_tools; timed "base image" build_base ;;
    cpu) need_root; timed "$CPU_IMAGE" build_image docker/Dockerfile.cpu "$CPU_IMAGE" ;;
    vllm) need_root; timed "$VLLM_IMAGE" build_image docker/Dockerfile.vllm "$VLLM_IMAGE" ;;
    all) need_tools; timed "base image" build_base
         timed "$CPU_IMAGE" build_image docker/Dockerfile.cpu "$CPU_IMAGE"
         timed "$VLLM_IMAGE" build_image docker/Dockerfile.vllm "$VLLM_IMAGE" ;;
    podman-args) podman_args ;;
    *) echo "usage: tools/images.sh tools|base|cpu|vllm|all|podman-args" >&2; exit 2 ;;
esac
