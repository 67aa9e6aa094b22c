#!/usr/bin/env bash
# The worker image's base, for machines that reach Debian's package mirror but no container registry
# (air-gapped builds, CI behind a proxy). The Dockerfile's default base is `debian:bookworm-slim`; this
# builds the same distribution from Debian's packages with debootstrap and imports it into Docker:
#
#   worker_image/base_image.sh            # prints the tag to pass as --build-arg BASE=...
#
# Settings (environment): BASE_TAG (default loraflow-base:bookworm), DEBIAN_MIRROR (default
# http://deb.debian.org/debian), DOCKER (default docker). Needs root, debootstrap and a Docker engine.
# An existing image with the tag is kept: delete it to rebuild.
set -euo pipefail

BASE_TAG="${BASE_TAG:-loraflow-base:bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DOCKER="${DOCKER:-docker}"
# bookworm: Python 3.11 and glibc 2.36, the platform requirements-gpu.lock is compiled for.
SUITE=bookworm

die() { echo "base_image.sh: $*" >&2; exit 1; }

if "$DOCKER" image inspect "$BASE_TAG" >/dev/null 2>&1; then
    echo "$BASE_TAG"
    exit 0
fi
command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
[[ "$(id -u)" == 0 ]] || die "debootstrap needs root"

root="$(mktemp -d "${TMPDIR:-/tmp}/loraflow-base.XXXXXX")"
trap 'rm -rf "$root"' EXIT
echo "base_image.sh: debootstrap $SUITE from $DEBIAN_MIRROR into $root" >&2
debootstrap --variant=minbase "$SUITE" "$root" "$DEBIAN_MIRROR" >&2
# As in Debian's own slim images: no package lists or caches in the base layer.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
tar --numeric-owner -C "$root" -c . | "$DOCKER" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' - "$BASE_TAG" >&2
echo "$BASE_TAG"
