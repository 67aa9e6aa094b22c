#!/usr/bin/env bash
# Build the worker image and test it on this machine's CPU (what `make image` and `make image-test` run):
#
#   worker_image/image.sh build   # the image from worker_image/ (the real lock, GPU packages included)
#   worker_image/image.sh test    # inside the image, offline: build.sh verify, every fast-path package
#                                 #   imports, a short SFT and GRPO job through the handler; then a train
#                                 #   flow through localpod with the worker in a container of the image
#
# The base is debian:bookworm-slim when the engine has it or can pull it; otherwise (no registry) the same
# distribution is built from Debian's packages by base_image.sh. A build behind a TLS-intercepting proxy
# trusts the CA bundle pip trusts here (PIP_CERT or pip's `global.cert`), in the build stage only.
# Settings (environment): DOCKER (default docker), BASE (skip the base choice), the build.sh tag settings
# (IMAGE_REPO, TORCH_CUDA_ARCH_LIST), PYTHON (the control-plane interpreter for the flow test, default
# .venv/bin/python).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
DOCKER="${DOCKER:-docker}"
TAG="$(bash "$HERE/build.sh" tag)"
REGISTRY_BASE="debian:bookworm-slim"

die() { echo "image.sh: $*" >&2; exit 1; }

require_engine() {
    "$DOCKER" info >/dev/null 2>&1 \
        || die "no Docker engine answers '$DOCKER info': start dockerd (apt-get install docker.io), or set DOCKER"
}

choose_base() {
    if [[ -n "${BASE:-}" ]]; then
        echo "$BASE"
    elif "$DOCKER" image inspect "$REGISTRY_BASE" >/dev/null 2>&1 \
            || timeout 120 "$DOCKER" pull --quiet "$REGISTRY_BASE" >/dev/null 2>&1; then
        echo "$REGISTRY_BASE"
    else
        echo "image.sh: $REGISTRY_BASE cannot be pulled: building the same base from Debian's packages" >&2
        DOCKER="$DOCKER" bash "$HERE/base_image.sh"
    fi
}

build_ca() {
    local ca="${PIP_CERT:-}"
    if [[ -z "$ca" ]]; then
        ca="$(python3 -m pip config list 2>/dev/null | sed -n "s/^global\.cert='\(.*\)'\$/\1/p" | tail -n 1)"
    fi
    if [[ -n "$ca" && -f "$ca" ]]; then
        cp "$ca" "$HERE/build-ca/ca.crt"
        echo "image.sh: the build stage trusts $ca (not copied into the image)" >&2
    fi
}

step_build() {
    require_engine
    local base started size
    base="$(choose_base)"
    build_ca
    trap 'rm -f "$HERE/build-ca/ca.crt"' EXIT
    started=$SECONDS
    echo "image.sh: building $TAG on $base" >&2
    "$DOCKER" build --network host --build-arg "BASE=$base" --build-arg "IMAGE_TAG=$TAG" \
        --build-arg "CONTRACT_VERSION=$(bash "$HERE/build.sh" contract-version)" \
        --build-arg "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;8.6;8.9;9.0;10.0;12.0}" -t "$TAG" "$HERE"
    size="$("$DOCKER" image inspect --format '{{.Size}}' "$TAG")"
    echo "image.sh: built $TAG in $((SECONDS - started)) s; $((size / 1000000)) MB"
}

step_test() {
    require_engine
    "$DOCKER" image inspect "$TAG" >/dev/null 2>&1 || die "no image $TAG: run 'make image' first"
    # --network none: a job needs nothing from outside but its model, data and store (here all local).
    "$DOCKER" run --rm --network none -e OMP_NUM_THREADS=2 "$TAG" \
        bash -c 'bash /opt/loraflow/worker_image/build.sh verify && python -m loraflow_worker.self_test'
    local python="${PYTHON:-$REPO/.venv/bin/python}"
    LORAFLOW_IMAGE="$TAG" DOCKER="$DOCKER" "$python" -m pytest "$REPO/tests/image" -p no:cacheprovider
}

case "${1:-}" in
    build) step_build ;;
    test) step_test ;;
    *) die "usage: image.sh build|test" ;;
esac
