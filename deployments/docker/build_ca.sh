#!/usr/bin/env bash
# The control-plane image build's extra CA bundle (see build-ca/README.md); prefect.yaml's build steps run
#
#   deployments/docker/build_ca.sh copy     # the bundle pip trusts here (PIP_CERT, else pip's `global.cert`)
#                                           #   into build-ca/ca.crt; nothing when there is none
#   deployments/docker/build_ca.sh remove   # delete build-ca/ca.crt again
#
# Settings (environment): PIP_CERT, PYTHON (the interpreter whose pip config is read; default python3).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TARGET="$HERE/build-ca/ca.crt"

case "${1:-}" in
    copy)
        ca="${PIP_CERT:-}"
        if [[ -z "$ca" ]]; then
            ca="$("${PYTHON:-python3}" -m pip config list 2>/dev/null | sed -n "s/^global\.cert='\(.*\)'\$/\1/p" | tail -n 1)"
        fi
        if [[ -n "$ca" && -f "$ca" ]]; then
            cp "$ca" "$TARGET"
            echo "build_ca.sh: the build stage trusts $ca (not copied into the image)"
        fi
        ;;
    remove) rm -f "$TARGET" ;;
    *) echo "usage: build_ca.sh copy|remove" >&2; exit 2 ;;
esac
